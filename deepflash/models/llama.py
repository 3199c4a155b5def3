"""Llama-family decoder (Llama / SmolLM2, Qwen3 dense, Qwen3-MoE) with explicit positions.

Parameter names equal the transformers checkpoint names, so a state dict loads without renaming.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.config import KernelConfig
from .base import TargetModel
from .config import ModelConfig
from .kv_budget import KVBudget
from .kv_cache import KVCache
from .layers import (DECODE, MLP, Pending, RMSNorm, Rotary, SparseMoe, apply_rotary, attention, fuse_linears,
                     fused_norm, linear_rows, norm_linear, read_by_torch_gemm)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # set by fuse_projections

    def fuse_projections(self, transposed=read_by_torch_gemm) -> None:
        """q, k and v as one GEMM (layers.fuse_linears); done when the model is built."""
        self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj, transposed=transposed)

    def kernel_forward(self, qkv, cos, sin, positions, cache: KVCache, layer: int, kv_len: int, mask,
                       kernels: KernelConfig):
        """The Triton form from the fused q/k/v projection's output (DecoderLayer.fused_forward projects
        inside its norm's kernel): q/k norm, rope and the cache write as one kernel (kernels/rope.py),
        then attention and o_proj."""
        from ..kernels.attention import decode_attention  # imports Triton: only where it is used
        from ..kernels.rope import rope_and_write

        b, t, _ = qkv.shape
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else (None, None, 0.0)
        q = rope_and_write(qkv, cos, sin, positions, cache.k[layer], cache.v[layer], self.heads, self.kv_heads,
                           *norms, tokens=kernels.rope_tokens)
        cache.note_query(layer, q)
        # decode and verify steps (LlamaModel.attention_mask): one kernel for both, so that a verified
        # token is computed exactly as a decoded one
        if mask is DECODE:
            out = decode_attention(q, cache.k[layer], cache.v[layer], positions, kv_len)
        else:
            keys, values = cache.read(layer, kv_len)
            out = attention(q, keys, values, mask)
        return linear_rows(out.transpose(1, 2).reshape(b, t, -1), self.o_proj.weight, self.o_proj.bias, kernels)

    def forward(self, x, cos, sin, positions, cache: KVCache, layer: int, kv_len: int, mask):
        b, t, _ = x.shape
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        qk, v = linear_rows(x, *self.qkv, None).split([(heads + kv_heads) * dim, kv_heads * dim], dim=-1)
        qk = qk.view(b, t, heads + kv_heads, dim)
        v = v.view(b, t, kv_heads, dim)
        if self.qk_norm:
            q, k = qk.split([heads, kv_heads], dim=2)
            q, k = apply_rotary(self.q_norm(q), cos, sin), apply_rotary(self.k_norm(k), cos, sin)
        else:  # q and k side by side in the fused output: one rope pass (3 kernels) for both
            q, k = apply_rotary(qk, cos, sin).split([heads, kv_heads], dim=2)
        cache.write(layer, positions, k.transpose(1, 2), v.transpose(1, 2))
        cache.note_query(layer, q.transpose(1, 2))
        keys, values = cache.read(layer, kv_len)
        out = attention(q.transpose(1, 2), keys, values, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg)
        if cfg.is_moe_layer(layer):
            self.mlp = SparseMoe(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                 cfg.num_experts_per_tok, cfg.norm_topk_prob)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.kernels: KernelConfig | None = None  # Triton's with this tuning, else torch's (use_kernels)

    def forward(self, x, cos, sin, positions, cache, layer, kv_len, mask):
        if self.kernels is not None:
            return self.fused_forward(x, cos, sin, positions, cache, layer, kv_len, mask)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, cache, layer, kv_len, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def fused_forward(self, x, cos, sin, positions, cache, layer, kv_len, mask):
        """The Triton form: each residual add and norm runs inside the projection after it (layers.
        norm_linear: for a decode step's few rows one kernel each with the q/k/v and gate/up GEMVs,
        kernels/gemv.py), silu(gate) * up inside the down projection, and the layer hands its MLP output
        on unadded (layers.Pending) for the next layer's input norm, or the final norm, to add. x is such
        a Pending output or the embeddings (layer 0)."""
        tiling = self.kernels.projections
        x, qkv = norm_linear(self.input_layernorm, x, *self.self_attn.qkv, tiling=tiling)
        attn = self.self_attn.kernel_forward(qkv, cos, sin, positions, cache, layer, kv_len, mask, self.kernels)
        if isinstance(self.mlp, SparseMoe):
            x, h = fused_norm(self.post_attention_layernorm, Pending(x, attn))
            return Pending(x, self.mlp(h))
        x, gate_up = norm_linear(self.post_attention_layernorm, Pending(x, attn), *self.mlp.gate_up, tiling=tiling)
        return Pending(x, self.mlp.down(gate_up, tiling))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaModel(TargetModel):
    """forward(tokens [B,T], positions [T], cache, kv_len) -> (logits, features)."""

    # on an H200, decode 1.2x (Qwen3-8B shape) to 2.0x (SmolLM2, end to end) faster than on torch's
    # kernels, and the same greedy output from plain and speculative decoding
    auto_kernels = "triton"

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rotary = Rotary(cfg.rope, cfg.head_dim)

    def new_cache(self, batch: int, max_len: int, kv_budget: KVBudget | None = None) -> KVCache:
        return self.attention_cache(self.cfg.num_layers, batch, max_len, kv_budget)

    def forward(self, tokens, positions, cache, kv_len=None, *, capture=(), logits="all", key_mask=None,
                on_features=None):
        """capture: target layer ids whose residual outputs are returned concatenated (HF hidden_states[i+1]);
        on_features: called with them as soon as they exist (run_layers). logits: "all", "last" or "none".
        key_mask [B, S]: False on left-padding slots of batched prompts."""
        x = self.embed(tokens)
        cos, sin = self.rotary(positions, x.dtype)
        kv_len = int(positions.max()) + 1 if kv_len is None else kv_len
        # rope above takes the positions; the cache writes and attention take their slots (kv_cache.slots)
        slots, span = cache.slots(positions, kv_len)
        mask = self.attention_mask(slots, span, key_mask, x.dtype)
        return self.run_layers(x, lambda i, layer, h: layer(h, cos, sin, slots, cache, i, span, mask),
                               capture, logits, on_features)
