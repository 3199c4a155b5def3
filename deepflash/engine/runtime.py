"""From an EngineConfig (or command-line flags) to a loaded, validated Engine."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..drafter.checkpoint import load_drafter, validate_pair
from ..drafter.features import RING_KERNELS
from ..drafter.model import DFlashDrafter
from ..errors import UserError
from ..kernels.row_formats import FORMATS
from ..loading.targets import load_target
from ..loading.tokenizer import Tokenizer, load_tokenizer
from ..loading.weights import EMBEDDED_NAME
from ..models import TargetModel
from ..models.base import TARGET_KERNELS
from ..models.config import ModelConfig
from .config import (DEFAULT_PREFILL_CHUNK, DTYPES, MIN_FITTED_CHUNK, RING_CAP_ENV, EngineConfig, context_length,
                     ring_cap_from_env)
from .engine import Engine
from .memory import MemoryPlan, auto_max_ctx, free_device_bytes, plan_memory

DEFAULT_DRAFTER = Path(__file__).parent.parent / "drafters" / "smollm2-135m"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}; use auto, cpu or cuda[:N]") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but CUDA is not available; use --device cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, DTYPES[name])


def default_drafter(model: str | None) -> Path | None:
    """The drafter shipped for the embedded default target, if this build has it."""
    if model in (None, "default") and (DEFAULT_DRAFTER / "config.json").is_file():
        return DEFAULT_DRAFTER
    return None


@dataclass
class Runtime:
    engine: Engine
    tokenizer: Tokenizer
    target: TargetModel
    drafter: DFlashDrafter | None
    model_name: str
    draft_name: str | None
    plan: MemoryPlan


def load_runtime(cfg: EngineConfig) -> Runtime:
    """Load the pair `cfg` names and build its Engine (the drafter pair is checked there)."""
    cfg = cfg.validated()
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    target, folder = load_target(cfg.model, device, dtype, cfg.rope_scaling, cfg.gguf_weights, cfg.quantize)
    tokenizer = load_tokenizer(folder)
    draft_path = None if cfg.no_draft else (cfg.draft or default_drafter(cfg.model))
    drafter = load_drafter(draft_path, device, dtype) if draft_path else None
    # weights are loaded already: --max-ctx auto's budget is what is free now plus what they occupy
    loaded = target.weight_bytes() + (drafter.weight_bytes() if drafter else 0)
    cfg = replace(cfg, max_ctx=resolve_max_ctx(cfg, target, drafter, device, loaded))
    cfg = replace(cfg, prefill_chunk=fit_prefill_chunk(cfg, target, drafter, device, loaded))
    engine = Engine(target, tokenizer, drafter, cfg)
    plan = plan_memory(target, drafter, engine.max_ctx, cfg, device)
    name = cfg.model or EMBEDDED_NAME
    return Runtime(engine, tokenizer, target, drafter, name, str(draft_path) if draft_path else None, plan)


def resolve_max_ctx(cfg: EngineConfig, target: TargetModel, drafter: DFlashDrafter | None, device: torch.device,
                    loaded_bytes: int = 0) -> int:
    """cfg.max_ctx as a number of tokens: 'auto' is the largest context whose memory plan fits what the
    device has free (plus `loaded_bytes`, the pair's weights where they are loaded already) less the
    reserve; a number past the model's positions is an error (config.context_length)."""
    if cfg.max_ctx != "auto":
        return context_length(cfg.max_ctx, target.cfg.positions)
    budget = free_device_bytes(device) + loaded_bytes - cfg.reserve_mb * 2**20
    max_ctx = auto_max_ctx(target, drafter, budget, cfg, device)
    if max_ctx < 2:
        raise UserError(f"the model does not fit in the free memory of {device} with a {cfg.reserve_mb} MiB reserve")
    return max_ctx


def fit_prefill_chunk(cfg: EngineConfig, target: TargetModel, drafter: DFlashDrafter | None, device: torch.device,
                      loaded_bytes: int = 0) -> int:
    """cfg.prefill_chunk, or where none is given the default halved until the memory plan at cfg.max_ctx fits
    what the device has free (plus `loaded_bytes`) less the reserve, down to MIN_FITTED_CHUNK: a smaller chunk
    shrinks prefill's activations (a Qwen3.5-27B Q4_K_M pair at 32K fits 24 GiB with 512, not 1024). Only on
    CUDA: the CPU's memory is the host's."""
    if cfg.prefill_chunk is not None or device.type != "cuda":
        return cfg.chunk
    budget = free_device_bytes(device) + loaded_bytes - cfg.reserve_mb * 2**20
    chunk = DEFAULT_PREFILL_CHUNK
    while chunk > MIN_FITTED_CHUNK and plan_memory(target, drafter, cfg.max_ctx, replace(cfg, prefill_chunk=chunk),
                                                   device).total > budget:
        chunk //= 2
    return chunk


def meta_models(cfg: EngineConfig) -> tuple[TargetModel, DFlashDrafter | None]:
    """The pair built on the meta device from configs alone (memory plans without reading weights)."""
    from ..drafter.checkpoint import resolve_drafter
    from ..drafter.config import DrafterConfig
    from ..loading.targets import keeps_quantized
    from ..quant.quantize import chooser, quantize_format
    from ..quant.random_weights import quantize_random_
    from ..loading.weights import gguf_file, read_config, resolve_model
    from ..models import model_class

    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    tcfg = ModelConfig.from_hf(read_config(resolve_model(cfg.model)))
    if cfg.rope_scaling:
        tcfg = tcfg.with_rope_scaling(cfg.rope_scaling)
    draft_path = None if cfg.no_draft else (cfg.draft or default_drafter(cfg.model))
    if (gguf := gguf_file(cfg.model)) is not None:  # its tensor types decide the weights' bytes: read the header
        weights = "quantized" if keeps_quantized(cfg.gguf_weights, device, gguf, dtype) else "dequantized"
        target = load_target(cfg.model, "meta", dtype, cfg.rope_scaling, weights)[0]
    with torch.device("meta"):
        if gguf_file(cfg.model) is None:
            target = model_class(tcfg)(tcfg).to(dtype)
            if cfg.quantize:  # the blocks' bytes, as load_target's quantize_state makes them
                target = quantize_random_(target, chooser(target, quantize_format(cfg.quantize)))
        drafter = None
        if draft_path:
            dcfg = DrafterConfig.from_hf(read_config(resolve_drafter(str(draft_path))))
            validate_pair(dcfg, tcfg, cfg.block_size)
            drafter = DFlashDrafter(dcfg).to(dtype)
    return target, drafter


# --- command-line flags shared by generate, serve and bench -----------------------------------------
def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and engine")
    g.add_argument("--model", help="model folder, .gguf file or hub id (default: the embedded SmolLM2-135M)")
    g.add_argument("--draft", help="DFlash drafter folder or hub id (default: the shipped one for the embedded model)")
    g.add_argument("--no-draft", action="store_true", help="plain decoding, no drafter")
    g.add_argument("--block-size", type=int, help="verify block size, at most the drafter's (default: the drafter's)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, f32 on CPU), float32, bfloat16, float16")
    g.add_argument("--max-ctx", type=_max_ctx, help="context length in tokens, or 'auto' (the largest that fits the free memory); "
                        "default: the model's positions (max_position_embeddings, or its YaRN range)")
    g.add_argument("--rope-scaling", metavar="yarn:FACTOR",
                   help="stretch the target's rope with YaRN to FACTOR x its native window, so that --max-ctx may go "
                        "past max_position_embeddings (quality out there is the model's; default: the checkpoint's)")
    blocks = g.add_mutually_exclusive_group()
    blocks.add_argument("--dequantize", action="store_true",
                        help="convert a GGUF target's quantized matrices to --dtype at load (default: so where their "
                             "converted form takes at most half the free device memory, and always on the CPU)")
    blocks.add_argument("--keep-quantized", action="store_true",
                        help="keep a GGUF target's matrices in their blocks on CUDA, read by Triton kernels (default: "
                             "only where their converted form would take more than half the free device memory; "
                             "fewer bytes, slower steps so far)")
    g.add_argument("--quantize", choices=["int8", "int4"],
                   help="quantize a Hugging Face target's linear layers and experts at load: int8 as Q8_0 blocks, "
                        "int4 as Q4_1 blocks (32 weights a scale; the GGUF kernels read them)")
    g.add_argument("--feature-dtype", default="auto", choices=["auto", *FORMATS],
                   help="the drafter mirror's feature storage (auto: the target's dtype, lossless)")
    g.add_argument("--feat-ring-cap", type=int,
                   help=f"lower the feature window (memory valve; default: {RING_CAP_ENV} if set, else none)")
    g.add_argument("--trained-ctx", type=int, help="override the drafter's trained context length (default: its config's)")
    g.add_argument("--spec", default="auto", choices=["auto", "on", "off"], help="speculation policy")
    g.add_argument("--prefill-chunk", type=int,
                   help="prompt tokens per prefill forward (a power of two): bounds prefill's activation memory "
                        f"(default: {DEFAULT_PREFILL_CHUNK}, halved on CUDA until the memory plan fits)")
    g.add_argument("--kv-budget", type=int, metavar="TOKENS",
                   help="keep at most TOKENS positions of target KV on the device, every position in host memory, the "
                        "resident ones chosen by relevance (recent window, attention sink, pages by key-summary "
                        "score); changes the output past TOKENS, so off by default (serve: turns the prefix cache off)")
    g.add_argument("--ring-kernels", default="auto", choices=list(RING_KERNELS),
                   help="feature-ring kernels (auto: triton on CUDA, else torch)")
    g.add_argument("--target-kernels", default="auto", choices=list(TARGET_KERNELS),
                   help="triton: fused q/k norm + rope + cache write, decode and verify attention, residual add + "
                        "norm and SwiGLU in Triton (llama-family targets); auto: triton on CUDA, else torch. "
                        "The drafter's full layers follow (on CUDA with auto, for any target), where its head "
                        "dim is a power of two")


def _max_ctx(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError("expected a number of tokens or 'auto'") from None


def gguf_weights(args: argparse.Namespace) -> str:
    """--dequantize / --keep-quantized as EngineConfig.gguf_weights."""
    return "dequantized" if args.dequantize else "quantized" if args.keep_quantized else "auto"


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The flags of add_engine_args (and the environment's memory valve) as one config."""
    cap = args.feat_ring_cap if args.feat_ring_cap is not None else ring_cap_from_env()
    return EngineConfig(model=args.model, draft=args.draft, no_draft=args.no_draft, block_size=args.block_size,
                        device=args.device, dtype=args.dtype, max_ctx=args.max_ctx,
                        feature_dtype=args.feature_dtype, feat_ring_cap=cap, trained_ctx=args.trained_ctx,
                        spec=args.spec, prefill_chunk=args.prefill_chunk, kv_budget=args.kv_budget, rope_scaling=args.rope_scaling,
                        gguf_weights=gguf_weights(args), quantize=args.quantize,
                        ring_kernels=args.ring_kernels,
                        target_kernels=args.target_kernels).validated()
