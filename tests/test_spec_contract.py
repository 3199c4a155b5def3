"""The engine's core contract: greedy speculative output == greedy plain output, token for token,
for any drafter (random weights included), block size, prompt length and stop condition."""

import itertools
import time

import pytest
import torch
from helpers import EOS, drafter_config, oracle, tiny_drafter, tiny_target, tiny_tokenizer

from deepflash.drafter.context import DrafterContext
from deepflash.engine.config import EngineConfig
from deepflash.engine.engine import Engine
from deepflash.engine.sampling import SamplingParams
from deepflash.engine.stats import PhaseTimer

TOKENIZER = tiny_tokenizer()
TARGET = tiny_target()


def prompt(n, seed=0):
    return torch.randint(5, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def plain(ids, params, target=TARGET):
    return Engine(target, TOKENIZER).complete(ids, params)


@pytest.mark.parametrize("block", [1, 2, 4, 16])
@pytest.mark.parametrize("length", [1, 7, 40])
@pytest.mark.parametrize("sliding", [False, True])
def test_random_drafter_matches_plain(block, length, sliding):
    drafter = tiny_drafter(drafter_config(TARGET.cfg, sliding=sliding, window=6))
    ids = prompt(length, seed=length)
    params = SamplingParams(max_new_tokens=30)
    spec = Engine(TARGET, TOKENIZER, drafter, config=EngineConfig(block_size=block, spec="on")).complete(ids, params)
    ref = plain(ids, params)
    assert spec.token_ids == ref.token_ids and spec.text == ref.text
    assert spec.finish_reason == ref.finish_reason
    assert spec.spec.committed + spec.spec.plain_steps + 1 >= len(spec.token_ids)


@pytest.mark.parametrize("wrong_every", [0, 3, 7])
@pytest.mark.parametrize("max_new", [1, 5, 16, 33])
def test_long_accepted_runs_end_exactly(monkeypatch, wrong_every, max_new):
    drafter = tiny_drafter(drafter_config(TARGET.cfg))
    ids = prompt(9)
    ref_long = plain(ids, SamplingParams(max_new_tokens=60)).token_ids
    oracle(monkeypatch, ref_long, len(ids), wrong_every)
    params = SamplingParams(max_new_tokens=max_new)
    out = Engine(TARGET, TOKENIZER, drafter, config=EngineConfig(spec="on")).complete(ids, params)
    assert out.token_ids == plain(ids, params).token_ids
    if wrong_every == 0 and max_new > 16:
        assert out.spec.histogram[-1] > 0  # whole blocks were accepted


def test_stop_token_and_string_inside_a_block(monkeypatch):
    drafter = tiny_drafter(drafter_config(TARGET.cfg))
    ids = prompt(9)
    ref = plain(ids, SamplingParams(max_new_tokens=60))
    oracle(monkeypatch, ref.token_ids, len(ids))
    words = ref.text.split()
    stop_string = " ".join(words[10:12])
    stop_token = ref.token_ids[13]
    cases = [SamplingParams(max_new_tokens=60, stop=(stop_string,))]
    for params in cases:
        out = Engine(TARGET, TOKENIZER, drafter, config=EngineConfig(spec="on")).complete(ids, params)
        want = plain(ids, params)
        assert out.text == want.text and out.token_ids == want.token_ids and out.finish_reason == "stop"
        assert stop_string not in out.text
    # a model whose end token appears mid-block
    engine = Engine(TARGET, TOKENIZER, drafter, config=EngineConfig(spec="on"))
    engine.stop_ids = frozenset({stop_token, EOS})
    out = engine.complete(ids, SamplingParams(max_new_tokens=60))
    base = Engine(TARGET, TOKENIZER)
    base.stop_ids = engine.stop_ids
    want = base.complete(ids, SamplingParams(max_new_tokens=60))
    assert out.token_ids == want.token_ids and out.token_ids[-1] == stop_token and out.finish_reason == "stop"


@pytest.mark.parametrize("use_drafter", [False, True])
def test_no_step_is_queued_after_a_stop_token(use_drafter):
    """A committed stop token ends the output: the step queued before it was known is the only one
    launched past the end (generate returns without waiting for it), and draft and verify times count the
    collected steps alone."""
    ids = prompt(9)
    stop_token = plain(ids, SamplingParams(max_new_tokens=60)).token_ids[13]
    drafter = tiny_drafter(drafter_config(TARGET.cfg)) if use_drafter else None
    engine = Engine(TARGET, TOKENIZER, drafter, config=EngineConfig(spec="on"))
    engine.stop_ids = frozenset({stop_token, EOS})
    out = engine.complete(ids, SamplingParams(max_new_tokens=60))
    assert out.token_ids[-1] == stop_token and out.finish_reason == "stop"
    collected = out.spec.steps + out.spec.plain_steps if use_drafter else len(out.token_ids) - 1
    assert engine.launches == collected + 1
    if use_drafter:
        assert 0 < out.spec.spec_s


def test_phase_times_count_only_the_phases_asked_for():
    timer = PhaseTimer(torch.device("cpu"))
    for name, seconds in (("draft", 0.0), ("verify", 0.02), ("verify", 0.2)):
        timer.start(name)
        time.sleep(seconds)
        timer.stop()
    totals = timer.collect(2)
    assert set(totals) == {"draft", "verify"} and 0.02 <= totals["verify"] < 0.2
    assert not timer.pending and timer.collect() == totals


def test_context_limit_inside_a_block(monkeypatch):
    drafter = tiny_drafter(drafter_config(TARGET.cfg))
    ids = prompt(20)
    ref = plain(ids, SamplingParams(max_new_tokens=60)).token_ids
    oracle(monkeypatch, ref, len(ids))
    params = SamplingParams(max_new_tokens=60)
    out = Engine(TARGET, TOKENIZER, drafter, config=EngineConfig(spec="on", max_ctx=31)).complete(ids, params)
    want = Engine(TARGET, TOKENIZER, config=EngineConfig(max_ctx=31)).complete(ids, params)
    assert out.token_ids == want.token_ids and len(ids) + len(out.token_ids) == 31
    assert out.finish_reason == want.finish_reason == "length"


@pytest.mark.parametrize("drafts", ["random", "mostly right"])
def test_sampled_speculative_equals_sampled_plain(drafts, monkeypatch):
    """Position-keyed sampling: with the same seed, speculative decoding emits plain decoding's samples,
    with a random drafter and with drafts that are plain decoding's own samples but now and then spoiled
    (long accepted runs and every shorter length: each position of a verify block must draw its own noise)."""
    drafter = tiny_drafter(drafter_config(TARGET.cfg))
    ids = prompt(12)
    for seed in range(3):
        params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=seed, max_new_tokens=25)
        want = plain(ids, params).token_ids
        if drafts == "mostly right":
            oracle(monkeypatch, want, len(ids), wrong_every=5)
        spec = Engine(TARGET, TOKENIZER, drafter, config=EngineConfig(spec="on")).complete(ids, params)
        assert spec.token_ids == want
        if drafts == "mostly right":
            assert max(spec.spec.histogram[2:]) > 0  # runs of accepted drafts happened


@pytest.mark.parametrize("extra", [{}, dict(presence_penalty=0.5, repetition_penalty=1.2, logprobs=3)])
def test_steps_have_no_host_syncs(extra):
    """Each step traces as one graph (dynamo fullgraph, no compiler): no .item(), no data-dependent
    Python, so it can be captured as a CUDA graph; also with penalties and log-probabilities."""
    import torch._dynamo

    from deepflash.engine.sampling import SamplingParams

    drafter = tiny_drafter(drafter_config(TARGET.cfg, sliding=True, window=6))
    engine = Engine(TARGET, TOKENIZER, drafter, config=EngineConfig(spec="on", block_size=8, feature_dtype="q4_0"))
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.9, seed=1, max_new_tokens=5, **extra).validated()
    engine.complete(prompt(10), params)
    steps = engine.steps
    torch._dynamo.reset()
    steps.state.start.fill_(0)  # the prefill step reads the prompt from its start
    for fn, args in [(steps.prefill, (8, 256, params)), (steps.speculate, (8, 256, params)),
                     (steps.plain, (256, params))]:
        torch.compile(fn, fullgraph=True, backend="eager")(*args)


def test_auto_mode_stops_speculating_with_a_useless_drafter():
    """On the CPU a verify step costs more than a plain step and random drafts never match: `auto`
    falls back to plain steps, and the output is still the plain output, also on the next request, which
    opens with a probe (tests/test_controller.py checks its length with a fake clock)."""
    drafter = tiny_drafter(drafter_config(TARGET.cfg))
    ids = prompt(10)
    params = SamplingParams(max_new_tokens=60)
    engine = Engine(TARGET, TOKENIZER, drafter, config=EngineConfig(spec="auto"))
    # the verdict's steps are tolerance / (break-even - 1), and the CPU's cost ratio (hence break-even)
    # drops when other work loads the machine: 16 spec steps of 60 at the default tolerance of 8
    engine.controller.tolerance = 1.0
    out = engine.complete(ids, params)
    assert out.token_ids == plain(ids, params).token_ids
    assert out.spec.plain_steps > 3 * out.spec.steps
    # the trace lists every step in order: tokens per spec step, 0 per plain one
    trace = out.spec.trace
    assert trace.count(0) == out.spec.plain_steps and len(trace) == out.spec.steps + out.spec.plain_steps
    assert sum(trace) == out.spec.committed
    again = engine.complete(ids, params)
    assert again.token_ids == out.token_ids and again.spec.steps >= 1


def test_steps_delayed_by_a_graph_capture_are_recorded_without_a_time(monkeypatch):
    """A capture is one-off work: the capturing step and every step queued with it are recorded
    untimed, so the controller never learns a step cost from one (the CPU has no graphs: captures are
    simulated by the first run of each graph key)."""
    drafter = tiny_drafter(drafter_config(TARGET.cfg))
    engine = Engine(TARGET, TOKENIZER, drafter, config=EngineConfig(spec="auto", block_size=8))
    seen, run = set(), engine.graphs.run

    def run_capturing_first(key, fn):
        run(key, fn)
        captured = key not in seen
        seen.add(key)
        return captured

    monkeypatch.setattr(engine.graphs, "run", run_capturing_first)
    recorded = []
    for kind in ("spec", "plain"):
        record = getattr(engine.controller, f"record_{kind}")
        monkeypatch.setattr(engine.controller, f"record_{kind}",
                            lambda *a, kind=kind, record=record: (recorded.append((kind, a[-2])), record(*a)))
    ids = prompt(10)
    params = SamplingParams(max_new_tokens=40)
    assert engine.complete(ids, params).token_ids == plain(ids, params).token_ids
    untimed = [kind for kind, seconds in recorded if seconds is None]
    # the first spec step captured draft and verify, the first plain step its own graph
    assert recorded[0] == ("spec", None) and "plain" in untimed
    assert any(seconds is not None for _, seconds in recorded)
    first_plain = next(i for i, (kind, _) in enumerate(recorded) if kind == "plain")
    assert recorded[first_plain][1] is None


def test_a_spec_step_that_catches_the_drafter_up_is_recorded_without_a_time(monkeypatch):
    """Its time includes the drafter's K/V of the plain steps before it: switching work, which counted as
    a spec step's cost turned paying drafters off (controller.py). Other spec steps keep their time."""
    engine = Engine(TARGET, TOKENIZER, tiny_drafter(drafter_config(TARGET.cfg)), config=EngineConfig(spec="auto", block_size=8))
    pattern = itertools.cycle([True, False, False, True, True])
    monkeypatch.setattr(engine.controller, "use_spec", lambda region: next(pattern))
    recorded = []
    monkeypatch.setattr(engine.controller, "record_spec",
                        lambda committed, seconds, region: recorded.append(("spec", seconds)))
    monkeypatch.setattr(engine.controller, "record_plain", lambda seconds, region: recorded.append(("plain", seconds)))
    engine.complete(prompt(10), SamplingParams(max_new_tokens=40))
    after = {"plain": [], "spec": []}
    for (before, _), (kind, seconds) in zip(recorded, recorded[1:]):
        if kind == "spec":
            after[before].append(seconds)
    assert after["plain"] and all(seconds is None for seconds in after["plain"])
    assert after["spec"] and all(seconds is not None for seconds in after["spec"])


@pytest.mark.parametrize("cap", [None, 6])
def test_drafting_after_plain_steps_sees_what_a_rebuild_from_the_mirror_sees(monkeypatch, cap):
    """Plain steps leave the drafter's context K/V to a catch-up when drafting resumes: before every
    draft, each position the drafter may see has the K/V a rebuild from the mirror gives it, no position
    lies past the span the draft attends over, and the output still equals plain decoding."""
    drafter = tiny_drafter(drafter_config(TARGET.cfg, sliding=True, window=4))
    engine = Engine(TARGET, TOKENIZER, drafter, config=EngineConfig(spec="auto", feat_ring_cap=cap))
    pattern = iter([True, False, False, False, True, True, False, False] * 20)
    monkeypatch.setattr(engine.controller, "use_spec", lambda region: next(pattern))
    steps, draft, checked = engine.steps, engine.steps.draft, []

    def draft_after_checking(size, span, q_pos):
        # the span the draft attends over bounds every position the drafter's context holds
        assert max(int(tags.max()) for tags in steps.context.tags) < span
        start = int(engine.state.start)
        lo = max(0, start - steps.features.window)
        rebuilt = DrafterContext(drafter, steps.features.window)
        rebuilt.rebuild(lo, steps.features.mirror.read(lo, start - lo))
        for layer in range(drafter.cfg.num_layers):
            for slot, position in enumerate(rebuilt.tags[layer].tolist()):
                if position < 0:
                    continue
                ours = (steps.context.tags[layer] == position).nonzero().flatten()
                assert ours.numel() == 1, (start, layer, position)
                for mine, ref in ((steps.context.k, rebuilt.k), (steps.context.v, rebuilt.v)):
                    torch.testing.assert_close(mine[layer][:, :, ours[0]], ref[layer][:, :, slot])
        checked.append(start)
        draft(size, span, q_pos)

    monkeypatch.setattr(steps, "draft", draft_after_checking)
    ids = prompt(20, seed=3)
    params = SamplingParams(max_new_tokens=40)
    assert engine.complete(ids, params).token_ids == plain(ids, params).token_ids
    assert len(checked) >= 4


def test_blocks_stay_full_size_to_the_end_of_the_output(monkeypatch):
    """Each block size is its own CUDA graph (and cuBLAS workspace): a request's last blocks must not
    shrink to the tokens still wanted; only the end of the context may shorten one."""
    drafter = tiny_drafter(drafter_config(TARGET.cfg))
    engine = Engine(TARGET, TOKENIZER, drafter, config=EngineConfig(spec="on", block_size=8, max_ctx=64))
    keys = []
    run = engine.graphs.run
    monkeypatch.setattr(engine.graphs, "run", lambda key, fn: keys.append(key) or run(key, fn))
    ids = prompt(10, seed=4)
    params = SamplingParams(max_new_tokens=13)
    assert engine.complete(ids, params).token_ids == plain(ids, params).token_ids
    assert {key[1] for key in keys if key[0] == "spec"} == {8}
    keys.clear()
    long = prompt(50, seed=5)  # 13 positions of context left: the last block is cut by the cache's end
    params = SamplingParams(max_new_tokens=20)
    out = engine.complete(long, params)
    assert out.token_ids == Engine(TARGET, TOKENIZER, config=EngineConfig(max_ctx=64)).complete(long, params).token_ids
    assert out.finish_reason == "length" and len(out.token_ids) == 64 - 50
    assert min(key[1] for key in keys if key[0] == "spec") < 8
