"""deepflash bench quant: targets kept in GGUF blocks against bf16, and the embedded SmolLM2 kept quantized
against dequantized.

Shapes: random targets of Qwen3-8B's and Qwen3.5-27B's widths (depth cut by --layers where memory asks), in
bf16 and with random blocks (gguf_blocks.random_blocks) of Q8_0, Q6_K, Q4_K_M (llama.cpp's mix: Q6_K for
the LM head and for v and down in its use_more_bits layers, Q4_K elsewhere) and Q3_K. Per format: the
device time of the target's 1-token decode forward and of its 16-token verify forward (CUDA graphs, the
target alone), the bytes a decode step reads (weights as stored + the KV attended) and MBU, and prefill
tok/s of a 1024-token forward.

Embedded: the SmolLM2 GGUF (Q4_1 layers, Q8_0 table) loaded kept quantized and dequantized to bf16, plain
and DFlash tok/s and acceptance length on HumanEval prompts.

    deepflash bench quant --out benchmarks/quantized/quant.json
"""

from __future__ import annotations

import re

import torch

from ..drafter.config import DrafterConfig
from ..drafter.model import DFlashDrafter
from ..engine.config import EngineConfig
from ..engine.memory import plan_memory
from ..engine.runtime import load_runtime, resolve_device
from ..engine.sampling import SamplingParams
from ..errors import UserError
from ..models import model_class, random_model
from ..models.config import ModelConfig
from ..quant.gguf_blocks import FORMATS, BlockFormat
from ..quant.random_weights import quantize_random_
from .common import copy_bandwidth, environment, finish, forward_seconds, sync, table
from .families import family_shape
from .prompts import humaneval_messages
from .speed import QWEN3_8B, run_engine

FORMAT_NAMES = ("bf16", "Q8_0", "Q6_K", "Q4_K_M", "Q3_K")
SHAPES = {"qwen3-8b": (QWEN3_8B, 36), "qwen3.5-27b": (family_shape("qwen3.5", "wide", 16), 16)}  # (shape, layers)
CONTEXT = 512  # tokens in the cache when a step is timed
PREFILL = 1024
PLAN_CHUNKS = (1024, 512)  # prefill chunks of --part plan: the default and half (the workspace follows it)
_BY_NAME = {f.name: f for f in FORMATS.values()}
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose v and down projections Q4_K_M keeps in Q6_K (llama-quant.cpp)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def format_of(name: str, layers: int):
    """A weight name -> its block format (None: stays float) under one of FORMAT_NAMES."""
    def choose(weight: str) -> BlockFormat | None:
        if name == "bf16" or weight.endswith("norm.weight"):
            return None
        if name != "Q4_K_M":
            return _BY_NAME[name]
        layer = _LAYER.match(weight)
        wider = weight == "lm_head.weight" or (
            layer and ("v_proj" in weight or "down_proj" in weight) and use_more_bits(int(layer[1]), layers))
        return _BY_NAME["Q6_K" if wider else "Q4_K"]
    return choose


def quantized_target(shape: dict, layers: int, fmt: str, device: torch.device):
    cfg = ModelConfig.from_hf(dict(shape, num_hidden_layers=layers, **_layer_types(shape, layers)))
    target = random_model(cfg, device=device, dtype=torch.bfloat16, seed=0, std=0.02, on_device=True)
    return quantize_random_(target, format_of(fmt, layers), seed=0).use_kernels("auto")


def _layer_types(shape: dict, layers: int) -> dict:
    types = shape.get("layer_types")
    return {"layer_types": (types * layers)[:layers]} if types else {}


def prefill_tok_per_s(target, device: torch.device) -> float:
    cache = target.new_cache(1, PREFILL)
    ids = torch.randint(2, target.cfg.vocab_size, (1, PREFILL), device=device)
    positions = torch.arange(PREFILL, device=device)
    target(ids, positions, cache, PREFILL, logits="last")  # warm-up (Triton compiles)
    sync(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(3):
        target(ids, positions, cache, PREFILL, logits="last")
    end.record()
    sync(device)
    return 3 * PREFILL / (begin.elapsed_time(end) / 1e3)


def format_row(shape: dict, layers: int, fmt: str, device: torch.device, bandwidth: float) -> dict:
    with torch.no_grad():
        target = quantized_target(shape, layers, fmt, device)
        decode_s, verify_s = forward_seconds(target, 1, CONTEXT), forward_seconds(target, 16, CONTEXT)
        prefill = prefill_tok_per_s(target, device)
    step_bytes = target.decode_weight_bytes() + CONTEXT * target.kv_bytes_per_token()
    row = {"format": fmt, "weight_bytes": target.weight_bytes(), "bytes_per_step": step_bytes,
           "decode_ms": decode_s * 1e3, "decode_tok_per_s": 1 / decode_s, "mbu": step_bytes / decode_s / (bandwidth * 1e9),
           "verify_ms": verify_s * 1e3, "verify_over_decode": verify_s / decode_s, "prefill_tok_per_s": prefill}
    del target
    torch.cuda.empty_cache()
    return row


def shape_rows(name: str, layers: int | None, formats: list[str], device, bandwidth: float) -> list[dict]:
    shape, default_layers = SHAPES[name]
    rows = [format_row(shape, layers or default_layers, fmt, device, bandwidth) for fmt in formats]
    base = next((r for r in rows if r["format"] == "bf16"), None)
    for row in rows:
        row["decode_speedup_vs_bf16"] = base["decode_ms"] / row["decode_ms"] if base else None
    return rows


def embedded_rows(device, prompts: int, max_new: int) -> dict:
    """The embedded pair kept quantized and dequantized: plain and DFlash on HumanEval prompts."""
    params = SamplingParams(max_new_tokens=max_new)
    out = {}
    for weights in ("quantized", "dequantized"):
        rt = load_runtime(EngineConfig(device=str(device), gguf_weights=weights, spec="on"))
        ids = [rt.tokenizer.chat(m) for m in humaneval_messages(prompts)]
        plain = run_engine(load_runtime(EngineConfig(device=str(device), gguf_weights=weights, no_draft=True)).engine,
                           ids, max_new, params)
        spec = run_engine(rt.engine, ids, max_new, params)
        out[weights] = {"weight_bytes": rt.target.weight_bytes(), "plain_tok_per_s": plain["tok_per_s"],
                        "dflash_tok_per_s": spec["tok_per_s"], "acceptance_length": spec["acceptance_length"],
                        "dflash_speedup": spec["tok_per_s"] / plain["tok_per_s"],
                        "same_text": plain["outputs"] == spec["outputs"]}
    return out


# a drafter of the z-lab shape for the 27B targets (REFERENCE: 5 layers at the target's width), for the plan
ZLAB_27B_DRAFTER = dict(architectures=["DFlashDraftModel"], hidden_size=5120, intermediate_size=17408,
                        num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                        rms_norm_eps=1e-6, rope_theta=1e7, max_position_embeddings=262144, vocab_size=248320,
                        num_target_layers=64, dflash_config={"mask_token_id": 248070, "block_size": 16,
                                                             "target_layer_ids": [1, 16, 31, 46, 61]})


def plan_row(fmt: str, context: int, chunk: int, card_gib: float, device: torch.device) -> dict:
    """The memory plan of a whole Qwen3.5-27B-shaped target in `fmt` with a z-lab-shaped drafter at `context`
    tokens and prefill chunks of `chunk`, built on the meta device (nothing allocated), against a card of
    card_gib."""
    shape = family_shape("qwen3.5", "wide", 64)
    cfg = ModelConfig.from_hf(shape)
    with torch.device("meta"):
        target = quantize_random_(model_class(cfg)(cfg).to(torch.bfloat16), format_of(fmt, 64))
        drafter = DFlashDrafter(DrafterConfig.from_hf(ZLAB_27B_DRAFTER)).to(torch.bfloat16)
    plan = plan_memory(target, drafter, context, EngineConfig(max_ctx=context, prefill_chunk=chunk), device)
    return {"format": fmt, "context": context, "prefill_chunk": chunk, "card_gib": card_gib, "plan_bytes": plan.total,
            "fits": plan.total <= card_gib * 2**30, "parts": plan.parts}


def run(args) -> dict:
    device = resolve_device(args.device)
    if args.part == "plan":  # meta models: any device
        rows = [plan_row("Q4_K_M", args.context, chunk, args.card_gib, device) for chunk in PLAN_CHUNKS]
        table(f"Qwen3.5-27B-shaped Q4_K_M target + z-lab-shaped drafter at {args.context} tokens ({device.type} "
              f"plan), GiB by prefill chunk", ["part", *map(str, PLAN_CHUNKS)],
              [[k, *(r["parts"][k] / 2**30 for r in rows)] for k in rows[0]["parts"]]
              + [["total", *(r["plan_bytes"] / 2**30 for r in rows)],
                 [f"fits {args.card_gib:g} GiB", *(r["fits"] for r in rows)]])
        return finish({"bench": "quant", "part": "plan", **environment(device), "plans": rows}, args.out)
    if device.type != "cuda":
        raise UserError("bench quant times CUDA graphs and the Triton kernels: it needs a CUDA device")
    bandwidth = copy_bandwidth(device)
    formats = args.formats.split(",")
    unknown = set(formats) - set(FORMAT_NAMES)
    if unknown:
        raise UserError(f"unknown formats {sorted(unknown)}; choose from {', '.join(FORMAT_NAMES)}")
    record = {"bench": "quant", **environment(device), "copy_bandwidth_gb_s": bandwidth, "context": CONTEXT,
              "shapes": {}}
    for name in filter(None, args.shapes.split(",")):  # --shapes "": the embedded part alone
        if name not in SHAPES:
            raise UserError(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
        rows = shape_rows(name, args.layers, formats, device, bandwidth)
        record["shapes"][name] = rows
        table(f"{name}-shaped random target ({rows[0]['format']} first), target forward alone",
              ["format", "GB", "decode ms", "tok/s", "x bf16", "MBU", "verify/decode", "prefill tok/s"],
              [[r["format"], r["weight_bytes"] / 1e9, r["decode_ms"], r["decode_tok_per_s"],
                r["decode_speedup_vs_bf16"], r["mbu"], r["verify_over_decode"], r["prefill_tok_per_s"]] for r in rows])
    if args.prompts:
        record["embedded"] = embedded = embedded_rows(device, args.prompts, args.max_new_tokens)
        table("embedded SmolLM2-135M pair on HumanEval", ["weights", "MB", "plain tok/s", "DFlash tok/s", "AL",
                                                           "speedup", "same text"],
              [[k, v["weight_bytes"] / 1e6, v["plain_tok_per_s"], v["dflash_tok_per_s"], v["acceptance_length"],
                v["dflash_speedup"], v["same_text"]] for k, v in embedded.items()])
    return finish(record, args.out)


def register(sub) -> None:
    p = sub.add_parser("quant", help="GGUF block formats against bf16: decode, verify, prefill, MBU; embedded pair")
    p.add_argument("--device", default="auto")
    p.add_argument("--part", default="speed", choices=["speed", "plan"],
                   help="speed: the shapes' formats and the embedded pair (CUDA); plan: a Qwen3.5-27B Q4_K_M pair's "
                        "memory plan against --card-gib (meta models, any device)")
    p.add_argument("--context", type=int, default=32768, help="tokens of context of --part plan")
    p.add_argument("--card-gib", type=float, default=24.0, help="the card --part plan is held against")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)} (\"\": none)")
    p.add_argument("--formats", default=",".join(FORMAT_NAMES), help="comma list (bf16 first gives the ratios)")
    p.add_argument("--layers", type=int, help="decoder layers of every shape (default: 36 for Qwen3-8B, 16 of "
                                              "Qwen3.5-27B's 64)")
    p.add_argument("--prompts", type=int, default=10, help="HumanEval prompts of the embedded part (0: skip it)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", help="JSON file")
    p.set_defaults(func=run)
