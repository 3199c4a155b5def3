"""The verify step's acceptance kernel against its torch form (Triton's interpreter on the CPU)."""

import pytest
import torch
from helpers import triton_device

from deepflash.accept_kernel import accept_kernel, accept_torch

DEVICE = triton_device()


def outputs(fn, drafts, choices, start):
    state = [torch.full((choices.shape[0] + 3,), -7), torch.zeros(1, dtype=torch.long),
             torch.tensor(start), torch.zeros((), dtype=torch.long)]
    state = [t.to(DEVICE) for t in state]
    fn(drafts.to(DEVICE), choices.to(DEVICE), *state)
    return [t.cpu() for t in state]


@pytest.mark.parametrize("size", [2, 5, 16])
def test_accept_kernel_writes_what_the_torch_form_writes(size):
    gen = torch.Generator().manual_seed(size)
    choices = torch.randint(0, 50_000, (size,), generator=gen)
    for matched in range(size):  # every accepted length, from none to all drafts
        drafts = choices[:-1].clone()
        if matched < size - 1:
            drafts[matched] += 1
            drafts[matched + 1 :] = torch.randint(0, 3, (size - 2 - matched,), generator=gen)  # later matches count not
        got = outputs(accept_kernel, drafts, choices, 1000 + size)
        want = outputs(accept_torch, drafts, choices, 1000 + size)
        for a, b in zip(got, want):
            assert torch.equal(a, b), (matched, got, want)
        result, last, start, kept = got
        assert int(result[0]) == matched and int(kept) == matched + 1 and int(start) == 1000 + size + matched + 1
        assert int(last) == int(choices[matched]) and int(result[-1]) == -7  # nothing past the block
