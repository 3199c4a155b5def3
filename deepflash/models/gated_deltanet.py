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
from .config import ModelConfig
from .delta_rule import chunked_form, fla_available, fla_form, recurrent_form, state_after_prefix
from .layers import linear_rows

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

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            from ..kernels import layer_ops  # imports Triton: only where it is used

            if x.dtype in layer_ops.NORM_DTYPES:  # one program per row: a verify step's rows as decode's
                return layer_ops.row_norm(x, layer_ops.GATED_RMS, self.eps, self.weight, gate)
        dtype = x.dtype
        x = x.float()
        x = self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (x * F.silu(gate.float())).to(dtype)


def depthwise_conv(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv of window [B, C, K-1+T] with weight [C, 1, K] -> [B, C, T]. A K-tap product
    and sum: F.conv1d's depthwise path is orders of magnitude slower on CPU and no faster on GPU."""
    taps = window.unfold(-1, weight.shape[-1], 1)  # [B, C, T, K]
    return (taps * weight[:, None, 0, :]).sum(-1)


L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def l2_normalize_rows(x: torch.Tensor) -> torch.Tensor:
    """l2_normalize by Triton's row norm (kernels/layer_ops.py): each row summed in one program, so a verify
    step's tokens are normalised bit for bit as decode steps' are, where torch's sum is not."""
    from ..kernels import layer_ops  # imports Triton: only where it is used

    return layer_ops.row_norm(x, layer_ops.L2, L2_EPS)


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
        self.kernels: KernelConfig | None = None  # Triton's for decode and verify steps, else torch's (use_kernels)

    def forward(self, x: torch.Tensor, cache, live: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, H]; live [B, T] is False on left padding, whose zero inputs leave the state at zero."""
        b, t, _ = x.shape
        s = self.shape
        if live is not None:
            x = torch.where(live[..., None], x, 0)  # where, not a product: padding rows may hold NaN
        conv = cache.conv[self.slot]
        if t == 1:  # a sequence's first token starts from an empty conv (the cache resets longer runs)
            conv = conv.masked_fill(cache.fresh, 0)
        # the conv window: the cached last K-1 inputs, then this run's inputs
        window = torch.cat([conv, self._project(self.in_proj_qkv, x).transpose(1, 2)], dim=-1)
        mixed = F.silu(depthwise_conv(window, self.conv1d.weight)).transpose(1, 2)
        q, k, v = mixed.split([s.key_width, s.key_width, s.value_width], dim=-1)
        repeat = s.value_heads // s.key_heads  # each q/k head serves `repeat` consecutive value heads
        q = q.reshape(b, t, s.key_heads, s.key_dim).repeat_interleave(repeat, dim=2)
        k = k.reshape(b, t, s.key_heads, s.key_dim).repeat_interleave(repeat, dim=2)
        v = v.reshape(b, t, s.value_heads, s.value_dim)
        compute = cache.state[self.slot].dtype
        beta = self._project(self.in_proj_b, x).sigmoid()
        a = self._project(self.in_proj_a, x)
        g = -self.A_log.to(compute).exp() * F.softplus(a.to(compute) + self.dt_bias.to(compute))
        if t == 1:  # and forgets the old state: decay exp(-inf) = 0 (the recurrent forms multiply by it)
            g = g.masked_fill(cache.fresh, float("-inf"))
        out = self._delta_rule(q, k, v, g, beta, window, cache).to(x.dtype)
        out = self.norm(out, self._project(self.in_proj_z, x).view(b, t, s.value_heads, s.value_dim))
        return self._project(self.out_proj, out.reshape(b, t, -1))

    def _project(self, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """proj(x), on kernels/gemv.py for a step's few rows when the kernels are on (layers.linear_rows)."""
        return linear_rows(x, proj.weight, proj.bias, self.kernels)

    def _delta_rule(self, q, k, v, g, beta, window, cache) -> torch.Tensor:
        """[B, T, Hv, D] in, [B, T, Hv, Dv] out; stores the new conv window and state in the cache, and while
        the cache captures, how to get the state after a prefix of this run (hybrid_cache.py).
        With the kernels on, decode and verify steps take kernels/delta_rule.py, so that a verify computes
        each token as decode does, and a rollback replays the kept tokens with the same kernel. Otherwise a
        run the cache captures takes the torch forms, whose deltas give the prefix states in closed form
        (fla's kernels return none)."""
        start, tokens = cache.state[self.slot], q.shape[1]
        kernel = self._step_kernel(start, tokens)
        if kernel is None and fla_available(q.device) and not cache.capturing:
            q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
            out, state = fla_form(q, k, v, g, beta, start, recurrent=tokens <= FLA_RECURRENT_TOKENS)
            cache.update(self.slot, window, state)
            return out
        q, k, v, g, beta = (x.transpose(1, 2).to(start.dtype) for x in (q, k, v, g, beta))
        # on the kernels, a step's q/k rows are normalised as decode steps' are
        normalize = l2_normalize_rows if kernel is not None else l2_normalize
        q = normalize(q) / q.shape[-1] ** 0.5
        k = normalize(k)
        if kernel is not None:
            out, state = kernel.recurrent(q, k, v, g, beta, start)
            prefix_state = functools.partial(kernel.state_after, k, v, g, beta)  # the same kernel, replayed
        else:
            out, state, deltas = (recurrent_form if tokens == 1 else chunked_form)(q, k, v, g, beta, start)
            prefix_state = functools.partial(state_after_prefix, k, g, deltas)  # in closed form
        cache.update(self.slot, window, state, prefix_state if cache.capturing else None)
        return out.transpose(1, 2)

    def _step_kernel(self, start: torch.Tensor, tokens: int):
        """kernels/delta_rule.py where the kernels are on and this run fits it, else None."""
        if self.kernels is None:
            return None
        from ..kernels import delta_rule  # imports Triton: only where it is used

        return delta_rule if delta_rule.fits(start, tokens) else None
