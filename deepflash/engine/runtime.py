"""From an EngineConfig (or command-line flags) to a loaded, validated Engine."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
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
from .config import DTYPES, EngineConfig
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
    cfg = cfg.validated()
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    target, folder = load_target(cfg.model, device, dtype)
    tokenizer = load_tokenizer(folder)
    draft_path = None if cfg.no_draft else (cfg.draft or default_drafter(cfg.model))
    drafter = load_drafter(draft_path, device, dtype) if draft_path else None
    if drafter is not None:
        validate_pair(drafter.cfg, target.cfg, cfg.block_size)
    max_ctx = cfg.max_ctx
    plan_args = dict(feature_dtype=cfg.feature_dtype, feat_ring_cap=cfg.feat_ring_cap,
                     trained_ctx=cfg.trained_ctx, block_size=cfg.block_size, device=device)
    if max_ctx == "auto":
        # weights are loaded already: the budget is what is free now plus what they occupy
        loaded = target.weight_bytes() + (drafter.weight_bytes() if drafter else 0)
        budget = free_device_bytes(device) + loaded - cfg.reserve_mb * 2**20
        max_ctx = auto_max_ctx(target, drafter, budget, **plan_args)
        if max_ctx < 2:
            raise UserError(f"the model does not fit in the free memory of {device} with a "
                            f"{cfg.reserve_mb} MiB reserve")
    max_ctx = min(max_ctx or target.cfg.max_position_embeddings, target.cfg.max_position_embeddings)
    engine = Engine(target, tokenizer, drafter, max_ctx=max_ctx, block_size=cfg.block_size,
                    feature_dtype=cfg.feature_dtype, feat_ring_cap=cfg.feat_ring_cap,
                    trained_ctx=cfg.trained_ctx, spec=cfg.spec,
                    ring_kernels=cfg.ring_kernels, target_kernels=cfg.target_kernels)
    plan = plan_memory(target, drafter, max_ctx, **plan_args)
    name = cfg.model or EMBEDDED_NAME
    return Runtime(engine, tokenizer, target, drafter, name, str(draft_path) if draft_path else None, plan)


def meta_models(cfg: EngineConfig) -> tuple[TargetModel, DFlashDrafter | None, ModelConfig]:
    """The pair built on the meta device from configs alone (memory plans without reading weights)."""
    from ..drafter.checkpoint import resolve_drafter
    from ..drafter.config import DrafterConfig
    from ..loading.weights import read_config, resolve_model
    from ..models import model_class

    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    tcfg = ModelConfig.from_hf(read_config(resolve_model(cfg.model)))
    draft_path = None if cfg.no_draft else (cfg.draft or default_drafter(cfg.model))
    with torch.device("meta"):
        target = model_class(tcfg)(tcfg).to(dtype)
        drafter = None
        if draft_path:
            dcfg = DrafterConfig.from_hf(read_config(resolve_drafter(str(draft_path))))
            validate_pair(dcfg, tcfg, cfg.block_size)
            drafter = DFlashDrafter(dcfg).to(dtype)
    return target, drafter, tcfg


# --- command-line flags shared by generate, serve and bench -----------------------------------------
def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and engine")
    g.add_argument("--model", help="model folder, .gguf file or hub id (default: the embedded SmolLM2-135M)")
    g.add_argument("--draft", help="DFlash drafter folder or hub id (default: the shipped one for the embedded model)")
    g.add_argument("--no-draft", action="store_true", help="plain decoding, no drafter")
    g.add_argument("--block-size", type=int, help="verify block size (at most the drafter's)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, f32 on CPU), float32, bfloat16, float16")
    g.add_argument("--max-ctx", type=_max_ctx, help="context length in tokens, or 'auto' (largest that fits)")
    g.add_argument("--feature-dtype", default="f32", choices=list(FORMATS), help="drafter feature storage")
    g.add_argument("--feat-ring-cap", type=int, help="lower the feature window (memory valve)")
    g.add_argument("--trained-ctx", type=int, help="override the drafter's trained context length")
    g.add_argument("--spec", default="auto", choices=["auto", "on", "off"], help="speculation policy")
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


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, draft=args.draft, no_draft=args.no_draft, block_size=args.block_size,
                        device=args.device, dtype=args.dtype, max_ctx=args.max_ctx,
                        feature_dtype=args.feature_dtype, feat_ring_cap=args.feat_ring_cap,
                        trained_ctx=args.trained_ctx, spec=args.spec,
                        ring_kernels=args.ring_kernels, target_kernels=args.target_kernels)
