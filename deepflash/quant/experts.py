"""A MoE layer's routed experts kept in their GGUF blocks (layers.Experts' place for a quantized file).

llama.cpp stores an expert stack's gate, up and down projections as three tensors [E, rows, row_bytes],
possibly of different formats (Q4_K_M keeps some layers' down in Q6_K). A decode or verify step's <= 16
tokens go through kernels/quant_moe.py, which reads each routed expert's blocks once and computes a token
the same whatever the step's other tokens; more tokens (prefill) dequantize a slice of experts at a time
and run them densely over the tokens, weighted by the routing (zero where a token does not route to an
expert): no host sync, whatever the routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.config import KernelConfig
from .gguf_blocks import BlockFormat, dequantize
from .weight import SLICE_BYTES, QuantizedWeight



@dataclass(frozen=True)
class ExpertBlocks:
    """One expert stack's tensor as the file stores it: uint8 [E, rows, row_bytes] of one format."""

    fmt: BlockFormat
    blocks: torch.Tensor

    def rows(self, start: int, stop: int) -> ExpertBlocks:
        """Rows [start, stop) of every expert (a fused gate/up tensor's halves)."""
        return ExpertBlocks(self.fmt, self.blocks[:, start:stop])


@dataclass(frozen=True)
class GateUp:
    """An expert stack's gate and up projections, as the file stores them (two tensors, or one split)."""

    gate: ExpertBlocks
    up: ExpertBlocks


class QuantizedExperts(nn.Module):
    """gate, up: uint8 [E, I, row_bytes(H)]; down: uint8 [E, H, row_bytes(I)], each of its own format."""

    def __init__(self, gate_up: GateUp, down: ExpertBlocks, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.formats = (gate_up.gate.fmt, gate_up.up.fmt, down.fmt)
        self.register_buffer("gate", gate_up.gate.blocks.contiguous())
        self.register_buffer("up", gate_up.up.blocks.contiguous())
        self.register_buffer("down", down.blocks)
        self.register_buffer("compute", torch.empty(0, dtype=dtype, device=down.blocks.device))  # dtype, device
        self.hidden, self.inner = hidden, self.gate.shape[1]
        self.kernels: KernelConfig | None = None  # set by use_kernels: the kernel on the CPU too (tests)

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes

    def numel(self) -> int:
        return 3 * self.num_experts * self.inner * self.hidden

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [N, H]; experts / weights [N, k]: each token's sum of its experts' outputs times their weights, plus
        sigmoid(logits) * output of `shared` (a shared expert's output and gate logits) where given (layers.
        Experts.forward)."""
        if x.is_cuda or self.kernels is not None:
            from ..kernels import quant_moe  # imports Triton: only where it is used

            if quant_moe.fits(x):
                types = tuple(f.ggml_type for f in self.formats)
                return quant_moe.routed_experts(x, experts, weights, self.gate, self.up, self.down, types, shared)
        return add_shared(self._sliced(x, experts, weights), shared)

    def _sliced(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every expert over every token a slice of experts at a time, an unrouted pair weighted 0 (layers.
        Experts._dense's form, whose shapes never depend on the routing)."""
        n, count = x.shape[0], self.num_experts
        routing = torch.zeros(n, count, dtype=x.dtype, device=x.device).scatter_(1, experts, weights.to(x.dtype))
        step = max(1, SLICE_BYTES // (3 * self.inner * self.hidden * x.element_size()))
        out = torch.zeros_like(x, dtype=torch.float32)
        for lo in range(0, count, step):
            hi = min(lo + step, count)
            gate, up, down = (dequantize(blocks[lo:hi], fmt, x.dtype) for fmt, blocks in
                              zip(self.formats, (self.gate, self.up, self.down)))
            g = F.linear(x, gate.flatten(0, 1)).view(n, hi - lo, -1)
            u = F.linear(x, up.flatten(0, 1)).view(n, hi - lo, -1)
            hidden = (F.silu(g) * u * routing[:, lo:hi, None]).transpose(0, 1)  # [S, N, I]
            out += torch.bmm(hidden, down.transpose(1, 2)).float().sum(0)
        return out.to(x.dtype)


def dequantized(value: torch.Tensor | QuantizedWeight | GateUp | ExpertBlocks, dtype: torch.dtype) -> torch.Tensor:
    """A quantized weight as a dense tensor in `dtype` (where no quantized layer takes it: a router's); an expert
    stack's gate and up joined along their rows, as layers.Experts stores them. A tensor comes back as it is."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, QuantizedWeight):
        return value.dequantize(dtype)
    if isinstance(value, GateUp):
        return torch.cat([dequantized(value.gate, dtype), dequantized(value.up, dtype)], dim=-2)
    return dequantize(value.blocks, value.fmt, dtype)


def add_shared(out: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """out + sigmoid(logits) * output of a shared expert (output, gate logits): the routed experts' torch forms'
    last step (layers.Experts, QuantizedExperts; their kernels add it in kernels/moe.py _settle)."""
    return out if shared is None else out + torch.sigmoid(shared[1]) * shared[0]
