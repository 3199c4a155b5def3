"""Weights kept in their GGUF blocks on the device, and the layers that compute with them.

A QuantizedWeight [N, K] holds one or more parts of whole rows, each a uint8 tensor of GGUF blocks of
one format (gguf_blocks.py). Several parts exist where a fused projection joins weights a file stores in
different formats (Q4_K_M keeps some layers' v projection in Q6_K beside Q4_K q and k): their rows
cannot share one buffer, so the projection runs per part and concatenates.

A projection of a decode or verify step's few rows on CUDA reads the blocks in the Triton kernel
(kernels/quant_gemv.py), which computes a row the same whatever the number of rows; more rows (prefill)
dequantize the weight, a slice of rows at a time, and take torch's GEMM. On the CPU the kernel runs
where the layer's kernels are on (Triton's interpreter in the tests), else the dequantized form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .gguf_blocks import BlockFormat, dequantize

SLICE_BYTES = 64 << 20  # the most bytes of dequantized weight a prefill projection holds at once


class QuantizedWeight(nn.Module):
    """A weight [N, K] as GGUF blocks: parts of whole rows, each [rows, row_bytes] uint8 of one format.
    `dtype` is the compute dtype (activations and dequantized weights); it follows .to(dtype).

    columns: where the file stores its input features in another order than the model's (llama.cpp
    reorders the value heads of Qwen3.5's DeltaNet output projection): the model's weight is the file's
    weight.index_select(-1, columns). Reordering the blocks' columns would cross blocks; a projection
    gathers its input into the file's order instead (index_select of a step's few rows)."""

    def __init__(self, parts: list[tuple[BlockFormat, torch.Tensor]], cols: int, dtype: torch.dtype,
                 columns: torch.Tensor | None = None):
        super().__init__()
        self.formats = [fmt for fmt, _ in parts]
        for i, (_, blocks) in enumerate(parts):
            self.register_buffer(f"part{i}", blocks)
        # empty, so that .to(dtype) and .to(device) carry the compute dtype and device with the module
        self.register_buffer("compute", torch.empty(0, dtype=dtype, device=parts[0][1].device))
        self.register_buffer("columns", columns)
        self.register_buffer("file_order", None if columns is None else torch.argsort(columns))
        self.cols = cols

    @property
    def parts(self) -> list[tuple[BlockFormat, torch.Tensor]]:
        return [(fmt, getattr(self, f"part{i}")) for i, fmt in enumerate(self.formats)]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(blocks.shape[0] for _, blocks in self.parts), self.cols

    @property
    def dtype(self) -> torch.dtype:
        return self.compute.dtype

    @property
    def device(self) -> torch.device:
        return self.compute.device

    def numel(self) -> int:
        rows, cols = self.shape
        return rows * cols

    @property
    def nbytes(self) -> int:
        return sum(blocks.nbytes for _, blocks in self.parts)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        weight = torch.cat([dequantize(blocks, fmt, dtype) for fmt, blocks in self.parts])
        return weight if self.columns is None else weight.index_select(-1, self.columns)

    def take_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` dequantized (an embedding lookup): only their blocks are read."""
        (fmt, blocks), = self.parts  # an embedding table is one tensor of the file, in the model's order
        assert self.columns is None
        return dequantize(blocks[ids], fmt, self.dtype)

    def row_slice(self, start: int, stop: int) -> QuantizedWeight:
        """Rows [start, stop) as views of this weight's blocks (a fused projection's member linears)."""
        parts, row = [], 0
        for fmt, blocks in self.parts:
            lo, hi = max(start - row, 0), min(stop - row, blocks.shape[0])
            if lo < hi:
                parts.append((fmt, blocks[lo:hi]))
            row += blocks.shape[0]
        return QuantizedWeight(parts, self.cols, self.dtype, self.columns)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None, kernels: bool,
                rows8: tuple[torch.Tensor, ...] | None = None, in_file_order: bool = False) -> torch.Tensor:
        """x @ weight.T + bias: the Triton kernel for a step's few rows on CUDA (or with `kernels`, the
        layer's kernels being on), else dequantized slices and torch's GEMM. On the kernel, the parts write
        their columns of one output, and the rows are quantized to int8 once for the parts that take them
        (quant_gemv.integer), unless `rows8` (int8_buffers) holds them already, written by the kernel before.
        in_file_order: x's columns come in the file's order already (head_order), not the model's."""
        if self.file_order is not None and not in_file_order:
            x = x.index_select(-1, self.file_order)
        if kernels or x.is_cuda:
            from ..kernels import quant_gemv  # imports Triton: only where it is used

            if quant_gemv.fits(x):
                out = torch.empty((*x.shape[:-1], self.shape[0]), dtype=x.dtype, device=x.device)
                rows8 = rows8 or quant_gemv.quantized_rows_for(x, self.ggml_types)
                row = 0
                for fmt, blocks in self.parts:
                    n = blocks.shape[0]
                    quant_gemv.linear(x, blocks, fmt.ggml_type, self.cols, rows8=rows8, out=out[..., row : row + n])
                    row += n
                return out if bias is None else out + bias
        outs = [_dequantized_linear(x, fmt, blocks) for fmt, blocks in self.parts]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out if bias is None else out + bias

    def int8_buffers(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """Where the kernel that makes x, a projection's input on the kernels (the norm before it, or SiLU * up),
        writes x's rows quantized to int8 as well (int8_rows.row_buffers), so that `project` need not quantize
        them: where a part takes int8 rows and x is in the model's column order. None elsewhere."""
        from ..kernels import int8_rows, quant_gemv  # imports Triton: only where it is used

        if self.file_order is not None or not quant_gemv.fits(x) or not any(
                quant_gemv.integer(t, x.dtype) for t in self.ggml_types):
            return None
        return int8_rows.row_buffers(x.shape[-1], x.device)

    def head_order(self, width: int) -> torch.Tensor | None:
        """Where the file's column order moves whole groups of `width` columns (the DeltaNet's value heads), which
        group of the model's order each of the file's takes (int64 [cols / width]), so that the kernel making
        the input can write it in the file's order (layer_ops.row_norm); else None. Reads the order on the host."""
        if self.file_order is None or self.cols % width:
            return None
        groups = self.file_order.view(-1, width)
        order = groups[:, 0] // width
        whole = order[:, None] * width + torch.arange(width, device=order.device)
        return order if torch.equal(groups, whole) else None

    @property
    def ggml_types(self) -> list[int]:
        return [fmt.ggml_type for fmt in self.formats]

    @staticmethod
    def cat(weights: list[QuantizedWeight]) -> QuantizedWeight:
        """The weights' rows in order as one weight: neighbouring parts of one format share one buffer."""
        assert all(w.columns is None for w in weights), "weights of reordered inputs are not fused"
        parts: list[tuple[BlockFormat, torch.Tensor]] = []
        for fmt, blocks in (part for w in weights for part in w.parts):
            if parts and parts[-1][0] == fmt:
                parts[-1] = (fmt, torch.cat([parts[-1][1], blocks]))
            else:
                parts.append((fmt, blocks))
        return QuantizedWeight(parts, weights[0].cols, weights[0].dtype)


def _dequantized_linear(x: torch.Tensor, fmt: BlockFormat, blocks: torch.Tensor) -> torch.Tensor:
    """x @ dequantize(blocks).T, dequantizing SLICE_BYTES of weight at a time: a large vocabulary's LM
    head would otherwise take gigabytes for the length of one projection."""
    cols = blocks.shape[1] // fmt.nbytes * fmt.block
    step = max(1, SLICE_BYTES // (cols * x.element_size()))
    if step >= blocks.shape[0]:
        return F.linear(x, dequantize(blocks, fmt, x.dtype))
    return torch.cat([F.linear(x, dequantize(blocks[i : i + step], fmt, x.dtype))
                      for i in range(0, blocks.shape[0], step)], dim=-1)


class QuantizedLinear(nn.Module):
    """nn.Linear's place for a QuantizedWeight (same names: weight, bias)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def in_features(self) -> int:
        return self.weight.cols

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.project(x, self.bias, kernels=False)


class QuantizedEmbedding(nn.Module):
    """nn.Embedding's place for a QuantizedWeight: a lookup dequantizes only the rows it reads."""

    def __init__(self, weight: QuantizedWeight):
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.take_rows(ids)


def _block_stores(module: nn.Module) -> list[nn.Module]:
    """The modules holding quantized blocks (QuantizedWeight, experts.QuantizedExperts), each once."""
    from .experts import QuantizedExperts

    return [m for m in module.modules() if isinstance(m, (QuantizedWeight, QuantizedExperts))]


def stored_bytes(module: nn.Module) -> int:
    """Bytes of a module's weights as stored: parameters plus quantized blocks (each counted once, tied
    ones too)."""
    quantized = sum(m.nbytes for m in _block_stores(module))
    return sum(p.numel() * p.element_size() for p in module.parameters()) + quantized


def stored_elements(module: nn.Module) -> int:
    """Weights a module computes with: parameters plus the quantized weights' elements."""
    quantized = sum(m.numel() for m in _block_stores(module))
    return sum(p.numel() for p in module.parameters()) + quantized


def dequantized_slice_bytes(module: nn.Module, item: int) -> int:
    """Peak bytes a prefill projection's dequantized slice takes (_dequantized_linear): the largest quantized
    weight's slice in float32 (dequantize computes there) and in the compute dtype of `item` bytes."""
    slices = [min(m.shape[0], max(1, SLICE_BYTES // (m.cols * item))) * m.cols * (4 + item)
              for m in module.modules() if isinstance(m, QuantizedWeight)]
    return max(slices, default=0)


def tensor_bytes(weight: torch.Tensor | nn.Module) -> int:
    """Bytes of a tensor, or of a module holding quantized blocks (its nbytes)."""
    return weight.numel() * weight.element_size() if isinstance(weight, torch.Tensor) else weight.nbytes


def quantize_modules(model: nn.Module, weights: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
    """Put QuantizedLinear / QuantizedEmbedding in the place of the nn.Linear / nn.Embedding whose weight
    names ('model.layers.0.self_attn.q_proj.weight') `weights` holds; a linear's bias stays to be loaded.
    One QuantizedWeight named twice (a tied LM head) is shared. An expert stack's gate_up_proj (a GateUp)
    and down_proj (ExpertBlocks) put a QuantizedExperts in the place of their layers.Experts. Returns the
    weights of other places (a router's), which the caller dequantizes."""
    from .experts import GateUp, QuantizedExperts

    others = {}
    for name, gate_up in list(weights.items()):
        if isinstance(gate_up, GateUp):
            owner = name.removesuffix(".gate_up_proj")
            parent, _, attr = owner.rpartition(".")
            down, dense = weights.pop(f"{owner}.down_proj"), model.get_submodule(owner)  # the layers.Experts
            setattr(model.get_submodule(parent), attr,
                    QuantizedExperts(gate_up, down, dense.down_proj.shape[1], dense.down_proj.dtype))
            del weights[name]
    for name, weight in weights.items():
        owner, _, attr = name.removesuffix(".weight").rpartition(".")
        parent = model.get_submodule(owner) if owner else model
        module = getattr(parent, attr) if name.endswith(".weight") else None
        if isinstance(module, nn.Embedding):
            setattr(parent, attr, QuantizedEmbedding(weight))
        elif isinstance(module, nn.Linear):
            bias = module.bias
            setattr(parent, attr, QuantizedLinear(weight))
            if bias is not None:  # loaded with the other float tensors (on the meta device until then)
                getattr(parent, attr).bias = bias
        else:
            others[name] = weight
    return others
