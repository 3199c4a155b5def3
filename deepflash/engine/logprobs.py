"""Log-probabilities of the chosen tokens, and of the likeliest alternatives, from the target's logits.

They are the target's own distribution at each emitted position (log-softmax of its logits, before
penalties, temperature and filters: vLLM's default), so a verify block's rows give plain decoding's values
(to the LM head's rounding: torch's GEMM may sum a block's rows in another order than one row's).
Each step writes its rows into a slot of a device buffer, as its result goes to the mailbox's slot (the
same numbering), and the host reads the slot once the step has completed, only for requests that asked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import MAX_LOGPROBS


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob) of the likeliest alternatives, best first


class LogprobSlots:
    """`slots` slots of [rows, 1 + 2 * MAX_LOGPROBS] float32: a row's chosen log-probability, then the top
    alternatives' log-probabilities and ids (ids are exact in float32 below 2**24)."""

    def __init__(self, slots: int, rows: int, device: torch.device | str):
        self.slots = slots
        self.data = torch.zeros((slots, rows, 1 + 2 * MAX_LOGPROBS), dtype=torch.float32, device=device)

    def write(self, number: torch.Tensor, logits: torch.Tensor, chosen: torch.Tensor, top: int) -> None:
        """Inside a step: rows for logits [N, V] and chosen tokens [N], `top` alternatives each, into slot
        number % slots (number: the step's, a device tensor)."""
        logprobs = logits.float().log_softmax(dim=-1)
        best = logprobs.topk(top, dim=-1)
        rows = torch.cat([logprobs.gather(1, chosen[:, None]), best.values, best.indices.float()], dim=1)
        padded = torch.zeros_like(self.data[0])
        padded[: rows.shape[0], : rows.shape[1]] = rows
        self.data.index_copy_(0, (number % self.slots).view(1), padded[None])

    def read(self, number: int, tokens: list[int], top: int) -> list[TokenLogprob]:
        """The rows of step `number`'s first len(tokens) choices (after the step has completed)."""
        rows = self.data[number % self.slots, : len(tokens), : 1 + 2 * top].tolist()
        return [TokenLogprob(token, row[0], tuple(zip(map(int, row[1 + top :]), row[1 : 1 + top])))
                for token, row in zip(tokens, rows)]
