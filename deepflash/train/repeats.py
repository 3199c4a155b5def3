"""Anchors on a prompt's repeat of its own opening (train-drafter train --repeat-anchors).

A recall prompt (datagen.recall_ids) is a long opening followed by its own first tokens again: every
token of that repeat has its source exactly the opening's length back, beyond 4096 tokens in the far
recall data. Its response holds only --max-new-tokens positions to anchor on, and a drafter trained on
those learned to copy from ~1500 tokens back but barely from 4500 (H200, recall prompts by distance).
Marking the repeat as loss positions gives every such sequence thousands of far-copy
anchors for the one target pass it costs. Labels there are the text's tokens, which the target copies
where it can; with --distill they are the target's own distributions, whatever it would have said.
"""

from __future__ import annotations

import torch

from .shards import Sequence

# shorter repeats are left alone: a chat prompt repeating its own first tokens (its system turn) for
# hundreds of tokens does not happen, so only the recall prompts' constructed repeats qualify
MIN_REPEAT = 256
_PROBE = 8  # tokens of the opening a repeat must start with to be checked in full


def repeat_start(tokens: torch.Tensor, end: int, min_repeat: int = MIN_REPEAT) -> int | None:
    """The first position s at which tokens[s:end] repeats the text's own opening (tokens[:end - s]),
    with at least min_repeat tokens, or None."""
    if end <= min_repeat:
        return None
    windows = tokens[: end - min_repeat + _PROBE].unfold(0, _PROBE, 1)  # starts 0..end - min_repeat
    for s in torch.nonzero((windows == tokens[:_PROBE]).all(1)).flatten().tolist():
        if s > 0 and torch.equal(tokens[s:end], tokens[: end - s]):
            return s
    return None


def with_repeat_anchors(seq: Sequence, min_repeat: int = MIN_REPEAT) -> Sequence:
    """The sequence with its prompt's repeat of its opening (if any, min_repeat tokens at least) marked as
    loss positions too."""
    mask = seq.loss_mask
    end = int(mask.int().argmax()) if bool(mask.any()) else len(seq)
    start = repeat_start(seq.tokens, end, min_repeat)
    if start is None:
        return seq
    mask = mask.clone()
    mask[start:end] = True
    return Sequence(seq.tokens, mask)
