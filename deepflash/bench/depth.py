"""deepflash bench depth: a Qwen3-8B-shaped random bf16 target at prompts of 4K to 128K tokens.

Per depth, plain decoding (no drafter): prefill tok/s, decode tok/s and the bandwidth it achieves (bytes a step
reads: the weights a decode step touches plus the KV of every position attended, over the device's copy
bandwidth), peak memory against the memory plan. Then, with a z-lab-shaped random drafter whose window is
40960, the device time of a draft and of a 16-token verify at each depth (each timed alone as a CUDA graph).
Past the model's 40960 positions the rope is stretched with YaRN (--rope-scaling yarn:4 by default). With
--kv-budget TOKENS, plain decoding again at --budget-depths with at most TOKENS positions of KV on the device
(models/kv_budget.py): its decode tok/s by depth over --budget-new-tokens, rebuilds included, and the pool's
rebuilds (the bytes a step reads count the resident positions only).

    deepflash bench depth --out benchmarks/long-context/depth.json
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..engine.config import EngineConfig
from ..engine.engine import Engine
from ..engine.graphs import kv_bucket
from ..engine.memory import plan_memory
from ..engine.runtime import resolve_device
from ..engine.sampling import SamplingParams
from ..errors import UserError
from ..loading.tokenizer import word_tokenizer
from ..models import random_model
from ..models.config import ModelConfig
from .agent import random_drafter
from .common import copy_bandwidth, environment, finish, graph_seconds, save, table
from .speed import QWEN3_8B


def prompt_of(depth: int, vocab: int) -> list[int]:
    return torch.randint(2, vocab, (depth,), generator=torch.Generator().manual_seed(depth)).tolist()


def plain_row(engine: Engine, depth: int, max_new: int, bandwidth: float) -> dict:
    """One untimed request (graph captures), then a timed one. A bounded cache's steps read its resident
    positions only."""
    params = SamplingParams(max_new_tokens=max_new)
    prompt = prompt_of(depth, engine.target.cfg.vocab_size)
    engine.complete(prompt, params)
    engine.wait_idle()
    result = engine.complete(prompt, params)
    engine.wait_idle()
    target = engine.target
    # the mean step attends over depth + max_new / 2 positions (the kernel reads only positions that exist)
    attended = min(depth + max_new // 2, engine.config.kv_budget or depth + max_new)
    step_bytes = target.decode_weight_bytes() + attended * target.kv_bytes_per_token()
    row = {"depth": depth, "prefill_tok_per_s": depth / result.prefill_s, "decode_tok_per_s": result.tok_per_s,
           "bytes_per_step": step_bytes, "bandwidth_fraction": step_bytes * result.tok_per_s / (bandwidth * 1e9)}
    if engine.bounded:
        row["rebuilds"] = engine.kv.rebuilds
    return row


def budget_rows(target, tokenizer, config: EngineConfig, depths: list[int], args, bandwidth: float) -> list[dict]:
    """Plain decoding at `depths` with at most --kv-budget positions of KV on the device."""
    engine = Engine(target, tokenizer, config=replace(config, kv_budget=args.kv_budget))
    engine.stop_ids = frozenset()
    rows = [plain_row(engine, depth, args.budget_new_tokens, bandwidth) for depth in depths]
    table(f"the same with --kv-budget {args.kv_budget}", ["depth", "prefill tok/s", "decode tok/s", "bandwidth",
                                                          "rebuilds"],
          [[r["depth"], r["prefill_tok_per_s"], r["decode_tok_per_s"], r["bandwidth_fraction"], r["rebuilds"]]
           for r in rows])
    return rows


def step_row(engine: Engine, depth: int, block: int) -> dict:
    """After a prefill of `depth` tokens: device seconds of the draft and of the verify of one block, each a
    CUDA graph replayed alone (the verify's start is put back before each run: it advances it)."""
    engine.complete(prompt_of(depth, engine.target.cfg.vocab_size), SamplingParams(max_new_tokens=1))
    steps, state = engine.steps, engine.state
    start = state.start.clone()
    span = kv_bucket(depth + block, engine.max_ctx, engine.window)  # as the engine's spec steps
    params = SamplingParams()
    state.sampling.load(params)

    def draft():
        steps.draft(block, span, steps.positions(block))

    def verify():
        state.start.copy_(start)
        steps.verify(block, span, params, steps.positions(block))

    draft_s, verify_s = graph_seconds(draft, calls=5, replays=5), graph_seconds(verify, calls=5, replays=5)
    return {"depth": depth, "draft_ms": draft_s * 1e3, "verify_ms": verify_s * 1e3, "draft_over_verify": draft_s / verify_s}


def run(args) -> dict:
    device = resolve_device(args.device)
    if device.type != "cuda":
        raise UserError("bench depth times CUDA graphs: it needs a CUDA device")
    bandwidth = copy_bandwidth(device)
    depths = [int(d) for d in args.depths.split(",")]
    cfg = ModelConfig.from_hf(QWEN3_8B)
    if args.rope_scaling:
        cfg = cfg.with_rope_scaling(args.rope_scaling)
    budget_depths = [int(d) for d in args.budget_depths.split(",")] if args.kv_budget else []
    max_ctx = max([d + args.max_new_tokens for d in depths] + [d + args.budget_new_tokens for d in budget_depths]) + 64
    target = random_model(cfg, device=device, dtype=torch.bfloat16, seed=0, std=0.02, on_device=True)
    tokenizer = word_tokenizer(cfg.vocab_size)
    record = {"bench": "depth", **environment(device), "copy_bandwidth_gb_s": bandwidth, "max_ctx": max_ctx,
              "rope": cfg.rope.to_hf(), "plain": [], "spec": []}
    config = EngineConfig(max_ctx=max_ctx, prefill_chunk=args.prefill_chunk, rope_scaling=args.rope_scaling)
    torch.cuda.reset_peak_memory_stats(device)
    engine = Engine(target, tokenizer, config=config)
    engine.stop_ids = frozenset()
    plan = plan_memory(target, None, max_ctx, config, device).total
    for depth in depths:
        record["plain"].append(plain_row(engine, depth, args.max_new_tokens, bandwidth))
        record["plain"][-1].update(peak_bytes=torch.cuda.max_memory_allocated(device), plan_bytes=plan)
        save(record, args.out)
    table("Qwen3-8B-shaped random bf16 target, plain decoding by depth",
          ["depth", "prefill tok/s", "decode tok/s", "bandwidth", "peak GiB", "plan GiB"],
          [[r["depth"], r["prefill_tok_per_s"], r["decode_tok_per_s"], r["bandwidth_fraction"],
            r["peak_bytes"] / 2**30, r["plan_bytes"] / 2**30] for r in record["plain"]])
    del engine
    torch.cuda.empty_cache()
    if args.kv_budget:
        record["kv_budget"] = {"tokens": args.kv_budget,
                               "plain": budget_rows(target, tokenizer, config, budget_depths, args, bandwidth)}
        save(record, args.out)
    drafter = random_drafter(device)
    spec_ctx = max(d for d in depths if d <= args.spec_max_depth) + 64
    engine = Engine(target, tokenizer, drafter, EngineConfig(max_ctx=spec_ctx, spec="on", feature_dtype="bf16",
                                                            rope_scaling=args.rope_scaling))
    record["window"] = engine.window
    for depth in (d for d in depths if d <= args.spec_max_depth):
        record["spec"].append(step_row(engine, depth, drafter.cfg.block_size))
        save(record, args.out)
    table(f"DFlash steps, drafter window {engine.window}", ["depth", "draft ms", "verify ms", "draft / verify"],
          [[r["depth"], r["draft_ms"], r["verify_ms"], r["draft_over_verify"]] for r in record["spec"]])
    return finish(record, args.out)


def register(sub) -> None:
    p = sub.add_parser("depth", help="plain decoding and DFlash step costs from 4K to 128K tokens of context")
    p.add_argument("--device", default="cuda")
    p.add_argument("--depths", default="4096,16384,32768,65536,131072")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prefill-chunk", type=int, default=EngineConfig.prefill_chunk)
    p.add_argument("--rope-scaling", default="yarn:4", help="past the 40960 native positions (empty: none)")
    p.add_argument("--spec-max-depth", type=int, default=65536, help="deepest prompt the DFlash steps are timed at")
    p.add_argument("--kv-budget", type=int, help="also decode with at most this many positions of KV on the device")
    p.add_argument("--budget-depths", default="16384,131072", help="the depths --kv-budget is timed at")
    p.add_argument("--budget-new-tokens", type=int, default=2048,
                   help="tokens decoded per --kv-budget request: the pool is rebuilt about every budget / 8 of "
                        "them, so the rate counts the rebuilds as decoding meets them")
    p.add_argument("--out", help="JSON file")
    p.set_defaults(func=run)
