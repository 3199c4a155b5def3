"""Float weights quantized into GGUF blocks at load (`--quantize`): Q8_0 for int8, Q4_1 for int4.

Both are 32-weight blocks with float16 scales (Q4_1 with a float16 minimum too) that the GGUF kernels
(kernels/quant_gemv.py, kernels/quant_moe.py) already read, so a Hugging Face checkpoint quantized here runs
on the same code as a GGUF file: 8.5 and 5 bits a weight. The arithmetic is ggml's reference quantizer's
(quantize_row_q8_0 / q4_1, as the gguf package's numpy port computes it), in float32 torch on the weight's
device: a file quantized here and one llama.cpp wrote from the same float32 weights hold the same bytes.
"""

from __future__ import annotations

import torch
from torch import nn

from .experts import ExpertBlocks, GateUp
from .gguf_blocks import FORMATS, BlockFormat
from .weight import QuantizedWeight

QUANTIZE = {"int8": "Q8_0", "int4": "Q4_1"}  # --quantize -> the block format
_BY_NAME = {f.name: f for f in FORMATS.values()}


def quantize_format(kind: str) -> BlockFormat:
    return _BY_NAME[QUANTIZE[kind]]


def quantize(weight: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """[..., K] float -> uint8 [..., K // 32 * nbytes] blocks of `fmt` (Q8_0 or Q4_1)."""
    lead, cols = weight.shape[:-1], weight.shape[-1]
    blocks = weight.float().reshape(-1, 32)
    packed = _QUANTIZERS[fmt.name](blocks)
    return packed.reshape(*lead, cols // 32 * fmt.nbytes)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _f16_bytes(value: torch.Tensor) -> torch.Tensor:
    return value.to(torch.float16).view(torch.uint8)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    scaled = blocks * _inverse(d)
    # roundf: half away from zero (the numpy port's floor(a) + floor(2 (a - floor(a))))
    a = scaled.abs()
    q = torch.sign(scaled) * (a.floor() + (2 * (a - a.floor())).floor())
    return torch.cat([_f16_bytes(d), q.to(torch.int8).view(torch.uint8)], dim=-1)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    high = blocks.amax(dim=-1, keepdim=True)
    low = blocks.amin(dim=-1, keepdim=True)
    d = (high - low) / 15
    q = ((blocks - low) * _inverse(d) + 0.5).trunc().to(torch.uint8).clamp(0, 15)
    packed = q[:, :16] | (q[:, 16:] << 4)  # weights 0-15 in the low nibbles, 16-31 in the high
    return torch.cat([_f16_bytes(d), _f16_bytes(low), packed], dim=-1)


_QUANTIZERS = {"Q8_0": _q8_0, "Q4_1": _q4_1}


def chooser(model: nn.Module, fmt: BlockFormat):
    """fmt_of for a model's weights quantized at load: every linear layer's weight whose width is whole
    blocks, and every expert stack (named by its down_proj); not embedding tables (a lookup reads one row)
    nor an LM head tied to one."""
    from .random_weights import is_expert_stack

    tied = getattr(getattr(model, "cfg", None), "tie_word_embeddings", False)
    names = {f"{name}.weight" for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and m.in_features % fmt.block == 0 and not (tied and name == "lm_head")}
    names |= {f"{name}.down_proj" for name, m in model.named_modules()
              if is_expert_stack(m) and m.down_proj.shape[-1] % fmt.block == 0 and m.down_proj.shape[1] % fmt.block == 0}
    return lambda name: fmt if name in names else None


def quantize_state(model: nn.Module, state: dict[str, torch.Tensor], fmt: BlockFormat, device,
                   dtype: torch.dtype) -> dict:
    """The state with the weights `chooser` picks quantized on `device`: QuantizedWeight for a linear layer,
    GateUp and ExpertBlocks for an expert stack (load_target then puts the quantized layers in place)."""
    fmt_of = chooser(model, fmt)
    out = {}
    for name, tensor in state.items():
        if name.endswith(".gate_up_proj") and fmt_of(name.replace(".gate_up_proj", ".down_proj")):
            half = tensor.shape[1] // 2
            gate_up = quantize(tensor.to(device), fmt)
            out[name] = GateUp(ExpertBlocks(fmt, gate_up[:, :half]), ExpertBlocks(fmt, gate_up[:, half:]))
        elif name.endswith(".down_proj") and fmt_of(name):
            out[name] = ExpertBlocks(fmt, quantize(tensor.to(device), fmt))
        elif fmt_of(name):
            out[name] = QuantizedWeight([(fmt, quantize(tensor.to(device), fmt))], tensor.shape[-1], dtype)
        else:
            out[name] = tensor
    return out
