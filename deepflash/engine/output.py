"""Where an output ends: stop tokens, stop strings and max_new_tokens, applied one token at a time.

Speculative steps commit several tokens at once; pushing them here one by one makes the output end
exactly where plain decoding would, whatever the block size.
"""

from __future__ import annotations

from ..loading.tokenizer import Detokenizer


class OutputTracker:
    def __init__(self, detokenizer: Detokenizer, stop_ids: frozenset[int], stop_strings: tuple[str, ...],
                 max_new_tokens: int):
        self.detokenizer = detokenizer
        self.stop_ids = stop_ids
        self.stop_strings = stop_strings
        self.max_new_tokens = max_new_tokens
        self.hold = max((len(s) for s in stop_strings), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""
        self.streamed = 0
        self.finish_reason: str | None = None
        self.stop_string: str | None = None  # the stop string the output ended at, if one

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, token: int) -> bool:
        """Add one generated token; True once the output is complete (later tokens must not be pushed)."""
        assert not self.finished, "push after the output ended"
        self.tokens.append(token)
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return True
        before = len(self.text)
        self.text += self.detokenizer.add(token)
        if self.stop_strings and len(self.text) > before:
            self._cut_at_stop_string(max(0, before - self.hold))
        if not self.finished and len(self.tokens) >= self.max_new_tokens:
            self.finish_reason = "length"
        return self.finished

    def end(self, reason: str) -> None:
        """End early for a reason outside the tokens (context full, cancelled)."""
        if not self.finished:
            self.finish_reason = reason

    def _cut_at_stop_string(self, search_from: int) -> None:
        hits = [(i, s) for s in self.stop_strings if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            at, self.stop_string = min(hits)
            self.text = self.text[:at]
            self.finish_reason = "stop"

    def stream(self) -> str:
        """Text that can be shown now: everything but a tail that might still become a stop string."""
        limit = len(self.text) if self.finished else len(self.text) - self.hold
        if limit <= self.streamed:
            return ""
        delta = self.text[self.streamed : limit]
        self.streamed = limit
        return delta
