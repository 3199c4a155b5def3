"""Per-request statistics: acceptance length, its histogram, per-position acceptance, phase times."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class SpecStats:
    block_size: int
    steps: int = 0
    committed: int = 0
    draft_tokens: int = 0
    histogram: list[int] = field(default_factory=list)  # index a-1: steps that committed a tokens
    position_tries: list[int] = field(default_factory=list)  # index k-1: steps that drafted position k
    position_hits: list[int] = field(default_factory=list)
    spec_s: float = 0.0  # device time of the speculative steps, draft and verify (one CUDA graph)
    plain_steps: int = 0
    trace: list[int] = field(default_factory=list)  # per step in order: tokens a spec step committed, 0 a plain one

    def __post_init__(self):
        self.histogram = self.histogram or [0] * self.block_size
        self.position_tries = self.position_tries or [0] * max(self.block_size - 1, 0)
        self.position_hits = self.position_hits or [0] * max(self.block_size - 1, 0)

    def record(self, size: int, accepted: int) -> None:
        """One verify step over `size` tokens that accepted `accepted` drafts (+1 bonus)."""
        self.steps += 1
        self.committed += accepted + 1
        self.trace.append(accepted + 1)
        self.draft_tokens += size - 1
        self.histogram[accepted] += 1
        for k in range(size - 1):
            self.position_tries[k] += 1
            self.position_hits[k] += k < accepted

    def record_plain(self) -> None:
        """One plain step (speculation off for it: --spec auto's bursts and measurements)."""
        self.plain_steps += 1
        self.trace.append(0)

    @property
    def acceptance_length(self) -> float:
        return self.committed / self.steps if self.steps else 0.0

    @property
    def accepted_tokens(self) -> int:
        return self.committed - self.steps

    def per_position(self) -> list[float]:
        return [h / t if t else 0.0 for h, t in zip(self.position_hits, self.position_tries)]

    def to_json(self) -> dict:
        return {
            "acceptance_length": round(self.acceptance_length, 4),
            "acceptance_histogram": self.histogram,
            "per_position_acceptance": [round(x, 4) for x in self.per_position()],
            "spec_steps": self.steps,
            "plain_steps": self.plain_steps,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "spec_s": round(self.spec_s, 6),
        }


class PhaseTimer:
    """Time spent in named phases without host syncs: CUDA events read once at the end, or wall clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[str, object, object]] = []
        self.totals: dict[str, float] = {}
        self._open: tuple[str, object] | None = None

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self, name: str) -> None:
        self._open = (name, self._mark())

    def stop(self) -> None:
        name, begin = self._open
        self.pending.append((name, begin, self._mark()))
        self._open = None

    def collect(self, count: int | None = None) -> dict[str, float]:
        """Add the first `count` pending phases (all when None) to the totals; the rest are dropped unread,
        so that nothing waits for work whose results are not used (Engine.generate's steps queued past the
        output's end). The phases ran in order on one stream: their last one's end is the one to wait for."""
        counted = self.pending[:count]
        if self.cuda and counted:
            counted[-1][2].synchronize()
        for name, begin, end in counted:
            seconds = begin.elapsed_time(end) / 1000 if self.cuda else end - begin
            self.totals[name] = self.totals.get(name, 0.0) + seconds
        self.pending.clear()
        return self.totals
