"""The benchmarks' own bookkeeping (their GPU figures live in BENCHMARKS.md)."""

import argparse
import platform
from dataclasses import replace

import pytest
import torch
from helpers import drafter_config, tiny_drafter, tiny_target, tiny_tokenizer

from deepflash.bench.accept import far_step_change, measure, paired_change
from deepflash.bench.rings import parse_shape
from deepflash.bench.rings import run as run_rings
from deepflash.bench.speed import TORCH_KERNELS, plain_of, run_engine
from deepflash.drafter.reach import copied_from_beyond, far_steps
from deepflash.engine.config import EngineConfig
from deepflash.engine.engine import Engine
from deepflash.engine.sampling import SamplingParams
from deepflash.errors import UserError
from deepflash.kernels.rings import Shape


def test_each_system_is_checked_against_plain_decode_on_its_own_kernels():
    assert plain_of("deepflash dflash (spec auto)") == "deepflash plain"
    assert plain_of("deepflash dflash (spec auto)" + TORCH_KERNELS) == "deepflash plain" + TORCH_KERNELS
    # plain on Triton's kernels against plain on torch's: where bf16 rounding differs, this shows it
    assert plain_of("deepflash plain" + TORCH_KERNELS) == "deepflash plain"


def test_ring_shapes_parse_or_explain():
    assert parse_shape("32x4") == Shape(32, 4, 1, 1)
    assert parse_shape("16x1x8x3") == Shape(16, 1, 8, 3) and str(Shape(16, 1, 8, 3)) == "16x1x8x3"
    for bad in ("32-4", "32x4x2", "16x0"):
        with pytest.raises(UserError, match="GROUPSxWARPS"):
            parse_shape(bad)


def test_ring_graph_timing_refuses_a_device_without_cuda_graphs():
    args = argparse.Namespace(triton_shapes=None, device="cpu", graphs=True)
    with pytest.raises(UserError, match="--graphs times CUDA graphs"):
        run_rings(args)


def test_accept_counts_only_its_timed_pass():
    """bench accept runs every prompt untimed first (graph captures and first kernel uses), then counts
    the second pass alone: its statistics are those of one pass."""
    target, tokenizer = tiny_target(), tiny_tokenizer()
    engine = Engine(target, tokenizer, tiny_drafter(drafter_config(target.cfg)), config=EngineConfig(spec="on", block_size=4))
    prompts = [torch.randint(3, 60, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9)]
    params = SamplingParams(max_new_tokens=12)
    once = [engine.complete(ids, SamplingParams(max_new_tokens=12, seed=i)) for i, ids in enumerate(prompts)]
    calls, complete = [], engine.complete
    engine.complete = lambda ids, p: calls.append(ids) or complete(ids, p)
    out, outputs = measure(engine, prompts, params, seeded=True)
    assert calls == prompts + prompts  # every prompt warmed up, then timed
    assert out["tokens"] == sum(r.generated_tokens for r in once)
    assert out["spec_steps"] == sum(r.spec.steps for r in once)
    assert out["per_prompt_steps_committed"] == [[r.spec.steps, r.spec.committed] for r in once]
    assert outputs == [r.token_ids for r in once]
    assert out["decode_tok_per_s"] > out["tok_per_s"]  # decode time excludes each request's prefill


def test_paired_change_of_acceptance_with_its_interval():
    """AL of one setting against another on the same prompts, with a bootstrap interval over prompts:
    a uniform change has no spread, opposite changes on different prompts straddle zero."""
    base = {"per_prompt_steps_committed": [[10, 20], [10, 30], [20, 40]]}
    assert paired_change(base, base) == {"relative": 0.0, "ci95": [0.0, 0.0]}
    better = {"per_prompt_steps_committed": [[10, 22], [10, 33], [20, 44]]}
    assert paired_change(base, better) == {"relative": 0.1, "ci95": [0.1, 0.1]}
    mixed = paired_change(base, {"per_prompt_steps_committed": [[10, 26], [10, 24], [20, 40]]})
    assert mixed["relative"] == 0.0 and mixed["ci95"][0] < 0 < mixed["ci95"][1]


def test_speed_splits_each_request_into_prefill_decode_and_the_rest():
    """bench speed times the second pass; each request's wall time holds its prefill and decode, and what
    is left over is reported, so that end-to-end rates can be read against decode rates."""
    target, tokenizer = tiny_target(), tiny_tokenizer()
    engine = Engine(target, tokenizer, tiny_drafter(drafter_config(target.cfg)), config=EngineConfig(spec="on", block_size=4))
    prompts = [[5, 9, 22], [7, 8, 30, 31, 40]]
    out = run_engine(engine, prompts, 10, SamplingParams(max_new_tokens=10))
    per = out["per_prompt"]
    assert [p["prompt_tokens"] for p in per] == [3, 5] and sum(p["tokens"] for p in per) == out["tokens"]
    assert all(0 < p["prefill_s"] < p["wall_s"] for p in per)
    wall = sum(p["wall_s"] for p in per)
    assert out["prefill_s"] == pytest.approx(sum(p["prefill_s"] for p in per))
    assert 0 <= out["outside_decode_and_prefill_s"] < wall
    assert out["tok_per_s"] == pytest.approx(out["tokens"] / wall)


def test_accept_refuses_a_plot_it_cannot_draw_before_measuring(monkeypatch):
    import argparse
    import importlib.util

    from deepflash.bench import accept

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(accept, "load_runtime", lambda *a: pytest.fail("measured before checking --plot"))
    with pytest.raises(UserError, match="--plot needs matplotlib"):
        accept.run(argparse.Namespace(plot="a.png", device="cpu"))


def test_copied_from_beyond_counts_only_text_a_capped_window_cannot_see():
    far, near = list(range(100, 110)), list(range(200, 210))
    prompt = far + list(range(300, 340)) + near  # 60 tokens: `far` ends 50 before the end, `near` at it
    assert copied_from_beyond([prompt], [far], window=20) == 1.0
    assert copied_from_beyond([prompt], [far], window=50) == 1.0
    assert copied_from_beyond([prompt], [far], window=51) == 4 / 5  # the last 6-gram ends inside the window
    assert copied_from_beyond([prompt], [far], window=55) == 0
    assert copied_from_beyond([prompt], [near + far], window=20) == 5 / 15  # far's 5 of 15 (near's, across: not)
    assert copied_from_beyond([prompt + far], [far], window=20) == 0  # also near the end: visible
    assert copied_from_beyond([prompt], [list(range(500, 520))], window=20) == 0


def test_far_steps_are_the_steps_that_begin_in_text_only_a_window_beyond_the_cap_holds():
    far, near = list(range(100, 110)), list(range(200, 210))
    prompt = far + list(range(300, 340)) + near  # 60 tokens: `far` ends 50 before the end
    output = [999] + far + far + list(range(500, 506))  # the first token came from prefill
    # steps commit far[0:4], far[4:10] (both copied from 50+ tokens back), then far again (now also
    # in the output just before), a plain step, then new text
    trace = [4, 6, 10, 0, 6]
    assert far_steps(prompt, output, trace, window=20) == [4, 6]
    assert far_steps(prompt, output, trace, window=55) == [4, 6]  # each source ends 55 tokens before its step
    assert far_steps(prompt, output, trace, window=56) == []
    # after two plain steps the 4 begins at far[2]; the 6 begins at far[6], where the next 6 tokens run
    # into the second copy: text the context does not hold
    assert far_steps(prompt, output, [0, 0, 4, 6], window=20) == [4]
    full = {"per_prompt_trace": [trace, [3]]}
    capped = {"per_prompt_trace": [[1, 1, 1, 1, 6, 10, 0, 6], [3]]}
    change = far_step_change([prompt, prompt], [output, [999, 1, 2, 3]], full, capped, window=20)
    assert change["full"] == {"steps": 2, "acceptance_length": 5.0}
    assert change["capped"] == {"steps": 5, "acceptance_length": 2.0}  # 1, 1, 1, 1, 6
    assert change["vs"]["relative"] == -0.6  # only the first prompt has far steps in both


def test_accept_keeps_its_finished_parts_when_a_later_one_fails(monkeypatch, tmp_path):
    """--out holds HumanEval and the depth sweep once they are done: a failing dtype sweep (the sixteenth
    session's, on a ring kernel the GPU would not compile) fails the run, not their figures."""
    import argparse
    import json
    from types import SimpleNamespace

    from deepflash.bench import accept

    target, tokenizer = tiny_target(), tiny_tokenizer()
    runtime = SimpleNamespace(tokenizer=tokenizer, target=target, draft_name="tiny",
                              drafter=tiny_drafter(drafter_config(target.cfg)))
    asked = []
    monkeypatch.setattr(accept, "load_runtime", lambda cfg: asked.append(cfg) or runtime)
    monkeypatch.setattr(accept, "humaneval_messages", lambda n: [[{"role": "user", "content": "w5 w6"}]])
    monkeypatch.setattr(accept, "depth_prompts", lambda tok, depth, n: [[5, 6, 7, 8]])
    monkeypatch.setattr(accept, "recall_prompts", lambda tok, depth, distance, n: [[5, 6, 7, 8, 9, 5, 6]])

    def engine(*args, config=EngineConfig()):
        if config.feature_dtype == "q8_0":
            raise RuntimeError("a kernel failed to compile")
        return Engine(*args, config=replace(config, block_size=4))

    monkeypatch.setattr(accept, "Engine", engine)
    out = tmp_path / "accept.json"
    args = argparse.Namespace(plot=None, device="cpu", dtype="float32", model=None, draft=None, humaneval=1,
                              max_new_tokens=4, depths="64", per_depth=1, recall="12:8", out=str(out))
    with pytest.raises(RuntimeError, match="compile"):
        accept.run(args)
    saved = json.loads(out.read_text())
    assert set(saved["humaneval"]) == {"T=0", "T=1"} and set(saved["depth"]) == {"full", "4096", "2048"}
    assert saved["recall"]["distance"] == 8 and saved["recall"]["4096"]["12"]["prompts"] == 1
    assert "dtype" not in saved
    assert asked[0].dtype == "float32"  # --dtype reaches the loader; the record names the loaded pair's dtype
    assert saved["target_dtype"] == "float64"  # (the tiny test target's)
    assert saved["python"] == platform.python_version()  # its standard library gives the depth and recall prompts


def test_recall_prompts_repeat_a_modules_opening_after_it():
    """A recall prompt is a module's first DISTANCE tokens, then its first DEPTH - DISTANCE again: the
    continuation's source lies DISTANCE tokens back. --recall asks for a repeat that ends at least the new
    tokens before the source does."""
    from types import SimpleNamespace

    from deepflash.bench.accept import _recall_shape
    from deepflash.bench.prompts import recall_prompts

    tok = SimpleNamespace(encode=lambda text: [ord(c) for c in text])
    prompts = recall_prompts(tok, 3000, 2000, 3)
    assert len(prompts) == 3 and len({tuple(p) for p in prompts}) == 3
    for ids in prompts:
        assert len(ids) == 3000 and ids[2000:] == ids[:1000]
    assert _recall_shape("7500:4500", 128) == (7500, 4500) and _recall_shape("1000:564", 128) == (1000, 564)
    for bad in ("7500", "7500:3000", "7500:7500", "1000:563", "a:b"):
        with pytest.raises(UserError, match="--recall"):
            _recall_shape(bad, 128)


def test_agent_turns_compare_the_cached_engine_with_a_cold_one():
    from deepflash.bench.agent import TokenConversation, conversation_rows

    target, tokenizer = tiny_target(), tiny_tokenizer()
    drafter = tiny_drafter(drafter_config(target.cfg, block_size=4))
    config = EngineConfig(spec="on", block_size=4, prefill_chunk=16, prefix_block=8)
    cached = Engine(target, tokenizer, drafter, replace(config, prefix_cache=True))
    cold = Engine(target, tokenizer, drafter, config)
    talks = [TokenConversation(target.cfg.vocab_size, seed, 20, 9) for seed in (0, 1)]
    rows = conversation_rows(cached, cold, talks, 3, SamplingParams(max_new_tokens=6))
    assert [(r["conversation"], r["turn"]) for r in rows] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert all(r["same_text"] for r in rows)
    for r in rows:
        computed, cold_computed = r["cached"]["computed_tokens"], r["cold"]["computed_tokens"]
        # after the first turn: the new tokens, the reply and at most a chunk (16) of the previous prompt
        assert cold_computed == r["prompt_tokens"] and computed <= (r["prompt_tokens"] if r["turn"] == 0 else 9 + 6 + 15)


def test_quant_plan_of_the_27b_pair_counts_quantized_weights_and_the_prefill_slice(tmp_path):
    """bench quant --part plan on the CPU: meta models, the Q4_K_M mix counted in blocks (about 4.8 bits a
    weight against bf16's 16), the prefill's dequantized slice in the plan, one row per prefill chunk."""
    import json

    from deepflash.cli import main

    out = tmp_path / "plan.json"
    main(["bench", "quant", "--part", "plan", "--device", "cpu", "--context", "4096", "--out", str(out)])
    plans = json.loads(out.read_text())["plans"]
    assert [p["prefill_chunk"] for p in plans] == [1024, 512]
    weights = plans[0]["parts"]["target weights"]
    assert 14e9 < weights < 18e9  # 27B weights at 4-6 bits (bf16: 54 GB)
    assert 0 < plans[0]["parts"]["dequantized weight slice"] <= 6 * 64 * 2**20
    assert plans[1]["plan_bytes"] < plans[0]["plan_bytes"] and all(p["fits"] for p in plans)
