"""The DFlash drafter (REFERENCE 1) and its per-layer context K/V cache.

The drafter has no embedding or LM head of its own: a block [last token, MASK x (B-1)] is embedded with
the target's table, runs through a few Qwen3-style layers whose attention also sees the fused target
features ("context") as extra keys/values, and is projected with the target's lm_head. Output k of the
block proposes the token at position start + k (same-position, not shifted); drafts are argmaxes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.config import SHIPPED
from ..models.layers import (MLP, FusedProjections, Pending, RMSNorm, Rotary, apply_rotary, attention, embedding_rows,
                             final_norm, fuse_linears, linear_rows, norm_linear, read_by_torch_gemm)
from .config import DrafterConfig


@dataclass
class RingBlock:
    """A draft's layer on the target's Triton kernels (DrafterLayer.ring_forward), its attention on the
    decode-attention kernel (kernels/attention.py), which splits the keys over many programs: SDPA
    gave each kv head's 48 folded block queries one program over the whole context (~130 us per layer at
    5.8K tokens on an H200). The block's K/V go into the context ring at their
    positions' slots (spare ones: DrafterContext's slack; the verify's append overwrites them), and every
    block query sees slots 0..the block's last position. Only where position p sits in slot p and the
    window holds every position below the span, for bidirectional full-attention layers
    (DrafterContext.masks decides)."""
    k_ring: torch.Tensor  # [1, Hkv, cap, D]: the layer's whole ring (the kernels read it by stride)
    v_ring: torch.Tensor
    slots: torch.Tensor  # the block's positions
    last: torch.Tensor  # [T]: the block's last position, for each query
    span: int  # slots the kernel considers


def attend(q, ctx_k, ctx_v, k, v, mask):
    """Block queries q [b, H, T, D] over keys [context, block]: with an explicit mask already folded for
    SDPA (fold_mask, as DrafterContext.masks gives them), or a mask that attends itself (`mask.attend`
    with the same arguments: training's packed-block masks, train/chunks.py and train/flex.py). (A
    RingBlock layer attends in DrafterAttention.ring_forward.)"""
    if isinstance(mask, torch.Tensor):
        keys, values = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
        return attention(q, keys, values, mask)
    return mask.attend(q, ctx_k, ctx_v, k, v)


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # set by fuse_projections

    def fuse_projections(self, transposed=read_by_torch_gemm) -> None:
        """q, k and v as one GEMM (fuse_linears), the context rows' k and v as one: inference only,
        drafters in training stay unfused."""
        self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj, transposed=transposed)

    def keys_values(self, x, cos, sin):
        """K (k_norm, rope at its own positions) and V of rows x [b, n, H] -> [b, Hkv, n, D] each."""
        if self.qkv is None:
            return self._keys_values(self.k_proj(x), self.v_proj(x), cos, sin)
        return self._keys_values(*F.linear(x, self._kv_weight()).chunk(2, dim=-1), cos, sin)

    def write_ring(self, x, cos, sin, slots, k_ring, v_ring) -> None:
        """keys_values of rows x [1, n, H] written to ring slots [n] on the Triton kernel: k_norm, rope and
        both writes as one rope_and_write with no query heads, where torch's form ran ~7 kernels."""
        from ..kernels.rope import rope_and_write

        rope_and_write(F.linear(x, self._kv_weight()), cos, sin, slots, k_ring, v_ring, 0, self.kv_heads,
                       self.k_norm.weight, self.k_norm.weight, self.k_norm.eps)

    def _kv_weight(self) -> torch.Tensor:
        return self.qkv[0][self.heads * self.head_dim :]  # rows of k, then v: one slice, no copy

    def _keys_values(self, k, v, cos, sin):
        b, n, _ = k.shape
        k = apply_rotary(self.k_norm(k.view(b, n, self.kv_heads, self.head_dim)), cos, sin)
        return k.transpose(1, 2), v.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """Queries from the block only; keys/values = [context, block] (KV injection)."""
        b, t, _ = x.shape
        if self.qkv is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            kv_rows = self.kv_heads * self.head_dim
            q, k, v = F.linear(x, self.qkv[0]).split([self.heads * self.head_dim, kv_rows, kv_rows], dim=-1)
        q = apply_rotary(self.q_norm(q.view(b, t, self.heads, self.head_dim)), cos, sin)
        k, v = self._keys_values(k, v, cos, sin)
        out = attend(q.transpose(1, 2), ctx_k, ctx_v, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def ring_forward(self, qkv, cos, sin, ring: RingBlock):
        """forward on the Triton kernels from the fused q/k/v projection's output (DrafterLayer.
        ring_forward projects inside its norm's kernel): q/k norms, rope and the block's K/V write into
        the ring as one kernel (kernels/rope.py, where torch ran ~12 per layer), then the decode
        attention over slots 0..the block's last position. Fused projections only (load_drafter's form)."""
        from ..kernels.attention import decode_attention
        from ..kernels.rope import rope_and_write

        b, t, _ = qkv.shape
        q = rope_and_write(qkv, cos, sin, ring.slots, ring.k_ring, ring.v_ring, self.heads,
                           self.kv_heads, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        out = decode_attention(q, ring.k_ring, ring.v_ring, ring.last, ring.span)
        return linear_rows(out.transpose(1, 2).reshape(b, t, -1), self.o_proj.weight, self.o_proj.bias, SHIPPED)


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = DrafterAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """x: the block's hidden rows, or a RingBlock layer's Pending output."""
        if isinstance(mask, RingBlock):
            return self.ring_forward(x, cos, sin, mask)
        if isinstance(x, Pending):
            x = x.residual + x.delta
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def ring_forward(self, x, cos, sin, ring: RingBlock):
        """On the target's Triton kernels, in llama.DecoderLayer.fused_forward's form: each residual add
        and norm inside the projection after it, silu(gate) * up inside the down projection; hands on a
        Pending output."""
        x, qkv = norm_linear(self.input_layernorm, x, *self.self_attn.qkv)
        attn = self.self_attn.ring_forward(qkv, cos, sin, ring)
        x, gate_up = norm_linear(self.post_attention_layernorm, Pending(x, attn), *self.mlp.gate_up)
        return Pending(x, self.mlp.down(gate_up))


class DFlashDrafter(FusedProjections):
    """Parameter names are the z-lab checkpoint names (no `model.` prefix, no embed / lm_head). Loaded for
    inference its projections are fused (load_drafter); trained, they are not."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        n_taps = len(cfg.target_layer_ids)
        self.fc = nn.Linear(n_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.rope, cfg.head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated tap-layer features [..., n_taps * H] -> context rows [..., H], shared by all layers."""
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context K/V of fused rows ctx [b, n, H] at absolute positions [n]."""
        cos, sin = self.rotary(positions, ctx.dtype)
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def forward(self, x, positions, ctx_kv, masks) -> torch.Tensor:
        """x [b, T, H] block embeddings at positions [T]; ctx_kv and masks per layer. Returns normed hidden."""
        cos, sin = self.rotary(positions, x.dtype)
        for layer, (k, v), mask in zip(self.layers, ctx_kv, masks):
            x = layer(x, cos, sin, k, v, mask)
        return final_norm(self.norm, x)

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        logits = lm_head(hidden.to(lm_head.weight.dtype))
        if self.cfg.output_multiplier != 1.0:
            logits = logits * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def block_embeddings(self, embed: nn.Module, block: torch.Tensor) -> torch.Tensor:
        x = embedding_rows(embed, block).to(self.dtype)
        scale = self.cfg.input_embedding_scale
        return x * scale if scale != 1.0 else x

    # --- cost accounting -------------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def context_kv_bytes_per_token(self) -> int:
        cfg = self.cfg
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize


