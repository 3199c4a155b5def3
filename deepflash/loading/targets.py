"""Loading a target model from a folder, .gguf file, hub id or the embedded default."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import UserError
from ..models import TargetModel, materialize, model_class
from ..models.config import ModelConfig
from .weights import fuse_experts, load_tensors, read_config, resolve_model, safetensors_files


def build_from_state(cfg: ModelConfig, state: dict[str, torch.Tensor], device, dtype) -> TargetModel:
    """Materialise a model straight from tensors (no random init, no second copy of the weights). The
    dict is emptied: then the model holds the only references, and the tensors that fusion
    (fuse_projections) replaces are freed as it goes rather than all at the end (on Qwen3-8B the fused
    q/k/v and gate/up are 65% of the weights)."""
    cls = model_class(cfg)
    named = cls.prepare_state_dict(fuse_experts(state), cfg)
    state.clear()
    with torch.device("meta"):
        model = cls(cfg).to(dtype)
    named = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in named.items()}
    missing, unexpected = model.load_state_dict(named, strict=False, assign=True)
    named.clear()
    if missing or unexpected:
        raise UserError(
            f"checkpoint does not match the {cfg.model_type} architecture: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.tie_weights()
    return materialize(model, device).fuse_projections().eval().requires_grad_(False)


def load_target(spec: str | None, device="cpu", dtype=torch.float32,
                rope_scaling: str | None = None) -> tuple[TargetModel, Path]:
    """Load a target from a folder, .gguf file, hub id or the embedded default (None); rope_scaling:
    ModelConfig.with_rope_scaling's 'yarn:FACTOR'."""
    folder = resolve_model(spec)
    cfg = ModelConfig.from_hf(read_config(folder))
    if rope_scaling:
        cfg = cfg.with_rope_scaling(rope_scaling)
    model_class(cfg)  # fail on an unsupported architecture before reading gigabytes
    state = load_tensors(safetensors_files(folder), device, dtype)
    return build_from_state(cfg, state, device, dtype), folder

