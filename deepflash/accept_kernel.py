"""A verify step's acceptance in one Triton kernel: how many drafts the target's choices confirm, and
the state the next step reads.

The torch form (accept_torch) runs as about ten small kernels at the end of every speculative step
(compare, cumulative product, sum, the kept count, copies, a gather, adds), each a launch on the step's
critical path. Here one program of one warp reads the drafts and the choices and writes everything, the
same values: on the embedded pair a verify step's time -1.6%, same outputs (scripts/gpu/kernels_ab.py,
BENCHMARKS.md, forty-third session).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch's CPU builds do not bring Triton
    triton = None

KERNEL = True  # False: the torch form on CUDA too (scripts/gpu/kernels_ab.py --arm "...=accept_kernel.KERNEL:False")


def accept(drafts: torch.Tensor, choices: torch.Tensor, result: torch.Tensor, last: torch.Tensor,
           start: torch.Tensor, kept: torch.Tensor) -> None:
    """drafts [B-1] and the target's choices [B] at the block's positions (int64): accepted = the
    longest prefix with drafts[k] == choices[k]; writes result[0] = accepted, result[1:B+1] = choices,
    last = choices[accepted] (the bonus token), kept = accepted + 1, and start += kept. The kernel on
    CUDA, accept_torch elsewhere."""
    if not KERNEL or choices.device.type != "cuda" or triton is None:
        return accept_torch(drafts, choices, result, last, start, kept)
    accept_kernel(drafts, choices, result, last, start, kept)


def accept_torch(drafts, choices, result, last, start, kept) -> None:
    accepted = (drafts == choices[:-1]).cumprod(0).sum()
    kept.copy_(accepted + 1)
    result[:1].copy_(accepted.view(1))
    result[1 : choices.shape[0] + 1].copy_(choices)
    last.copy_(choices.gather(0, accepted.view(1)))  # gather, not choices[accepted]: no host sync
    start += kept


def accept_kernel(drafts, choices, result, last, start, kept) -> None:
    """The kernel (what accept runs on CUDA; the tests run it in Triton's interpreter)."""
    size = choices.shape[0]
    assert drafts.shape[0] == size - 1 and result.shape[0] >= size + 1, (drafts.shape, choices.shape, result.shape)
    _accept[(1,)](drafts, choices, result, last, start, kept, SIZE=size, BLOCK=triton.next_power_of_2(size),
                  num_warps=1)


if triton is not None:

    @triton.jit
    def _accept(drafts, choices, result, last, start, kept, SIZE: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        chosen = tl.load(choices + i, mask=i < SIZE, other=0)
        drafted = tl.load(drafts + i, mask=i < SIZE - 1, other=0)
        # the first draft the target did not choose; SIZE - 1 when every draft matches
        missed = (drafted != chosen) & (i < SIZE - 1)
        accepted = tl.min(tl.where(missed, i, SIZE - 1), axis=0)
        bonus = tl.sum(tl.where(i == accepted, chosen, 0), axis=0)
        tl.store(result + 1 + i, chosen, mask=i < SIZE)
        tl.store(result, accepted.to(tl.int64))
        tl.store(last, bonus)
        tl.store(kept, (accepted + 1).to(tl.int64))
        tl.store(start, tl.load(start) + accepted + 1)
