"""A verify step's acceptance in one Triton kernel: how many drafts the target's choices confirm, and
the state the next step reads.

The torch form (accept_torch) runs as about ten small kernels at the end of every speculative step
(compare, cumulative product, sum, the kept count, copies, a gather, adds), each a launch on the step's
critical path. Here one program of one warp reads the drafts and the choices and writes everything, the
same values: on the embedded pair a verify step's time -1.6%, same outputs (H200). It also posts the
result to the host (the mailbox's slot), where a post kernel of its own would run after it.
"""

from __future__ import annotations

import torch

from .mailbox import Mailbox
from .triton_support import tl, triton


def accept(drafts: torch.Tensor, choices: torch.Tensor, result: torch.Tensor, last: torch.Tensor,
           start: torch.Tensor, kept: torch.Tensor, mailbox: Mailbox) -> None:
    """drafts [B-1] and the target's choices [B] at the block's positions (int64): accepted = the
    longest prefix with drafts[k] == choices[k]; writes result[0] = accepted, result[1:B+1] = choices,
    last = choices[accepted] (the bonus token), kept = accepted + 1, and start += kept; then posts
    result[:B+1] to the mailbox. The kernel, posting too, where the mailbox takes a kernel's writes (CUDA
    with Triton); accept_torch and Mailbox.post elsewhere."""
    if mailbox.direct:
        return accept_kernel(drafts, choices, result, last, start, kept, (mailbox.posted, mailbox.host))
    accept_torch(drafts, choices, result, last, start, kept)
    mailbox.post(result)


def accept_torch(drafts, choices, result, last, start, kept) -> None:
    accepted = (drafts == choices[:-1]).cumprod(0).sum()
    kept.copy_(accepted + 1)
    result[:1].copy_(accepted.view(1))
    result[1 : choices.shape[0] + 1].copy_(choices)
    last.copy_(choices.gather(0, accepted.view(1)))  # gather, not choices[accepted]: no host sync
    start += kept


def accept_kernel(drafts, choices, result, last, start, kept, mailbox=None) -> None:
    """The kernel (what accept runs on CUDA; the tests run it in Triton's interpreter). mailbox: (posted,
    slots) of a Mailbox, whose slot posted % slots gets [posted, result[:B+1]] and posted += 1 (as
    mailbox.post_kernel writes them), or None."""
    size = choices.shape[0]
    assert drafts.shape[0] == size - 1 and result.shape[0] >= size + 1, (drafts.shape, choices.shape, result.shape)
    posted, slots = mailbox if mailbox is not None else (start, result[None])  # unread without POST
    assert mailbox is None or slots.shape[1] >= size + 2, (slots.shape, size)
    _accept[(1,)](drafts, choices, result, last, start, kept, posted, slots, SIZE=size,
                  BLOCK=triton.next_power_of_2(size + 2), POST=mailbox is not None, SLOTS=slots.shape[0],
                  ROW=slots.shape[1], num_warps=1)


if triton is not None:

    @triton.jit
    def _accept(drafts, choices, result, last, start, kept, posted, slots, SIZE: tl.constexpr, BLOCK: tl.constexpr,
                POST: tl.constexpr, SLOTS: tl.constexpr, ROW: tl.constexpr):
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
        if POST:  # [step number, accepted, choices...] into the mailbox's slot (mailbox._post's row)
            number = tl.load(posted)
            chosen_before = tl.load(choices + i - 2, mask=(i >= 2) & (i < SIZE + 2), other=0)
            row = tl.where(i == 0, number, tl.where(i == 1, accepted.to(tl.int64), chosen_before))
            tl.store(slots + (number % SLOTS) * ROW + i, row, mask=i < SIZE + 2)
            tl.store(posted, number + 1)
