"""Target model registry (HF model_type -> our implementation) and random-weight models."""

from __future__ import annotations

import torch

from ..errors import UserError
from .base import TargetModel
from .config import ModelConfig
from .llama import LlamaModel
from .qwen3_5 import Qwen35Model

MODEL_CLASSES: dict[str, type[TargetModel]] = {
    "llama": LlamaModel,
    "qwen3": LlamaModel,
    "qwen3_moe": LlamaModel,
    "qwen3_5": Qwen35Model,
    "qwen3_5_text": Qwen35Model,
    "qwen3_5_moe": Qwen35Model,
    "qwen3_5_moe_text": Qwen35Model,
}


def model_class(cfg: ModelConfig) -> type[TargetModel]:
    try:
        return MODEL_CLASSES[cfg.model_type]
    except KeyError:
        raise UserError(
            f"no implementation for model type {cfg.model_type!r}; supported: {', '.join(MODEL_CLASSES)}"
        ) from None


def materialize(model: torch.nn.Module, device) -> torch.nn.Module:
    """Recompute non-persistent buffers (rope tables) on `device` after building on the meta device."""
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers(device)
    return model


@torch.no_grad()
def init_random_(module: torch.nn.Module, seed: int = 0, std: float = 0.02, on_device: bool = False) -> torch.nn.Module:
    """Random weights in place: norm weights at their neutral value, the rest N(0, std). Seeded on the CPU
    so that the same seed gives the same weights on any device; `on_device` draws on the parameters'
    device instead (a multi-GB model initialises in seconds, reproducible on that device only). The
    neutral value is the norm's own `norm_neutral`, else the model's (1.0 unless norms store offsets)."""
    default = getattr(module, "norm_neutral", 1.0)
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in module.named_parameters():
        if name.endswith("norm.weight"):
            norm = module.get_submodule(name.rpartition(".")[0])
            p.fill_(getattr(norm, "norm_neutral", default))
            continue
        where = p.device if on_device else torch.device("cpu")
        gen = gens.setdefault(where, torch.Generator(device=where).manual_seed(seed))
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32, device=where) * std)
    return module


def random_model(cfg: ModelConfig, device="cpu", dtype=torch.float32, seed: int = 0, std: float = 0.02,
                 on_device: bool = False) -> TargetModel:
    """A target with random weights (tests, cost benchmarks)."""
    with torch.device("meta"):
        model = model_class(cfg)(cfg).to(dtype)
    model = model.to_empty(device=device)
    model.tie_weights()
    init_random_(model, seed, std, on_device)
    return materialize(model, device).fuse_projections().eval().requires_grad_(False)


__all__ = ["MODEL_CLASSES", "TargetModel", "init_random_", "materialize", "model_class", "random_model"]
