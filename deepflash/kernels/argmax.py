"""Each row's argmax over a step's logits (the greedy choice) in Triton.

torch's argmax took 13 us per call for the 1-16 rows of SmolLM2's 49152 logits on an H200: twice per
speculative step (the draft's and the verify's), 26 of its 1127 us of device time, and once per plain
step (H200 profile). Here each SLICE values of a row go to a
program of their own, which finds its slice's largest value and where it first occurs; the row's last
slice to finish (an arrival counter, kernels/arrivals.py) compares the slices in order. The
result is torch's, index for index: the first largest value, where a NaN counts as the largest (the first
NaN wins). So greedy outputs do not change, only the time.
"""

from __future__ import annotations

import torch

from .arrivals import arrival_counters
from .triton_support import tl, triton

MAX_ROWS = 64  # decode, draft and verify steps; longer inputs keep torch's argmax
SLICE = 4096  # values per program: 12 programs for a SmolLM2 row, 38 for a Qwen3 one (151936)


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's argmax [N] (int64) of logits [N, V], into `out` where given (a draft's tokens go where
    the verify reads them, with no copy kernel): the kernel on CUDA, torch's elsewhere (and for other
    shapes)."""
    if logits.device.type != "cuda" or triton is None or logits.dim() != 2 or logits.shape[0] > MAX_ROWS:
        chosen = logits.argmax(dim=-1)
        return chosen if out is None else out.copy_(chosen)
    return rows_argmax(logits, out)


def rows_argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel (what argmax runs on CUDA; the tests run it in Triton's interpreter). out: [N] int64,
    contiguous."""
    rows, vocab = logits.shape
    assert rows <= MAX_ROWS, rows
    slices = triton.cdiv(vocab, SLICE)
    best = torch.empty((rows, slices), dtype=torch.float32, device=logits.device)
    where = torch.empty((rows, slices), dtype=torch.int32, device=logits.device)
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    assert out.shape == (rows,) and out.dtype == torch.int64 and out.is_contiguous(), (out.shape, out.dtype)
    arrivals = arrival_counters("argmax", MAX_ROWS, logits.device)  # per row
    _argmax[(rows, slices)](logits.contiguous(), best, where, arrivals, out, vocab, SLICES=slices,
                            SLICES_POW2=triton.next_power_of_2(slices), SLICE=SLICE, num_warps=8)
    return out


if triton is not None:

    @triton.jit
    def _first(values, at, NONE: tl.constexpr):
        """(the largest of values, the first of `at` holding it), a NaN counting as the largest (the
        largest is then NaN); at must rise along values, and NONE exceed every index. No branch: compiled
        Triton refuses a helper whose returns differ in type (compile_kernels.py)."""
        nan = values != values
        any_nan = tl.max(nan.to(tl.int32), axis=0) > 0
        top = tl.max(tl.where(nan, float("-inf"), values), axis=0)
        chosen = tl.where(any_nan, nan, values == top)
        return tl.where(any_nan, float("nan"), top), tl.min(tl.where(chosen, at, NONE), axis=0)

    @triton.jit
    def _argmax(logits, best, where, arrivals, out, vocab, SLICES: tl.constexpr, SLICES_POW2: tl.constexpr,
                SLICE: tl.constexpr):
        row, piece = tl.program_id(0), tl.program_id(1)
        cols = piece * SLICE + tl.arange(0, SLICE)
        x = tl.load(logits + row * vocab + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        # past the vocabulary only -inf, which never comes before a real value's index (cols rise)
        top, at = _first(x, cols, 2**31 - 1)
        tl.store(best + row * SLICES + piece, top)
        tl.store(where + row * SLICES + piece, at)
        tl.debug_barrier()  # every thread's stores precede the release below
        if tl.atomic_add(arrivals + row, 1, sem="acq_rel", scope="gpu") == SLICES - 1:
            j = tl.arange(0, SLICES_POW2)
            live = j < SLICES
            # through L2 (".cg"): other SMs wrote them; a padding slot is -inf at an index past them all
            tops = tl.load(best + row * SLICES + j, mask=live, other=float("-inf"), cache_modifier=".cg")
            ats = tl.load(where + row * SLICES + j, mask=live, other=2**31 - 1, cache_modifier=".cg")
            _, first = _first(tops, ats, 2**31 - 1)
            tl.atomic_xchg(arrivals + row, 0)  # ready for the next call
            tl.store(out + row, first.to(tl.int64))
