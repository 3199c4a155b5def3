"""Adaptive speculation with a fake clock: step costs and acceptance are fed in directly."""

from collections import deque

import pytest

from deepflash.controller import SpecController
from deepflash.engine import PIPELINE_DEPTH


def drive(controller: SpecController, steps: int, accepted_per_spec: float, t_plain: float, t_spec: float,
          queued: int = 1) -> list[bool]:
    """Run `steps` decisions; spec steps commit `accepted_per_spec` tokens in t_spec, plain steps take t_plain.
    queued > 1: that many decisions are made before the oldest one's record, as the engine queues steps."""
    trace, pending = [], deque()
    while len(trace) < steps or pending:
        while len(pending) < queued and len(trace) < steps:
            pending.append(controller.use_spec())
            trace.append(pending[-1])
        if pending.popleft():
            controller.record_spec(accepted_per_spec, t_spec)
        else:
            controller.record_plain(t_plain)
    return trace


def test_never_matching_drafter_turns_speculation_off_within_a_few_steps():
    c = SpecController("auto")
    trace = drive(c, 200, accepted_per_spec=1, t_plain=1.0, t_spec=1.6)
    first_off = trace.index(False)
    assert first_off <= 4
    # after the verdict: mostly plain, with short probes that back off
    assert sum(trace[10:]) / len(trace[10:]) < 0.05


def test_always_matching_drafter_keeps_speculating():
    c = SpecController("auto")
    trace = drive(c, 200, accepted_per_spec=8, t_plain=1.0, t_spec=1.6)
    assert sum(trace) >= 197  # only the one plain step that measures t_plain


def test_probing_turns_speculation_back_on_when_it_pays_again():
    c = SpecController("auto")
    drive(c, 60, accepted_per_spec=1, t_plain=1.0, t_spec=1.6)
    assert not c.use_spec() or c.plain_left == 0
    trace = drive(c, 400, accepted_per_spec=6, t_plain=1.0, t_spec=1.6)
    assert all(trace[-100:])


def test_backoff_carries_over_to_the_next_request():
    c = SpecController("auto")
    drive(c, 300, accepted_per_spec=1, t_plain=1.0, t_spec=1.6)
    backoff = c.failed_probes
    assert backoff >= 3
    c.new_request()
    trace = drive(c, 60, accepted_per_spec=1, t_plain=1.0, t_spec=1.6)
    assert trace[0]  # each request opens with a probe
    assert sum(trace) == 1 and c.plain_left > c.burst  # of one step, whose failure buys a long burst at once


def test_a_probe_after_failures_is_one_spec_step_even_with_steps_queued():
    """With the engine's queue, a second spec step behind the probe would run before the verdict: after a
    failure the controller queues plain steps behind a probe instead."""
    c = SpecController("auto")
    drive(c, 300, accepted_per_spec=1, t_plain=1.0, t_spec=1.6, queued=PIPELINE_DEPTH)
    for _ in range(3):
        c.new_request()
        trace = drive(c, 100, accepted_per_spec=1, t_plain=1.0, t_spec=1.6, queued=PIPELINE_DEPTH)
        assert trace[0] and sum(trace) == 1


def test_a_spec_step_queued_before_a_failed_verdict_is_not_the_next_probe():
    c = SpecController("auto", t_plain=1.0)
    assert c.use_spec() and c.use_spec()  # two queued
    c.record_spec(1, 1.6)
    assert c.use_spec()  # a third queued before the verdict
    c.record_spec(1, 1.6)  # the verdict: 0.63x, a burst
    assert c.failed_probes == 1 and c.plain_left == c.burst
    c.record_spec(8, 1.6)  # the third, lucky: it must not pass as a probe and reset the backoff
    assert c.failed_probes == 1 and c.al is None and not c.use_spec()


def test_queued_steps_keep_a_good_drafter_speculating_and_bring_it_back():
    c = SpecController("auto")
    trace = drive(c, 200, accepted_per_spec=8, t_plain=1.0, t_spec=1.6, queued=PIPELINE_DEPTH)
    assert sum(trace) >= 197
    drive(c, 300, accepted_per_spec=1, t_plain=1.0, t_spec=1.6, queued=PIPELINE_DEPTH)
    assert c.failed_probes >= 2
    trace = drive(c, 800, accepted_per_spec=6, t_plain=1.0, t_spec=1.6, queued=PIPELINE_DEPTH)
    assert all(trace[-100:]) and c.failed_probes == 0


def test_break_even_margin():
    c = SpecController("auto", margin=0.05)
    drive(c, 50, accepted_per_spec=1.0, t_plain=1.0, t_spec=0.97)  # 1.03x: pays, keeps speculating
    assert c.use_spec()
    c = SpecController("auto", margin=0.05)
    drive(c, 50, accepted_per_spec=1.0, t_plain=1.0, t_spec=1.1)  # 0.91x: below break-even minus margin
    assert c.plain_left > 0 or not c.use_spec()


@pytest.mark.parametrize("mode,want", [("on", True), ("off", False)])
def test_fixed_modes(mode, want):
    c = SpecController(mode)
    assert all(s == want for s in drive(c, 20, 1, 1.0, 5.0))


def test_bad_mode():
    with pytest.raises(ValueError):
        SpecController("sometimes")
