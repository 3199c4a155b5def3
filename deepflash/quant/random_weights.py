"""Random quantized weights in place of a model's float ones (tests, `deepflash bench quant`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .gguf_blocks import BlockFormat, random_blocks
from .weight import QuantizedWeight, quantize_modules


def quantize_random_(model: nn.Module, fmt_of: Callable[[str], BlockFormat | None], seed: int = 0,
                     scale: float = 1.0) -> nn.Module:
    """Give every linear and embedding layer whose weight name fmt_of maps to a format random blocks of that
    format (gguf_blocks.random_blocks, weights up to scale / sqrt(width)) on the weight's device, then fuse the projections again: the
    QuantizedLinear layers of one fused projection join their blocks. A tied LM head shares the table's
    blocks. Biases and norms stay as they are."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)) or (fmt := fmt_of(f"{name}.weight")) is None:
            continue
        rows, cols = module.weight.shape
        blocks = random_blocks(rows, cols, fmt, gen, scale).to(module.weight.device)
        weights[f"{name}.weight"] = QuantizedWeight([(fmt, blocks)], cols, module.weight.dtype)
    if getattr(model, "cfg", None) is not None and model.cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # tie_weights shares the table's
    leftover = quantize_modules(model, weights)
    assert not leftover, sorted(leftover)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model.fuse_projections() if hasattr(model, "fuse_projections") else model
