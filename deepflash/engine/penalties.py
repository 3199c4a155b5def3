"""Presence, frequency and repetition penalties on the target's logits, from device-resident token counts.

vLLM's semantics: presence and frequency (OpenAI's) subtract `presence` from the logit of every token
generated so far and `frequency` times its count; repetition divides positive logits (multiplies negative
ones) of every token seen in the prompt or the output by `repetition` (the CTRL / transformers rule).

A verify block chooses at each of its positions as plain decoding would there: the counts before the
choice at block position k include the block's tokens up to k (the newest committed token, then the drafts
before k), which are the output at that point exactly when the drafts before k are accepted; a choice after
a rejected draft is discarded anyway. So speculative output equals plain output under the same penalties.
"""

from __future__ import annotations

import torch

from .sampling import SamplingBuffers


class TokenCounts:
    """A request's tokens by vocabulary id, on the device: which the prompt holds, and how often each was
    generated. The newest generated token (a step's `last`) is counted by the step that feeds it to the
    target (commit), so a step's counts are those before it plus what it feeds."""

    def __init__(self, vocab: int, device: torch.device | str):
        self.generated = torch.zeros(vocab, dtype=torch.int32, device=device)
        self.prompt = torch.zeros(vocab, dtype=torch.bool, device=device)

    def reset(self, prompt: torch.Tensor) -> None:
        """Host work between requests: no output yet, the prompt's tokens seen."""
        self.generated.zero_()
        self.prompt.zero_()
        self.prompt[prompt] = True

    def before(self, fed: torch.Tensor | None) -> torch.Tensor:
        """Counts [T, vocab] before each choice of a step that feeds the T tokens `fed` (the newest generated
        token, then a block's drafts): row k also counts fed[0..k]. None (the prefill): [1, vocab], as is."""
        if fed is None:
            return self.generated[None]
        one_hot = torch.zeros((fed.shape[0], self.generated.shape[0]), dtype=torch.int32, device=fed.device)
        return self.generated[None] + one_hot.scatter_(1, fed[:, None], 1).cumsum(0, dtype=torch.int32)

    def commit(self, fed: torch.Tensor, kept: torch.Tensor | int) -> None:
        """fed[:kept] joined the output (kept: a device count, or an int)."""
        counted = (torch.arange(fed.shape[0], device=fed.device) < kept).to(torch.int32)
        self.generated.scatter_add_(0, fed, counted)


def penalize(logits: torch.Tensor, generated: torch.Tensor, prompt: torch.Tensor,
             values: SamplingBuffers) -> torch.Tensor:
    """float32 logits [N, V] with the penalties of `values` for rows of generated-token counts [N, V] and
    the prompt's tokens [V]."""
    scores = logits.float()
    seen = prompt[None] | (generated > 0)
    repeated = torch.where(scores > 0, scores / values.repetition, scores * values.repetition)
    scores = torch.where(seen, repeated, scores)
    return scores - values.frequency * generated - values.presence * (generated > 0)
