"""Adaptive speculation: speculate while it pays, fall back to plain bursts when it does not.

Speculation pays when (tokens committed per spec step) x t_plain / t_spec > 1. The controller keeps
exponential averages of those three from measured steps; below break-even minus a margin it runs a
plain burst, then probes speculation again. Features are captured during plain steps too, so a probe
drafts with the full context (the drafter's K/V of the burst is computed in one batch when it starts).
Consecutive failed probes double the burst (up to 8x) so that a drafter that never pays costs almost
nothing. After a failed probe, the next probe is one spec step, judged alone, and plain steps run while
its result is on its way: the engine queues steps ahead (engine.PIPELINE_DEPTH), and a second spec step
queued behind the probe would be spent before the verdict. Spec steps queued before a failed verdict
are not taken as the next probe.

Step costs grow with the context, so each request measures its own: its estimates start empty, plain
steps measure t_plain once a verdict is due, and again every `remeasure` spec steps (replacing it). A
step whose time includes other work is recorded without a time: one that ran while a CUDA graph was
captured (a plain cost measured so was once tens of times too high and kept a losing drafter on for a
whole run), and a plain step in flight while a spec step was launched (the launch's host work may
delay its collect).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecController:
    mode: str = "auto"  # auto | on | off
    margin: float = 0.05
    burst: int = 40  # plain tokens between probes
    alpha: float = 0.3  # EMA weight of the newest step
    min_spec_steps: int = 2  # measured spec steps before a verdict (one after a failed probe)
    max_backoff: int = 8
    remeasure: int = 64  # spec steps between plain steps that re-measure t_plain as the context grows
    al: float | None = None
    t_spec: float | None = None
    t_plain: float | None = None
    plain_left: int = 0  # plain steps of the current burst still to launch
    spec_seen: int = 0
    failed_probes: int = 0
    spec_in_flight: int = 0  # spec steps decided and not yet recorded
    spec_since_plain: int = 0  # spec steps decided since the last plain one
    stale_spec: int = 0  # spec steps queued before the last failed verdict: no evidence for the next probe

    def __post_init__(self):
        if self.mode not in ("auto", "on", "off"):
            raise ValueError(f"spec mode must be auto, on or off, got {self.mode!r}")

    def new_request(self) -> None:
        """Acceptance is a property of the text and step costs grow with the context: each request starts
        speculating with empty estimates. The probe backoff carries over, so a drafter that failed on the
        last requests gets a long burst as soon as its opening probe fails again (a success resets it)."""
        self.al = self.t_spec = self.t_plain = None
        # the last request's queued steps were dropped
        self.plain_left = self.spec_seen = self.spec_in_flight = self.spec_since_plain = self.stale_spec = 0

    def use_spec(self) -> bool:
        spec = self._decide()
        self.spec_in_flight += spec
        self.spec_since_plain = self.spec_since_plain + 1 if spec else 0
        return spec

    def _decide(self) -> bool:
        if self.mode != "auto":
            return self.mode == "on"
        if self.plain_left > 0:
            self.plain_left -= 1
            return False
        if self.failed_probes and (self.spec_in_flight or self.spec_seen):
            return False  # a probe after failures is one step: plain steps until its verdict
        if self.spec_seen >= self.min_spec_steps and self._plain_cost_stale():
            self.t_plain = None  # one plain step measures it afresh: an average would trail the context
            return False
        return True

    def _plain_cost_stale(self) -> bool:
        """Plain steps run until one comes back timed: the engine times only a plain step queued with
        plain steps (a spec launch's host work would delay its collect), so a measurement between spec
        steps takes engine.PIPELINE_DEPTH plain steps."""
        return self.t_plain is None or self.spec_since_plain >= self.remeasure

    def record_spec(self, committed: int, seconds: float | None) -> None:
        """seconds: the step's time, None where it includes one-off work."""
        self.spec_in_flight -= 1
        if self.stale_spec:
            self.stale_spec -= 1
            return
        self.al = self._ema(self.al, committed)
        self.t_spec = self._ema(self.t_spec, seconds)
        self.spec_seen += 1
        self._judge()

    def record_plain(self, seconds: float | None) -> None:
        self.t_plain = self._ema(self.t_plain, seconds)
        self._judge()

    def _judge(self) -> None:
        """Below break-even minus the margin: a plain burst, doubled per consecutive failed probe."""
        judged_after = 1 if self.failed_probes else self.min_spec_steps
        if self.mode != "auto" or self.spec_seen < judged_after or not (self.al and self.t_spec and self.t_plain):
            return
        if self.speedup() < 1 - self.margin:
            self.plain_left = self.burst * min(2**self.failed_probes, self.max_backoff)
            self.failed_probes += 1
            self.spec_seen = 0  # the next probe is judged on fresh steps
            self.stale_spec = self.spec_in_flight
            self.al = self.t_spec = None
        else:
            self.failed_probes = 0

    def speedup(self) -> float:
        """Estimated tokens/s of speculation over plain decoding."""
        if not (self.al and self.t_spec and self.t_plain):
            return 1.0
        return self.al * self.t_plain / self.t_spec

    def _ema(self, old: float | None, new: float | None) -> float | None:
        if new is None:
            return old
        return new if old is None else (1 - self.alpha) * old + self.alpha * new
