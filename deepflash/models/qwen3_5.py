"""Qwen3.5 / Qwen3.6 (transformers `qwen3_5`, `qwen3_5_moe` and their `_text` models): a hybrid decoder.

`layer_types` mixes Gated DeltaNet layers (linear_attention, gated_deltanet.py) with gated full attention
(full_attention: q/k RMSNorm, partial rotary, output gated by sigmoid of a second half of q_proj). The
feed-forward is a SwiGLU MLP (dense) or routed experts plus a gated shared expert (MoE). Every RMSNorm but
the DeltaNet's gated one scales by (1 + weight), so their stored weights are offsets from 1.

Parameter names equal the transformers text-model names; checkpoints of the multimodal wrapper
(`model.language_model.*`, `model.visual.*`, `mtp.*`) are mapped by `prepare_state_dict`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import UserError
from ..kernels.config import KernelConfig
from ..quant.weight import QuantizedWeight
from .base import TargetModel
from .config import ModelConfig
from .gated_deltanet import DeltaNetShape, GatedDeltaNet
from .hybrid_cache import ROLLBACK_MODES, HybridCache
from .kv_budget import KVBudget
from .kv_cache import KVCache
from .layers import (DECODE, MLP, Pending, Rotary, SparseMoe, apply_rotary, attention, fuse_linears, fused_norm,
                     linear_rows, norm_linear, read_by_torch_gemm)

LAYER_TYPES = ("linear_attention", "full_attention")


def layer_types(cfg: ModelConfig) -> tuple[str, ...]:
    """From the config, else transformers' default: every `full_attention_interval`-th layer is full."""
    raw = cfg.raw
    interval = int(raw.get("full_attention_interval", 4))
    default = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(cfg.num_layers)]
    types = tuple(raw.get("layer_types") or default)
    if len(types) != cfg.num_layers or set(types) - set(LAYER_TYPES):
        raise UserError(f"layer_types {list(types)} must list {cfg.num_layers} of {', '.join(LAYER_TYPES)}")
    return types


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight), cast back after scaling (transformers' Qwen3.5 order)."""

    offset = True  # read by layers.fused_norm

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.kernels: KernelConfig | None = None  # Triton's row-invariant norm, else torch's (use_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            from ..kernels import layer_ops  # imports Triton: only where it is used

            if x.dtype in layer_ops.NORM_DTYPES:  # one program per row: a verify step's rows as decode's
                return layer_ops.row_norm(x, layer_ops.OFFSET_RMS, self.eps, self.weight)
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


@dataclass
class Step:
    """What every layer of one forward shares."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor  # the slots of the forward's positions in the attention cache (KVCache.slots)
    cache: HybridCache
    kv_len: int  # the slots attention spans
    mask: torch.Tensor | str  # folded mask, layers.CAUSAL or layers.DECODE (Qwen35Model.attention_mask)
    live: torch.Tensor | None  # [B, T], False on left padding


class GatedAttention(nn.Module):
    """q_proj yields per head [query | gate]; the attention output is multiplied by sigmoid(gate)."""

    def __init__(self, cfg: ModelConfig, slot: int):
        super().__init__()
        self.slot = slot  # this layer's index among the model's attention layers (its KV slot)
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, 2 * self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # set by fuse_projections
        self.kernels: KernelConfig | None = None  # Triton's for decode and verify steps, else torch's (use_kernels)

    def fuse_projections(self, transposed=read_by_torch_gemm) -> None:
        """q, k and v as one GEMM (layers.fuse_linears); done when the model is built."""
        self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj, transposed=transposed)

    def forward(self, x, step: Step) -> torch.Tensor:
        if self.kernels is not None and self.qkv is not None:
            from ..kernels.layer_ops import NORM_DTYPES  # imports Triton: only where it is used

            if x.dtype in NORM_DTYPES:
                return self._kernel_forward(x, step)
        b, t, _ = x.shape
        q, gate = self._project(self.q_proj, x).view(b, t, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_rotary(self.q_norm(q), step.cos, step.sin)
        k = self._project(self.k_proj, x).view(b, t, self.kv_heads, self.head_dim)
        k = apply_rotary(self.k_norm(k), step.cos, step.sin)
        v = self._project(self.v_proj, x).view(b, t, self.kv_heads, self.head_dim)
        kv = step.cache.kv
        kv.write(self.slot, step.positions, k.transpose(1, 2), v.transpose(1, 2))
        kv.note_query(self.slot, q.transpose(1, 2))
        out = self._attend(q.transpose(1, 2), kv, step).transpose(1, 2).reshape(b, t, -1)
        return self._project(self.o_proj, out * torch.sigmoid(gate.reshape(b, t, -1)))

    def _kernel_forward(self, x, step: Step) -> torch.Tensor:
        """The Triton form: the fused q/k/v projection, then q/k norms, partial rope and the cache write in one
        kernel (kernels/rope.py), and for decode and verify steps the output gate inside attention's last
        kernel (kernels/attention.py)."""
        return self.attend_projected(linear_rows(x, *self.qkv, self.kernels), step)

    def attend_projected(self, qkv: torch.Tensor, step: Step) -> torch.Tensor:
        """_kernel_forward from the fused q/k/v projection's output [B, T, (2 H + 2 Hkv) D]."""
        from ..kernels.attention import decode_attention  # imports Triton: only where it is used
        from ..kernels.rope import rope_and_write

        b, t, _ = qkv.shape
        kv, dim = step.cache.kv, self.head_dim
        q = rope_and_write(qkv, step.cos, step.sin, step.positions, kv.k[self.slot], kv.v[self.slot], self.heads,
                           self.kv_heads, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                           self.kernels.rope_tokens, gated=True, offset=True)
        kv.note_query(self.slot, q)
        gate = qkv[..., : 2 * self.heads * dim].view(b, t, self.heads, 2 * dim)[..., dim:]
        if step.mask is DECODE:
            out = decode_attention(q, kv.k[self.slot], kv.v[self.slot], step.positions, step.kv_len, gate)
            return self._project(self.o_proj, out.transpose(1, 2).reshape(b, t, -1))
        keys, values = kv.read(self.slot, step.kv_len)
        out = attention(q, keys, values, step.mask).transpose(1, 2)
        return self._project(self.o_proj, (out * torch.sigmoid(gate)).reshape(b, t, -1))

    def _attend(self, q: torch.Tensor, kv: KVCache, step: Step) -> torch.Tensor:
        """Attention of q [B, H, T, D] over this layer's cache. Decode and verify steps on the kernels
        (step.mask DECODE) take kernels/attention.py, which computes a verified token exactly as a decoded
        one, where SDPA's kernels differ between 1 and 16 queries; else SDPA."""
        if step.mask is DECODE:
            from ..kernels.attention import decode_attention  # imports Triton: only where it is used

            return decode_attention(q, kv.k[self.slot], kv.v[self.slot], step.positions, step.kv_len)
        keys, values = kv.read(self.slot, step.kv_len)
        return attention(q, keys, values, step.mask)

    def _project(self, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """proj(x), on kernels/gemv.py for a step's few rows when the kernels are on (layers.linear_rows)."""
        return linear_rows(x, proj.weight, proj.bias, self.kernels)


class SharedExpertMoe(SparseMoe):
    """Routed experts (top-k softmax, always renormalised) plus a shared expert scaled by sigmoid(gate)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                         normalize=True)
        self.shared_expert = MLP(cfg.hidden_size, int(cfg.raw["shared_expert_intermediate_size"]))
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        # set by fuse_projections: the projections of the block's input as one weight, or None
        self.inputs: tuple[torch.Tensor, None] | None = None

    def fuse_projections(self, transposed=read_by_torch_gemm) -> None:
        """The shared expert's gate and up, the router and the shared expert's gate as one GEMM (layers.
        fuse_linears; its shared expert's own fusion then keeps a view of the gate/up rows): a MoE decode step
        is bound by its launches. Only where all four are plain weights of one dtype (a GGUF file's router and
        experts differ in kind), and never stored transposed, so that the gate/up rows stay a view."""
        mlp = self.shared_expert
        members = (mlp.gate_proj, mlp.up_proj, self.gate, self.shared_expert_gate)
        weights = [m.weight for m in members]
        if any(isinstance(w, QuantizedWeight) for w in weights) or len({w.dtype for w in weights}) > 1:
            self.inputs = None
            return
        self.inputs = fuse_linears(*members, transposed=lambda weight: False)

    def int8_buffers(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """Where the norm before the block writes its output's int8 form for the shared expert's quantized input
        projections (QuantizedWeight.int8_buffers), which then share it; None where they take none."""
        weight = self.shared_expert.gate_up[0] if self.shared_expert.gate_up else None
        if self.inputs is not None or not isinstance(weight, QuantizedWeight):
            return None
        return weight.int8_buffers(x)

    def forward(self, x: torch.Tensor, rows8: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """The routed experts add the shared expert's part (Experts.forward: on the kernels, in their last one).
        rows8: x's int8 form (int8_buffers), written already."""
        flat = x.reshape(-1, x.shape[-1])
        if self.inputs is None:
            experts, weights = self._route(flat)
            gate = self.shared_expert_gate
            logits = linear_rows(flat, gate.weight, gate.bias, self.kernels, rows8)
            shared = self.shared_expert(flat, rows8)
        else:
            inner, count = self.shared_expert.down_proj.weight.shape[1], self.gate.weight.shape[0]
            gate_up, router_logits, logits = linear_rows(flat, *self.inputs, self.kernels).split(
                [2 * inner, count, 1], dim=-1)
            experts, weights = self.gate.choose(router_logits, flat.dtype, self.kernels)
            shared = self.shared_expert.activated_down(gate_up)
        return self.experts(flat, experts, weights, (shared, logits)).reshape(x.shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str, slot: int):
        super().__init__()
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, DeltaNetShape.from_config(cfg), slot)
        else:
            self.self_attn = GatedAttention(cfg, slot)
        self.mlp = SharedExpertMoe(cfg) if cfg.num_experts else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.kernels: KernelConfig | None = None  # Triton's for decode and verify steps, else torch's (use_kernels)

    def forward(self, x: torch.Tensor | Pending, step: Step) -> torch.Tensor | Pending:
        if self.kernels is not None:
            from ..kernels.layer_ops import NORM_DTYPES  # imports Triton: only where it is used

            if self.input_layernorm.weight.dtype in NORM_DTYPES:
                return self._fused_forward(x, step)
        x = x + self._mix(self.input_layernorm(x), step)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _fused_forward(self, x: torch.Tensor | Pending, step: Step) -> Pending:
        """The Triton form: each residual add and norm runs inside the projection after it (layers.norm_linear: for a
        step's few rows one kernel with the GEMV, kernels/gemv.py), or in a kernel of its own before a MoE block
        (layers.fused_norm), and the layer hands its MLP output on unadded (layers.Pending) for the next layer's
        input norm, or the final norm, to add. x is such a Pending output or the embeddings (layer 0)."""
        tiling = self.kernels.projections
        mixer = self.linear_attn if self.kind == "linear_attention" else self.self_attn
        weights = mixer.in_proj if self.kind == "linear_attention" else mixer.qkv
        if weights is None or step.live is not None:  # unfused, or padding to mask after the norm
            x, h = fused_norm(self.input_layernorm, x)
            mixed = self._mix(h, step)
        else:  # the norm inside the mixer's input projection (layers.norm_linear)
            x, projected = norm_linear(self.input_layernorm, x, *weights, tiling=tiling)
            if self.kind == "linear_attention":
                mixed = mixer.mix(mixer.split(projected), step.cache)
            else:
                mixed = mixer.attend_projected(projected, step)
        if isinstance(self.mlp, SharedExpertMoe):
            rows8 = self.mlp.int8_buffers(x)  # the norm's kernel quantizes its output for the shared expert
            x, h = fused_norm(self.post_attention_layernorm, Pending(x, mixed), rows8)
            return Pending(x, self.mlp(h, rows8))
        if self.mlp.gate_up is None:  # unfused
            x, h = fused_norm(self.post_attention_layernorm, Pending(x, mixed))
            return Pending(x, self.mlp(h))
        x, gate_up = norm_linear(self.post_attention_layernorm, Pending(x, mixed), *self.mlp.gate_up, tiling=tiling)
        return Pending(x, self.mlp.down(gate_up, tiling))

    def _mix(self, h: torch.Tensor, step: Step) -> torch.Tensor:
        """The token mixer's output: the DeltaNet's or attention's."""
        if self.kind == "linear_attention":
            return self.linear_attn(h, step.cache, step.live)
        return self.self_attn(h, step)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, types: tuple[str, ...]):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, kind, types[:i].count(kind)) for i, kind in enumerate(types))
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen35Model(TargetModel):
    """forward(tokens [B,T], positions [T], cache, kv_len) -> (logits, features), like LlamaModel."""

    norm_neutral = 0.0  # norm weights are offsets from 1 (read by init_random_)
    # on CUDA the Triton forms: a verify and its rollback then compute each token as a decode step does (on
    # torch's, bf16 greedy speculative output left plain decoding's at 27B width), and a Qwen3.5-27B-shaped
    # decode step takes 6.9 ms against 8.0 (16 layers, H100)
    auto_kernels = "triton"
    idempotent_positions = False  # the DeltaNet states absorb every token fed: prefill runs each once

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.types = layer_types(cfg)
        self.shape = DeltaNetShape.from_config(cfg)
        self.model = Backbone(cfg, self.types)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rotary = Rotary(cfg.rope, cfg.head_dim)

    @classmethod
    def prepare_state_dict(cls, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """Multimodal checkpoints: language model weights only (no vision tower, no multi-token-prediction head)."""
        out = {}
        for name, tensor in state.items():
            if name.startswith(("model.visual.", "mtp.")):
                continue
            out[name.replace("model.language_model.", "model.", 1)] = tensor
        return super().prepare_state_dict(out, cfg)

    def new_cache(self, batch: int, max_len: int, kv_budget: KVBudget | None = None, *, rollback: str = "capture",
                  rollback_tokens: int = 64) -> HybridCache:
        """rollback: how keep(n) restores the DeltaNet states, "capture" or "replay" (hybrid_cache.py);
        rollback_tokens: the longest forward that can be rolled back (at least the verify block)."""
        if rollback not in ROLLBACK_MODES:
            raise UserError(f"rollback must be one of {', '.join(ROLLBACK_MODES)}, got {rollback!r}")
        cfg, s = self.cfg, self.shape
        kv = self.attention_cache(self.attention_layer_count(), batch, max_len, kv_budget)
        return HybridCache(kv, self.linear_layer_count(), batch, s.conv_channels, s.conv_kernel - 1,
                           (s.value_heads, s.key_dim, s.value_dim), self.dtype, self.state_dtype, self.device,
                           rollback, rollback_tokens)

    def forward(self, tokens, positions, cache: HybridCache, kv_len=None, *, capture=(), logits="all",
                key_mask=None, on_features=None):
        """capture: layer ids whose residual outputs are returned concatenated (HF hidden_states[i+1]);
        on_features: called with them as soon as they exist (run_layers). logits: "all", "last" or "none".
        key_mask [B, S]: False on left-padding slots of batched prompts."""
        kv_len = int(positions.max()) + 1 if kv_len is None else kv_len
        def rerun(n: int) -> None:  # what the replay rollback runs: this forward's first n tokens again
            self(tokens[:, :n], positions[:n], cache, kv_len, logits="none", key_mask=key_mask)

        cache.begin(positions, rerun)
        x = self.embed(tokens)
        cos, sin = self.rotary(positions, x.dtype)
        live = None if key_mask is None else key_mask[:, positions]
        # rope above takes the positions; the cache writes and attention take their slots (kv_cache.slots)
        slots, span = cache.kv.slots(positions, kv_len)
        mask = self.attention_mask(slots, span, key_mask, x.dtype)
        step = Step(cos, sin, slots, cache, span, mask, live)
        return self.run_layers(x, lambda i, layer, h: layer(h, step), capture, logits, on_features)

    # --- cost accounting -------------------------------------------------------------------------------
    @property
    def state_dtype(self) -> torch.dtype:
        """Recurrent states are kept in float32 (float64 for float64 models), as the kernels compute."""
        return torch.promote_types(self.dtype, torch.float32)

    def attention_layer_count(self) -> int:
        return self.types.count("full_attention")

    def linear_layer_count(self) -> int:
        return self.types.count("linear_attention")

    def state_bytes(self, batch: int = 1) -> int:
        """Conv and recurrent states of the DeltaNet layers, twice: the cache keeps a copy from the start
        of the last verify for rollback."""
        s = self.shape
        conv = s.conv_channels * (s.conv_kernel - 1) * self.dtype.itemsize
        recurrent = s.value_heads * s.key_dim * s.value_dim * self.state_dtype.itemsize
        return 2 * self.linear_layer_count() * batch * (conv + recurrent)
