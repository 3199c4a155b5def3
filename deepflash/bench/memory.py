"""deepflash bench memory: the memory plan against the measured peak allocation of a long request."""

from __future__ import annotations

import gc

import torch

from ..engine.config import EngineConfig
from ..engine.memory import mib
from ..engine.runtime import load_runtime, resolve_device
from ..engine.sampling import SamplingParams
from ..errors import UserError
from .common import environment, finish, table
from .prompts import depth_prompts


def measure(cfg: EngineConfig, prompt_tokens: int, max_new: int) -> dict:
    rt = load_runtime(cfg)
    prompt = depth_prompts(rt.tokenizer, prompt_tokens, 1)[0]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()  # weights are allocated already; loading transients are not the plan's
    rt.engine.complete(prompt, SamplingParams(max_new_tokens=max_new))
    peak = torch.cuda.max_memory_allocated()
    out = {"max_ctx": rt.plan.max_ctx, "feature_dtype": cfg.feature_dtype, "prompt_tokens": len(prompt),
           "plan_bytes": rt.plan.total, "peak_bytes": peak, "plan_over_peak": rt.plan.total / peak,
           "plan": rt.plan.parts}
    del rt
    gc.collect()
    torch.cuda.empty_cache()
    return out


def run(args) -> dict:
    device = resolve_device(args.device)
    if device.type != "cuda":
        raise UserError("bench memory measures CUDA allocations; run it on a GPU")
    cases = [(8192, "f32"), (8192, "q4_0")]
    results = [measure(EngineConfig(model=args.model, draft=args.draft, device=args.device, max_ctx=ctx,
                                    feature_dtype=fmt, spec="on"), min(ctx, 8192) - args.max_new_tokens - 64,
                       args.max_new_tokens) for ctx, fmt in cases]
    table("memory plan vs measured peak", ["max_ctx", "features", "plan MiB", "peak MiB", "plan/peak"],
          [[r["max_ctx"], r["feature_dtype"], mib(r["plan_bytes"]), mib(r["peak_bytes"]), r["plan_over_peak"]]
           for r in results])
    return finish({"bench": "memory", **environment(device), "cases": results}, args.out)


def register(sub) -> None:
    p = sub.add_parser("memory", help="memory plan vs measured peak allocation (CUDA)")
    p.add_argument("--model")
    p.add_argument("--draft")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out")
    p.set_defaults(func=run)
