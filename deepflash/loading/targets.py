"""Loading a target model from a folder, .gguf file, hub id or the embedded default."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import UserError
from ..models import TargetModel, materialize, model_class
from ..models.config import ModelConfig
from ..quant.experts import ExpertBlocks, GateUp, QuantizedExperts, dequantized
from ..quant.quantize import quantize_format, quantize_state
from ..quant.weight import QuantizedWeight, quantize_modules
from .gguf import float_bytes, gguf_state
from .weights import fuse_experts, gguf_file, load_tensors, read_config, resolve_model, safetensors_files


def build_from_state(cfg: ModelConfig, state: dict[str, torch.Tensor], device, dtype,
                     quantize: str | None = None) -> TargetModel:
    """Materialise a model straight from tensors (no random init, no second copy of the weights). The
    dict is emptied: then the model holds the only references, and the tensors that fusion
    (fuse_projections) replaces are freed as it goes rather than all at the end (on Qwen3-8B the fused
    q/k/v and gate/up are 65% of the weights). quantize: 'int8' or 'int4' quantizes the linear layers and
    expert stacks into GGUF blocks on `device` (quant/quantize.py)."""
    cls = model_class(cfg)
    named = cls.prepare_state_dict(fuse_experts(state), cfg)
    state.clear()
    with torch.device("meta"):
        model = cls(cfg).to(dtype)
    if quantize:
        named = quantize_state(model, named, quantize_format(quantize), device, dtype)
    # quantized weights take the places of their layers; those of other places (a router's) are dequantized
    kept = (QuantizedWeight, GateUp, ExpertBlocks)
    quantized = {k: named.pop(k) for k in [k for k, v in named.items() if isinstance(v, kept)]}
    named.update({k: dequantized(w, dtype) for k, w in quantize_modules(model, quantized).items()})
    named = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in named.items()}
    missing, unexpected = model.load_state_dict(named, strict=False, assign=True)
    named.clear()
    held = {f"{name}.{buffer}" for name, module in model.named_modules(remove_duplicate=False)
            if isinstance(module, (QuantizedWeight, QuantizedExperts)) for buffer, _ in module.named_buffers()}
    missing = [k for k in missing if k not in held]
    if missing or unexpected:
        raise UserError(
            f"checkpoint does not match the {cfg.model_type} architecture: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.tie_weights()
    return materialize(model, device).fuse_projections().eval().requires_grad_(False)


GGUF_WEIGHTS = ("auto", "quantized", "dequantized")  # load_target's gguf_weights
# 'auto' keeps a GGUF target in its blocks where its float form would take more than this share of the device's
# free memory: the block kernels read 2-4x fewer bytes but decode slower than the bf16 path so far (a Qwen3-8B
# shape in Q4_K_M at 0.69x bf16 on an H100, BENCHMARKS.md), so blocks are for targets that do not fit otherwise
AUTO_FLOAT_SHARE = 0.5


def keeps_quantized(gguf_weights: str, device, gguf: Path, dtype: torch.dtype) -> bool:
    """Whether the matrices of the GGUF file `gguf` stay in their blocks: 'auto' keeps them on CUDA where their
    `dtype` form would not fit AUTO_FLOAT_SHARE of the free memory; on the CPU no kernel reads blocks, and every
    step would dequantize every weight."""
    if gguf_weights not in GGUF_WEIGHTS:
        raise UserError(f"GGUF weights must be one of {', '.join(GGUF_WEIGHTS)}, got {gguf_weights!r}")
    if gguf_weights == "auto":
        device = torch.device(device)
        return device.type == "cuda" and float_bytes(gguf, dtype) > AUTO_FLOAT_SHARE * torch.cuda.mem_get_info(device)[0]
    return gguf_weights == "quantized"


def load_target(spec: str | None, device="cpu", dtype=torch.float32, rope_scaling: str | None = None,
                gguf_weights: str = "auto", quantize: str | None = None) -> tuple[TargetModel, Path]:
    """Load a target from a folder, .gguf file, hub id or the embedded default (None); rope_scaling:
    ModelConfig.with_rope_scaling's 'yarn:FACTOR'; gguf_weights: a GGUF target's matrices 'quantized' (kept
    in their blocks), 'dequantized' (to `dtype` at load) or 'auto' (keeps_quantized); quantize: 'int8' or
    'int4' quantizes a Hugging Face checkpoint's matrices at load (build_from_state). On the meta device
    nothing is read (memory plans)."""
    folder = resolve_model(spec)
    cfg = ModelConfig.from_hf(read_config(folder))
    if rope_scaling:
        cfg = cfg.with_rope_scaling(rope_scaling)
    model_class(cfg)  # fail on an unsupported architecture before reading gigabytes
    if (gguf := gguf_file(spec)) is not None:
        if quantize:
            raise UserError("--quantize is for Hugging Face checkpoints: a GGUF file's weights are quantized "
                            "already (--keep-quantized keeps their blocks on CUDA, --dequantize converts them)")
        kept = keeps_quantized(gguf_weights, device, gguf, dtype)
        state = gguf_state(gguf, read_config(folder), device, dtype, kept)
    else:
        # to be quantized, the float weights wait on the host: a card that holds the quantized model may not
        # hold the float one
        state = load_tensors(safetensors_files(folder), "cpu" if quantize else device, dtype)
    return build_from_state(cfg, state, device, dtype, quantize), folder

