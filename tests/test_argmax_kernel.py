"""The greedy choice's kernel (kernels/argmax.py) returns torch's argmax, index for index (on the CPU in
Triton's interpreter: helpers.triton_device)."""

import pytest
import torch
from helpers import triton_device

from deepflash.kernels import argmax as argmax_kernel
from deepflash.kernels.argmax import SLICE, rows_argmax

DEVICE = triton_device()


@pytest.mark.parametrize("rows,vocab,dtype", [(1, 3 * SLICE, torch.bfloat16), (16, 3 * SLICE + 5, torch.bfloat16),
                                               (64, SLICE // 2, torch.float32), (3, 2 * SLICE - 1, torch.float16)])
def test_rows_argmax_equals_torch(rows, vocab, dtype):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)).to(dtype).to(DEVICE)
    for _ in range(2):  # the second call finds the arrival counters set back to 0
        assert torch.equal(rows_argmax(logits), logits.argmax(dim=-1))
    # into a row of a step buffer (a draft's tokens where the verify reads them), its neighbours untouched
    buffer = torch.full((2, rows + 2), -5, dtype=torch.long, device=DEVICE)
    rows_argmax(logits, out=buffer[1, 1 : rows + 1])
    assert torch.equal(buffer[1, 1 : rows + 1], logits.argmax(dim=-1))
    assert (buffer[0] == -5).all() and int(buffer[1, 0]) == int(buffer[1, -1]) == -5


def test_rows_argmax_ties_nan_and_infinities_as_torch():
    """A tie across slices goes to the first index, a NaN counts as the largest (the first NaN wins),
    and a row of -inf gives 0: torch's rules."""
    logits = torch.zeros(5, 2 * SLICE + 100)
    logits[0, [SLICE + 7, 2 * SLICE + 3]] = 3.0  # tie across slices
    logits[0, 10] = 2.0
    logits[1] = float("-inf")
    logits[2, [SLICE + 1, 2 * SLICE + 50]] = float("nan")
    logits[2, 5] = float("inf")
    logits[3, -1] = 1.0  # in the last, partial slice
    logits[4, [3, 4]] = float("inf")
    expected = torch.tensor([SLICE + 7, 0, SLICE + 1, 2 * SLICE + 99, 3])
    assert torch.equal(logits.argmax(dim=-1), expected)
    assert torch.equal(rows_argmax(logits.to(DEVICE)).cpu(), expected)


def test_argmax_keeps_torch_off_cuda_and_beyond_its_rows(monkeypatch):
    """Off CUDA, for more rows than a step has, or for other shapes, argmax is torch's."""
    monkeypatch.setattr(argmax_kernel, "rows_argmax", lambda logits: pytest.fail("the kernel ran"))
    for shape in [(3, 100), (argmax_kernel.MAX_ROWS + 1, 100), (2, 3, 100)]:
        logits = torch.randn(shape)
        assert torch.equal(argmax_kernel.argmax(logits), logits.argmax(dim=-1))
        out = torch.empty(logits.shape[:-1], dtype=torch.long)
        assert argmax_kernel.argmax(logits, out) is out and torch.equal(out, logits.argmax(dim=-1))
