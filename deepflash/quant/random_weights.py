"""Random quantized weights in place of a model's float ones (tests, `deepflash bench quant`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .gguf_blocks import BlockFormat, random_blocks, row_bytes
from .experts import ExpertBlocks, GateUp
from .weight import QuantizedWeight, quantize_modules


def quantize_random_(model: nn.Module, fmt_of: Callable[[str], BlockFormat | None], seed: int = 0,
                     scale: float = 1.0) -> nn.Module:
    """Give every linear and embedding layer whose weight name fmt_of maps to a format random blocks of that
    format (gguf_blocks.random_blocks, weights up to scale / sqrt(width)) on the weight's device, and every
    expert stack whose down_proj name it maps (its gate, up and down in that format), then fuse the
    projections again: the QuantizedLinear layers of one fused projection join their blocks. A tied LM head shares the table's
    blocks. Biases and norms stay as they are."""
    gen = torch.Generator().manual_seed(seed)

    def blocks(rows: int, cols: int, fmt: BlockFormat, like: torch.Tensor) -> torch.Tensor:
        if like.is_meta:  # shapes only (memory plans): no bytes drawn
            return torch.empty(rows, row_bytes(fmt, cols), dtype=torch.uint8, device="meta")
        return random_blocks(rows, cols, fmt, gen, scale).to(like.device)

    weights = {}
    for name, module in model.named_modules():
        if is_expert_stack(module) and (fmt := fmt_of(f"{name}.down_proj")) is not None:
            count, hidden, inner = module.down_proj.shape
            stack = [ExpertBlocks(fmt, blocks(count * r, c, fmt, module.down_proj).view(count, r, -1))
                     for r, c in ((inner, hidden), (inner, hidden), (hidden, inner))]
            weights[f"{name}.gate_up_proj"], weights[f"{name}.down_proj"] = GateUp(*stack[:2]), stack[2]
        if not isinstance(module, (nn.Linear, nn.Embedding)) or (fmt := fmt_of(f"{name}.weight")) is None:
            continue
        rows, cols = module.weight.shape
        weights[f"{name}.weight"] = QuantizedWeight([(fmt, blocks(rows, cols, fmt, module.weight))], cols,
                                                    module.weight.dtype)
    if getattr(model, "cfg", None) is not None and model.cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # tie_weights shares the table's
    leftover = quantize_modules(model, weights)
    assert not leftover, sorted(leftover)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model.fuse_projections() if hasattr(model, "fuse_projections") else model


def is_expert_stack(module: nn.Module) -> bool:
    """A layers.Experts (fused gate_up_proj [E, 2I, H], down_proj [E, H, I]), known by its parameters: quant/
    sits below models/ in the imports."""
    return isinstance(getattr(module, "down_proj", None), nn.Parameter) and module.down_proj.dim() == 3
