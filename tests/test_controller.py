"""Adaptive speculation with a fake clock: step costs and acceptance are fed in directly."""

from collections import deque
from itertools import cycle

import pytest

from deepflash.engine.controller import Phase, SpecController
from deepflash.engine.engine import PIPELINE_DEPTH


def drive(controller: SpecController, steps: int, accepted_per_spec: float | list[int], t_plain: float, t_spec: float,
          queued: int = 1, region: int = 0) -> list[bool]:
    """Run `steps` decisions in one context region; spec steps commit `accepted_per_spec` tokens (a list:
    its values in turn) in t_spec, plain steps take t_plain. queued > 1: that many decisions are made
    before the oldest one's record, as the engine queues steps."""
    committed = cycle(accepted_per_spec if isinstance(accepted_per_spec, list) else [accepted_per_spec])
    trace, pending = [], deque()
    while len(trace) < steps or pending:
        while len(pending) < queued and len(trace) < steps:
            pending.append(controller.use_spec(region))
            trace.append(pending[-1])
        if pending.popleft():
            controller.record_spec(next(committed), t_spec, region)
        else:
            controller.record_plain(t_plain, region)
    return trace


def test_never_matching_drafter_turns_speculation_off_within_a_few_steps():
    """A spec step at twice a plain step's cost needs 1.9 tokens; one token falls 0.9 short, so the
    tolerance of 8 tokens is passed at the ninth spec step (the time of about 9 plain steps lost)."""
    c = SpecController("auto")
    trace = drive(c, 200, accepted_per_spec=1, t_plain=1.0, t_spec=2.0)
    burst_starts = next(i for i in range(len(trace)) if not any(trace[i:i + c.burst]))
    assert sum(trace[:burst_starts]) == 9
    # after the verdict: mostly plain, with probes that back off
    assert sum(trace[burst_starts:]) / len(trace[burst_starts:]) < 0.05


def test_a_paying_drafter_whose_steps_scatter_keeps_speculating():
    """2.1 tokens per spec step on average, but most steps commit one token (as HumanEval's do): a verdict
    on the first steps' average turned such a drafter off; the shortfall clears on every good step."""
    c = SpecController("auto")
    trace = drive(c, 300, accepted_per_spec=[1, 1, 1, 2, 4, 3, 1, 2, 5, 1], t_plain=1.0, t_spec=2.0)
    assert c.failed_probes == 0 and sum(trace) >= 300 - 1 - 300 // c.remeasure


def test_the_tolerance_grows_with_the_scatter_of_a_drafters_steps():
    """At depth a drafter commits long runs now and then and one token in a third of its steps: here 3.4
    tokens a step on average where 2.4 break even, with runs of seven one-token steps (9.6 tokens
    short). A fixed tolerance of 8 turns it off; 4 standard deviations of its steps (4.9) do not."""
    steps = [16, 8, 1, 1, 1, 1, 1, 1, 1]
    fixed, scaled = SpecController("auto", spread=0.0), SpecController("auto")
    for c in (fixed, scaled):
        drive(c, 300, accepted_per_spec=steps, t_plain=1.0, t_spec=2.5)
    assert fixed.failed_probes >= 1 and scaled.failed_probes == 0
    assert scaled.committed_mean == pytest.approx(31 / 9, abs=0.1)


def test_always_matching_drafter_keeps_speculating():
    c = SpecController("auto")
    trace = drive(c, 200, accepted_per_spec=8, t_plain=1.0, t_spec=1.6)
    # only the plain steps that measure t_plain: one, then one per `remeasure` spec steps
    assert sum(trace) >= 200 - 1 - 200 // c.remeasure


def test_probing_turns_speculation_back_on_when_it_pays_again():
    c = SpecController("auto")
    drive(c, 60, accepted_per_spec=1, t_plain=1.0, t_spec=1.6)
    assert c.failed_probes >= 1
    trace = drive(c, 400, accepted_per_spec=6, t_plain=1.0, t_spec=1.6)
    assert sum(trace[-100:]) >= 100 - 2  # speculating, but for the plain steps that re-measure t_plain
    assert c.failed_probes == 0


def test_backoff_carries_over_to_the_next_request():
    c = SpecController("auto")
    drive(c, 300, accepted_per_spec=1, t_plain=1.0, t_spec=1.6)
    backoff = c.failed_probes
    assert backoff >= 3
    c.new_request()
    trace = drive(c, 60, accepted_per_spec=1, t_plain=1.0, t_spec=1.6)
    # each request opens with a probe, judged step by step (t_plain is known for the region) with the
    # tolerance halved per failed probe (8 -> 1 token, 0.52 short per step): its failure buys a long burst
    assert trace[0] and trace[1] and sum(trace) == 2 and c.plain_left > c.burst


def test_a_probe_after_failures_opens_with_one_spec_step_alone_even_with_steps_queued():
    """With the engine's queue, a second spec step behind a probe's first step would run before its
    verdict: after a failure the controller queues plain steps behind that step instead."""
    c = SpecController("auto")
    drive(c, 300, accepted_per_spec=1, t_plain=1.0, t_spec=1.6, queued=PIPELINE_DEPTH)
    for _ in range(3):
        c.new_request()
        trace = drive(c, 100, accepted_per_spec=1, t_plain=1.0, t_spec=1.6, queued=PIPELINE_DEPTH)
        spec_at = [i for i, spec in enumerate(trace) if spec]
        assert len(spec_at) == 1 or spec_at[1] - spec_at[0] >= PIPELINE_DEPTH
        assert 1 <= len(spec_at) <= 1 + PIPELINE_DEPTH  # then judged (a queued spec step past the verdict)


def test_phases_speculate_burst_probe_and_back():
    """A failed verdict starts a burst of plain steps; its end a probe (one spec step alone, plain steps
    until its verdict); a probe that does not fail speculates again, and a request that opens while backing
    off opens with a probe."""
    c = SpecController("auto", plain_costs={0: 1.0})
    assert c.phase is Phase.SPECULATE
    drive(c, 9, accepted_per_spec=1, t_plain=1.0, t_spec=2.0)  # the ninth spec step passes the tolerance
    assert c.phase is Phase.BURST and c.plain_left == c.burst
    assert not any(drive(c, c.burst, accepted_per_spec=1, t_plain=1.0, t_spec=2.0))
    assert c.phase is Phase.PROBE
    assert c.use_spec() and not c.use_spec() and not c.use_spec()  # one spec step alone, then plain
    c.record_spec(8, 2.0)  # its verdict: well above break-even
    c.record_plain(1.0)
    c.record_plain(1.0)
    assert c.phase is Phase.SPECULATE and c.failed_probes == 1 and c.use_spec()
    c.new_request()
    assert c.phase is Phase.PROBE


def test_a_spec_step_queued_before_a_failed_verdict_is_not_the_next_probe():
    c = SpecController("auto", plain_costs={0: 1.0}, tolerance=0.9)  # 0.52 tokens short per step: the second fails
    assert c.use_spec() and c.use_spec()  # two queued
    c.record_spec(1, 1.6)
    assert c.use_spec()  # a third queued before the verdict
    c.record_spec(1, 1.6)  # the verdict: 0.63x, a burst
    assert c.failed_probes == 1 and c.plain_left == c.burst
    c.record_spec(8, 1.6)  # the third, lucky: it must not pass as a probe and reset the backoff
    assert c.failed_probes == 1 and c.spec_seen == 0 and c.shortfall == 0 and not c.use_spec()


def test_queued_steps_keep_a_good_drafter_speculating_and_bring_it_back():
    c = SpecController("auto")
    trace = drive(c, 200, accepted_per_spec=8, t_plain=1.0, t_spec=1.6, queued=PIPELINE_DEPTH)
    # queued, a measurement of t_plain takes a plain step per queued step (the last one's time is lost
    # to the spec launch behind it)
    assert sum(trace) >= 200 - PIPELINE_DEPTH * (1 + 200 // c.remeasure)
    drive(c, 300, accepted_per_spec=1, t_plain=1.0, t_spec=1.6, queued=PIPELINE_DEPTH)
    assert c.failed_probes >= 2
    trace = drive(c, 800, accepted_per_spec=6, t_plain=1.0, t_spec=1.6, queued=PIPELINE_DEPTH)
    assert sum(trace[-100:]) >= 100 - 2 * PIPELINE_DEPTH and c.failed_probes == 0


def test_a_step_timed_during_one_off_work_does_not_set_the_costs():
    """The engine records a step whose time includes a CUDA graph capture without a time: a plain cost
    measured during a capture kept a losing drafter speculating for a whole benchmark run."""
    c = SpecController("auto", tolerance=1.0)
    c.use_spec(), c.use_spec()
    c.record_spec(1, 1.6), c.record_spec(1, 1.6)
    assert not c.use_spec()  # the plain step that measures t_plain
    c.record_plain(None)  # it captured a graph: no cost learned, and it is measured again
    assert c.t_plain is None and not c.use_spec()
    c.record_plain(1.0)
    assert c.failed_probes == 1 and c.plain_left == c.burst  # 1 token per 1.6 plain steps' time: 1.04 short


def test_costs_are_kept_per_context_region():
    """Costs grow with the context: a plain cost measured on a long prompt must not judge a short one."""
    c = SpecController("auto", tolerance=1.0)
    drive(c, 20, accepted_per_spec=2, t_plain=1.5, t_spec=2.0, region=8192)  # a long prompt: 1.5x
    assert c.failed_probes == 0
    c.new_request()
    trace = drive(c, 20, accepted_per_spec=2, t_plain=1.0, t_spec=2.4, region=256)  # short: 0.83x, 0.28 short
    assert c.failed_probes == 1 and sum(trace[5:]) == 0
    assert c.plain_costs == {8192: 1.5, 256: 1.0}


def test_a_request_in_a_measured_region_opens_without_plain_steps():
    """Each request used to open with plain steps that measured t_plain; a region's costs now carry
    over, so only the first request in a region measures them."""
    c = SpecController("auto")
    assert not all(drive(c, 20, accepted_per_spec=3, t_plain=1.0, t_spec=2.0, region=256))
    c.new_request()
    assert all(drive(c, 20, accepted_per_spec=3, t_plain=1.0, t_spec=2.0, region=256))
    c.new_request()
    assert not all(drive(c, 20, accepted_per_spec=3, t_plain=1.0, t_spec=2.0, region=512))


def test_plain_steps_run_until_one_comes_back_timed():
    """The engine drops the time of a plain step that a spec launch may have delayed: the controller
    keeps deciding plain until a timed one arrives, then speculates (queued: two plain steps)."""
    c = SpecController("auto")
    for _ in range(2):
        assert c.use_spec()
        c.record_spec(3, 2.0)
    assert not c.use_spec() and not c.use_spec()  # the measurement: two plain steps queued
    c.record_plain(1.0)  # the first: the second plain launch ran during it, its time counts
    assert c.use_spec()
    c.record_plain(None)  # the second: a spec launch ran during it
    assert c.t_plain == 1.0 and c.failed_probes == 0 and c.use_spec()


@pytest.mark.parametrize("remeasure,turns_off", [(64, True), (10**9, False)])
def test_plain_cost_is_remeasured_within_a_request(remeasure, turns_off):
    """A plain cost measured once goes stale (the context grows; the first one may have been slow):
    re-measuring it catches a drafter that stopped paying; without re-measuring it is missed."""
    c = SpecController("auto", remeasure=remeasure, tolerance=2.0)
    drive(c, 10, accepted_per_spec=3, t_plain=1.0, t_spec=2.0)  # 1.5x
    trace = drive(c, 300, accepted_per_spec=3, t_plain=0.6, t_spec=2.0)  # in truth 0.9x from here
    assert (c.failed_probes >= 1 and sum(trace[-100:]) <= 10) == turns_off


def test_break_even_margin():
    c = SpecController("auto", margin=0.05)
    drive(c, 50, accepted_per_spec=1.0, t_plain=1.0, t_spec=0.97)  # 1.03x: pays, keeps speculating
    assert c.use_spec()
    c = SpecController("auto", margin=0.05, tolerance=0.2)
    drive(c, 50, accepted_per_spec=1.0, t_plain=1.0, t_spec=1.1)  # 0.91x: 0.045 tokens a step short
    assert c.plain_left > 0 or not c.use_spec()


@pytest.mark.parametrize("mode,want", [("on", True), ("off", False)])
def test_fixed_modes(mode, want):
    c = SpecController(mode)
    assert all(s == want for s in drive(c, 20, 1, 1.0, 5.0))


def test_bad_mode():
    with pytest.raises(ValueError):
        SpecController("sometimes")
