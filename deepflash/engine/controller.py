"""Adaptive speculation: speculate while it pays, fall back to plain bursts when it does not.

Speculation pays when (tokens committed per spec step) x t_plain / t_spec > 1, i.e. when a spec step
commits more than its break-even, t_spec / t_plain tokens (less a margin). The controller keeps
exponential averages of the two step costs per context region (the KV bucket a step attends over: costs
grow with it in steps) and sums, over the spec steps, how far each fell short of break-even: a one-sided
CUSUM, so a run of good steps clears it (`_add_to_shortfall`). Past a tolerance (8 tokens, or 4 standard
deviations of the tokens a spec step commits where that is more: `_tolerance`) it turns speculation off.

Its phases (Phase):
- SPECULATE: spec steps. A plain step measures t_plain where the region has none once a verdict is due
  (after `min_spec_steps` spec steps, or at once while backing off), and again every `remeasure` spec steps.
- BURST: plain steps after a failed verdict: `burst` tokens, doubled per consecutive failure (up to
  `max_backoff` x), while the tolerance halves, so a drafter that never pays costs almost nothing.
  Features are captured during plain steps too, so the next probe drafts with the full context.
- PROBE: after a burst (and at the start of a request while backing off), one spec step alone, plain
  steps running while its result is on its way: the engine queues steps ahead (engine.PIPELINE_DEPTH), and
  a second spec step queued behind it would be spent before the verdict. Once that step has not turned it
  off, SPECULATE again; `success_steps` steps at no shortfall end the backoff.

A step whose time includes other work is recorded without a time (the engine decides: a CUDA graph's
capture, the drafter's catch-up after plain steps, a plain step in flight while a spec step launched).
Spec steps queued before a failed verdict are not evidence for the next probe (`stale_spec`). DESIGN.md
gives the measurements behind these rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Phase(Enum):
    SPECULATE = "speculate"
    BURST = "burst"
    PROBE = "probe"


@dataclass
class SpecController:
    mode: str = "auto"  # auto | on | off
    margin: float = 0.05
    burst: int = 40  # plain tokens between probes
    alpha: float = 0.3  # EMA weight of the newest step
    min_spec_steps: int = 2  # spec steps a request opens with before a plain step measures a missing t_plain
    max_backoff: int = 8
    remeasure: int = 256  # spec steps between plain steps that re-measure t_plain (a slow first measurement)
    tolerance: float = 8.0  # tokens short of break-even (the shortfall) that turn speculation off, at least
    spread: float = 4.0  # ... and at least this many standard deviations of the tokens a spec step commits
    success_steps: int = 4  # steps of a probe after failures that end the backoff if the shortfall is 0
    phase: Phase = Phase.SPECULATE
    shortfall: float = 0.0
    unjudged: list[int] = field(default_factory=list)  # tokens committed by spec steps not yet in the shortfall
    region: int = 0  # the context region (KV bucket) of the step being decided
    spec_costs: dict[int, float] = field(default_factory=dict)  # seconds per step, by region
    judged_steps: int = 0  # spec steps judged over the engine's life,
    committed_mean: float = 0.0  # the mean of the tokens they committed
    committed_m2: float = 0.0  # and the sum of squared deviations from it (Welford)
    plain_costs: dict[int, float] = field(default_factory=dict)
    plain_left: int = 0  # plain steps of the current burst still to launch (BURST)
    spec_seen: int = 0
    failed_probes: int = 0  # consecutive failed verdicts: the backoff (0: none)
    spec_in_flight: int = 0  # spec steps decided and not yet recorded
    spec_since_plain: int = 0  # spec steps decided since the last plain one
    stale_spec: int = 0  # spec steps queued before the last failed verdict: no evidence for the next probe

    def __post_init__(self):
        if self.mode not in ("auto", "on", "off"):
            raise ValueError(f"spec mode must be auto, on or off, got {self.mode!r}")

    def new_request(self) -> None:
        """Acceptance is a property of the text: each request starts speculating with no shortfall. The
        step costs (per region) and the probe backoff carry over, so a drafter that failed on the last
        requests gets a long burst as soon as its opening probe fails again (a success resets it)."""
        self.shortfall = 0.0
        self.unjudged.clear()
        # the last request's queued steps were dropped
        self.plain_left = self.spec_seen = self.spec_in_flight = self.stale_spec = 0
        self.phase = Phase.PROBE if self.failed_probes else Phase.SPECULATE

    @property
    def t_spec(self) -> float | None:
        return self.spec_costs.get(self.region)

    @property
    def t_plain(self) -> float | None:
        return self.plain_costs.get(self.region)

    def use_spec(self, region: int = 0) -> bool:
        """region: the KV bucket a spec step at the current position would attend over."""
        self.region = region
        spec = self._decide()
        self.spec_in_flight += spec
        self.spec_since_plain = self.spec_since_plain + 1 if spec else 0
        return spec

    def _decide(self) -> bool:
        if self.mode != "auto":
            return self.mode == "on"
        if self.phase is Phase.BURST:
            self.plain_left -= 1
            if self.plain_left == 0:
                self.phase = Phase.PROBE
            return False
        if self.phase is Phase.PROBE and self.spec_in_flight:
            return False  # the probe's one spec step is on its way: plain steps until its verdict
        # a request opens with spec steps, and measures a missing or stale t_plain after min_spec_steps of
        # them; while backing off (a probe, also the opening one of a request) it measures it first, so that
        # one step can decide
        if (self.spec_seen >= self.min_spec_steps or self.failed_probes) and self._plain_cost_stale():
            self.plain_costs.pop(self.region, None)  # one plain step measures it afresh
            return False
        return True

    def _plain_cost_stale(self) -> bool:
        """Plain steps run until one comes back timed: the engine times only a plain step queued with
        plain steps (a spec launch's host work would delay its collect), so a measurement between spec
        steps takes engine.PIPELINE_DEPTH plain steps."""
        return self.t_plain is None or self.spec_since_plain >= self.remeasure

    def record_spec(self, committed: int, seconds: float | None, region: int = 0) -> None:
        """seconds: the step's time, None where it includes one-off work; region: the one it was
        decided in."""
        self.spec_in_flight -= 1
        if self.mode != "auto":  # nothing to judge: the tokens would pile up in unjudged for the request
            return
        if self.stale_spec:
            self.stale_spec -= 1
            return
        self.unjudged.append(committed)
        self._learn_spread(committed)
        self._learn(self.spec_costs, region, seconds)
        self.spec_seen += 1
        self._judge()
        if self.phase is Phase.PROBE:  # the probe's step did not turn speculation off
            self.phase = Phase.SPECULATE

    def record_plain(self, seconds: float | None, region: int = 0) -> None:
        self._learn(self.plain_costs, region, seconds)
        self._judge()

    def _judge(self) -> None:
        """Past the tolerance (halved per consecutive failed probe, so that a drafter that failed the last
        probes is turned off again within a step or two): a plain burst, doubled per consecutive failed
        probe. A probe after failures that has run success_steps steps and stands at no shortfall ends
        the backoff."""
        if not (self.t_spec and self.t_plain):
            return
        self._add_to_shortfall()
        if self.shortfall > self._tolerance() / 2**self.failed_probes:
            self.phase = Phase.BURST
            self.plain_left = self.burst * min(2**self.failed_probes, self.max_backoff)
            self.failed_probes += 1
            self.spec_seen = 0  # the next probe is judged on fresh steps
            self.stale_spec = self.spec_in_flight
            self.shortfall = 0.0
        elif self.spec_seen >= self.success_steps and self.shortfall == 0:
            self.failed_probes = 0

    def _add_to_shortfall(self) -> None:
        """The shortfall is a one-sided CUSUM: per spec step, break-even tokens minus committed tokens,
        summed and floored at 0. Tokens per step scatter widely (HumanEval: a mean of 2.2, and 44% of
        steps commit one token), and a verdict on the average of two steps turned a paying drafter off
        in about half the requests; here a run of good steps clears the sum, and a drafter that never
        matches adds break-even - 1 every step, so it costs about `tolerance` tokens' time before it is
        off."""
        break_even = (1 - self.margin) * self.t_spec / self.t_plain  # tokens per spec step
        for committed in self.unjudged:
            self.shortfall = max(0.0, self.shortfall + break_even - committed)
        self.unjudged.clear()

    def _tolerance(self) -> float:
        """A drafter whose steps scatter widely runs up a shortfall by chance where it pays: at depth the
        shipped drafter commits 3.3 tokens a step with a standard deviation of 3.0 (16 tokens at times,
        one in 36% of steps), and a fixed tolerance of 8 tokens ran plain bursts where speculating was
        1.22x faster (auto 0.90 of `on` on bench speed's long prompt, H200). A drafter that
        never matches has no scatter and keeps the fixed tolerance."""
        spread = (self.committed_m2 / self.judged_steps) ** 0.5 if self.judged_steps else 0.0
        return max(self.tolerance, self.spread * spread)

    def _learn_spread(self, committed: int) -> None:
        """The mean and variance of the tokens per spec step over the engine's life (Welford's update)."""
        self.judged_steps += 1
        delta = committed - self.committed_mean
        self.committed_mean += delta / self.judged_steps
        self.committed_m2 += delta * (committed - self.committed_mean)

    def _learn(self, costs: dict[int, float], region: int, seconds: float | None) -> None:
        """An exponential average of the region's step times; an untimed step teaches nothing."""
        if seconds is not None:
            old = costs.get(region)
            costs[region] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds
