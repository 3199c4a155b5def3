"""Gated DeltaNet, the linear-attention layer of Qwen3.5 / Qwen3.6 (transformers names, `linear_attn.*`).

in_proj_qkv -> short causal depthwise conv (its state: the last K-1 inputs) -> SiLU -> q, k, v; the gated
delta rule (delta_rule.py) over a recurrent state per value head; an RMSNorm gated by SiLU(z); out_proj.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.config import KernelConfig
from ..quant.weight import QuantizedWeight
from .config import ModelConfig
from .delta_rule import chunked_form, fla_available, fla_form, recurrent_form, state_after_prefix
from .layers import fuse_linears, linear_rows, read_by_torch_gemm

# fla's fused recurrent kernel (token by token in one launch) takes runs of at most this many tokens
# (decode, verify blocks), its chunked kernel longer ones (prefill). The torch path loops token by token
# only for one token: its chunked form is a fixed ~30 kernels for any block, fewer than 16 loop steps
# (deepflash.bench.hybrid on an H200, a graphed verify of 16 tokens: 5.1 ms chunked, 7.3 ms looped).
FLA_RECURRENT_TOKENS = 16


@dataclass(frozen=True)
class DeltaNetShape:
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> DeltaNetShape:
        raw = cfg.raw
        return cls(
            key_heads=int(raw.get("linear_num_key_heads", 16)),
            value_heads=int(raw.get("linear_num_value_heads", 32)),
            key_dim=int(raw.get("linear_key_head_dim", 128)),
            value_dim=int(raw.get("linear_value_head_dim", 128)),
            conv_kernel=int(raw.get("linear_conv_kernel_dim", 4)),
        )

    @property
    def key_width(self) -> int:
        return self.key_heads * self.key_dim

    @property
    def value_width(self) -> int:
        return self.value_heads * self.value_dim

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_width + self.value_width


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * weight * SiLU(gate), normalised in float32 like transformers."""

    norm_neutral = 1.0  # a plain scale, unlike the model's offset norms (read by init_random_)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels: KernelConfig | None = None  # Triton's row-invariant norm, else torch's (use_kernels)

    def forward(self, x: torch.Tensor, gate: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
        """x, gate [..., heads, dim]; order [heads]: the output's head j is head order[j]'s (layer_ops.row_norm)."""
        if self.kernels is not None:
            from ..kernels import layer_ops  # imports Triton: only where it is used

            if x.dtype in layer_ops.NORM_DTYPES:  # one program per row: a verify step's rows as decode's
                return layer_ops.row_norm(x, layer_ops.GATED_RMS, self.eps, self.weight, gate, order)
        dtype = x.dtype
        x = x.float()
        x = self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        out = (x * F.silu(gate.float())).to(dtype)
        return out if order is None else out.index_select(-2, order)


def depthwise_conv(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv of window [B, C, K-1+T] with weight [C, 1, K] -> [B, C, T]. A K-tap product
    and sum: F.conv1d's depthwise path is orders of magnitude slower on CPU and no faster on GPU."""
    taps = window.unfold(-1, weight.shape[-1], 1)  # [B, C, T, K]
    return (taps * weight[:, None, 0, :]).sum(-1)


L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, shape: DeltaNetShape, slot: int):
        super().__init__()
        self.shape, self.slot = shape, slot  # slot: this layer's index among the model's DeltaNet layers
        hidden, channels = cfg.hidden_size, shape.conv_channels
        self.in_proj_qkv = nn.Linear(hidden, channels, bias=False)
        self.in_proj_z = nn.Linear(hidden, shape.value_width, bias=False)
        self.in_proj_b = nn.Linear(hidden, shape.value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, shape.value_heads, bias=False)
        self.conv1d = nn.Conv1d(channels, channels, shape.conv_kernel, groups=channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(shape.value_heads))
        self.A_log = nn.Parameter(torch.zeros(shape.value_heads))
        self.norm = GatedRMSNorm(shape.value_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(shape.value_width, hidden, bias=False)
        self.in_proj: tuple[torch.Tensor, torch.Tensor | None] | None = None  # set by fuse_projections
        self.out_order: torch.Tensor | None = None  # set by fuse_projections
        self.kernels: KernelConfig | None = None  # Triton's for decode and verify steps, else torch's (use_kernels)

    def fuse_projections(self, transposed=read_by_torch_gemm) -> None:
        """The four input projections as one GEMM (layers.fuse_linears; done when the model is built): a decode
        step's DeltaNet layer is bound by its kernel launches (kernels/delta_inputs.py). And where a GGUF file
        orders the output projection's input heads otherwise, that order for the norm to write them in."""
        self.in_proj = fuse_linears(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a,
                                    transposed=transposed)
        weight = self.out_proj.weight
        self.out_order = weight.head_order(self.shape.value_dim) if isinstance(weight, QuantizedWeight) else None

    def forward(self, x: torch.Tensor, cache, live: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, H]; live [B, T] is False on left padding, whose zero inputs leave the state at zero."""
        if live is not None:
            x = torch.where(live[..., None], x, 0)  # where, not a product: padding rows may hold NaN
        if self.in_proj is None:
            inputs = tuple(self._project(p, x) for p in (self.in_proj_qkv, self.in_proj_z, self.in_proj_b,
                                                         self.in_proj_a))
        else:
            inputs = self.split(linear_rows(x, *self.in_proj, self.kernels))
        return self.mix(inputs, cache)

    def split(self, projected: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(qkv, z, b, a): slices of the fused input projection's output (fuse_projections)."""
        s = self.shape
        return projected.split([s.conv_channels, s.value_width, s.value_heads, s.value_heads], dim=-1)

    def mix(self, inputs: tuple[torch.Tensor, ...], cache) -> torch.Tensor:
        """The layer's output from its input projections (qkv, z, b, a), each [B, T, width]."""
        qkv, z, beta, a = inputs
        b, t, _ = qkv.shape
        s = self.shape
        if self._on_kernels(cache.state[self.slot], t):
            out = self._kernel_step(qkv, beta, a, cache)
        else:
            out = self._torch_step(qkv, beta, a, cache).to(qkv.dtype)
        out = self.norm(out, z.view(b, t, s.value_heads, s.value_dim), self.out_order).reshape(b, t, -1)
        if self.out_order is not None:  # the norm wrote the heads in the file's order: no gather before the GEMV
            return self.out_proj.weight.project(out, self.out_proj.bias, self.kernels is not None, in_file_order=True)
        return self._project(self.out_proj, out)

    def _project(self, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """proj(x), on kernels/gemv.py for a step's few rows when the kernels are on (layers.linear_rows)."""
        return linear_rows(x, proj.weight, proj.bias, self.kernels)

    def _on_kernels(self, start: torch.Tensor, tokens: int) -> bool:
        """Whether this run takes the Triton kernels: they are on and it fits them (a decode or verify step)."""
        if self.kernels is None:
            return False
        from ..kernels import delta_rule  # imports Triton: only where it is used

        return delta_rule.fits(start, tokens)

    def _kernel_step(self, qkv: torch.Tensor, beta: torch.Tensor, a: torch.Tensor, cache) -> torch.Tensor:
        """A decode or verify step on the Triton kernels: the conv, norms and gates in one kernel
        (kernels/delta_inputs.py), which updates the conv state in place, then the delta rule
        (kernels/delta_rule.py), which updates the recurrent state in place; [B, T, Hv, Dv] in qkv's dtype.
        Each token is computed as a decode step computes it, and while the cache captures, the rollback
        replays the kept tokens with the same kernel (hybrid_cache.py)."""
        from ..kernels import delta_rule  # imports Triton: only where it is used
        from ..kernels.delta_inputs import delta_inputs

        s, slot = self.shape, self.slot
        conv, state = cache.conv[slot], cache.state[slot]
        batch, tokens = qkv.shape[:2]
        window = None
        if cache.capturing:
            window = torch.empty((batch, s.conv_channels, conv.shape[-1] + tokens), dtype=conv.dtype,
                                 device=conv.device)
        q, k, v, g, beta = delta_inputs(qkv, beta, a, conv, self.conv1d.weight, cache.fresh, self.A_log,
                                        self.dt_bias, (s.key_heads, s.value_heads), (s.key_dim, s.value_dim), window)
        out, _ = delta_rule.recurrent(q, k, v, g, beta, state, out_dtype=qkv.dtype, final=state)
        if window is not None:  # the replay of the kept tokens: the same kernel on these inputs
            cache.record(slot, window, functools.partial(delta_rule.state_after, k, v, g, beta))
        return out.transpose(1, 2)

    def _torch_step(self, qkv: torch.Tensor, beta: torch.Tensor, a: torch.Tensor, cache) -> torch.Tensor:
        """A run on torch's forms (fla's kernels where installed and the cache does not capture):
        [B, T, Hv, Dv] in the state's dtype; the cache takes the new states."""
        b, t, _ = qkv.shape
        s = self.shape
        conv = cache.conv[self.slot]
        if t == 1:  # a sequence's first token starts from an empty conv (the cache resets longer runs)
            conv = conv.masked_fill(cache.fresh, 0)
        # the conv window: the cached last K-1 inputs, then this run's inputs
        window = torch.cat([conv, qkv.transpose(1, 2)], dim=-1)
        mixed = F.silu(depthwise_conv(window, self.conv1d.weight)).transpose(1, 2)
        q, k, v = mixed.split([s.key_width, s.key_width, s.value_width], dim=-1)
        repeat = s.value_heads // s.key_heads  # each q/k head serves `repeat` consecutive value heads
        q = q.reshape(b, t, s.key_heads, s.key_dim).repeat_interleave(repeat, dim=2)
        k = k.reshape(b, t, s.key_heads, s.key_dim).repeat_interleave(repeat, dim=2)
        v = v.reshape(b, t, s.value_heads, s.value_dim)
        compute = cache.state[self.slot].dtype
        beta = beta.sigmoid()
        g = -self.A_log.to(compute).exp() * F.softplus(a.to(compute) + self.dt_bias.to(compute))
        if t == 1:  # and forgets the old state: decay exp(-inf) = 0 (the recurrent forms multiply by it)
            g = g.masked_fill(cache.fresh, float("-inf"))
        return self._delta_rule(q, k, v, g, beta, window, cache)

    def _delta_rule(self, q, k, v, g, beta, window, cache) -> torch.Tensor:
        """[B, T, Hv, D] in, [B, T, Hv, Dv] out; stores the new conv window and state in the cache. fla's
        kernels where they serve, except while the cache captures: then the torch forms, whose deltas give the
        state after any prefix of the run in closed form (fla's kernels return none)."""
        start, tokens = cache.state[self.slot], q.shape[1]
        if fla_available(q.device) and not cache.capturing:
            q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
            out, state = fla_form(q, k, v, g, beta, start, recurrent=tokens <= FLA_RECURRENT_TOKENS)
            cache.update(self.slot, window, state)
            return out
        q, k, v, g, beta = (x.transpose(1, 2).to(start.dtype) for x in (q, k, v, g, beta))
        q = l2_normalize(q) / q.shape[-1] ** 0.5
        k = l2_normalize(k)
        out, state, deltas = (recurrent_form if tokens == 1 else chunked_form)(q, k, v, g, beta, start)
        prefix_state = functools.partial(state_after_prefix, k, g, deltas)  # in closed form
        cache.update(self.slot, window, state, prefix_state if cache.capturing else None)
        return out.transpose(1, 2)
