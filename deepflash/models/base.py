"""What every target model shares: the output projection, feature taps and cost accounting."""

from __future__ import annotations

import torch

from ..errors import UserError
from ..kernels.config import SHIPPED, KernelConfig
from ..quant.weight import QuantizedLinear, QuantizedWeight, stored_bytes, stored_elements, tensor_bytes
from .config import ModelConfig
from .kv_budget import BudgetKVCache, KVBudget
from .kv_cache import KVCache
from .layers import DECODE, FusedProjections, embedding_rows, final_norm, forward_mask, tap

TARGET_KERNELS = ("auto", "torch", "triton")  # TargetModel.use_kernels


def _features(taps: dict, capture, on_features) -> torch.Tensor:
    features = torch.cat([taps[i] for i in capture], dim=-1)
    if on_features is not None:
        on_features(features)
    return features


class TargetModel(FusedProjections):
    """Subclasses define `model.embed_tokens`, `model.layers`, `lm_head`, `new_cache` and `forward`."""

    auto_kernels = "torch"  # what use_kernels("auto") picks on CUDA: a subclass's measured-faster set
    kernels: KernelConfig | None = None  # use_kernels sets it with its layers' (attention_mask)
    # a position's forward may run twice, rewriting its KV with the same values: the engine's prefill
    # may then cover a prompt with overlapping power-of-two pieces (graphs.prefill_pieces). Recurrent
    # layers would absorb the token twice.
    idempotent_positions = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg

    @classmethod
    def prepare_state_dict(cls, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """Checkpoint names -> our names. Tied checkpoints may omit lm_head; old ones carry rope buffers."""
        state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
        if cfg.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        return state

    def use_kernels(self, kind: str, config: KernelConfig = SHIPPED) -> TargetModel:
        """'auto' (on CUDA the target class's auto_kernels, else torch), 'torch' or 'triton': with
        'triton' the layers that have a Triton form use it, tuned by `config` (kernels/rope.py for q/k
        norm, rope and the cache write; kernels/attention.py for decode and verify steps' attention;
        kernels/gemv.py and kernels/layer_ops.py for the projections with the residual add + norm or
        SwiGLU's silu * up before them). Each such layer's `kernels` is then the config, else None."""
        if kind not in TARGET_KERNELS:
            raise UserError(f"target kernels must be one of {', '.join(TARGET_KERNELS)}, got {kind!r}")
        from ..kernels.triton_support import require, usable

        layers = [module for module in self.modules() if hasattr(module, "kernels")]
        if kind == "auto":
            kind = self.auto_kernels if usable(self.device) else "torch"
        if kind == "triton":
            require()
            if not layers:
                raise UserError(f"{type(self).__name__} has no Triton kernels; use target kernels 'torch'")
        for module in layers:
            module.kernels = config if kind == "triton" else None
        return self

    def attention_mask(self, positions, kv_len: int, key_mask, dtype: torch.dtype) -> torch.Tensor | str:
        """DECODE for decode and verify steps on the Triton kernels (a few queries, no key mask, not the
        whole key range): the decode-attention kernel masks by position, computes a verified token exactly as a
        decoded one (SDPA's kernels differ between 1 and 16 queries), and building the mask tensor anyway cost 6
        kernels per step. Else forward_mask's."""
        from ..kernels.attention import MAX_QUERIES

        t = positions.shape[-1]
        if self.kernels is not None and key_mask is None and t <= MAX_QUERIES and t != kv_len:
            return DECODE
        return forward_mask(positions, kv_len, key_mask, self.cfg.num_heads // self.cfg.num_kv_heads, dtype)

    def tie_weights(self) -> None:
        if not self.cfg.tie_word_embeddings:
            return
        table = self.model.embed_tokens.weight
        if isinstance(table, QuantizedWeight):  # the head reads the table's blocks
            self.lm_head = QuantizedLinear(table)
        else:
            self.lm_head.weight = table

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return embedding_rows(self.model.embed_tokens, tokens)

    def project(self, x: torch.Tensor, logits: str) -> torch.Tensor | None:
        if logits == "none":
            return None
        if logits == "last":
            x = x[:, -1:]
        return self.lm_head(x)

    def run_layers(self, x: torch.Tensor, run_layer, capture, logits: str, on_features=None):
        """The decoder stack, final norm and head; collects the residual outputs of the `capture` layers
        (transformers' hidden_states[i + 1]: the last layer's is the normed state) concatenated.
        on_features(features), if given, is called as soon as they exist: after the layer that follows
        the last tap (its input kernel writes the sum the tap names: layers.tap), before the rest."""
        taps = {}
        last = len(self.model.layers) - 1
        complete = max(capture, default=last) + 1  # the layer after which every tap exists
        features = None
        for i, layer in enumerate(self.model.layers):
            x = run_layer(i, layer, x)
            if i in capture and i != last:
                taps[i], x = tap(x, self.model.layers[i + 1].input_layernorm)
            if i == complete:
                features = _features(taps, capture, on_features)
        x = final_norm(self.model.norm, x)
        if last in capture:
            taps[last] = x
        if features is None and capture:
            features = _features(taps, capture, on_features)
        return self.project(x, logits), features

    # --- cost accounting (memory plan, MBU in the benchmarks) ---------------------------------------
    def weight_bytes(self) -> int:
        """Bytes of the weights as stored (quantized blocks as their bytes)."""
        return stored_bytes(self)

    def parameter_count(self) -> int:
        return stored_elements(self)

    def attention_cache(self, layers: int, batch: int, max_len: int, budget: KVBudget | None) -> KVCache:
        """The attention layers' cache: every position on the device, or a bounded pool of `budget` positions
        (kv_budget.py) where it holds fewer than max_len."""
        cfg = self.cfg
        if budget is None or budget.tokens >= max_len:
            return KVCache(layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim, self.dtype, self.device)
        return BudgetKVCache(layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim, cfg.num_heads, self.dtype,
                             self.device, budget)

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of KV cache one position occupies (all attention layers, K and V)."""
        cfg = self.cfg
        item = (dtype or self.dtype).itemsize
        return 2 * self.attention_layer_count() * cfg.num_kv_heads * cfg.head_dim * item

    def attention_layer_count(self) -> int:
        return self.cfg.num_layers

    def state_bytes(self, batch: int = 1) -> int:
        """Fixed-size per-sequence state besides KV (recurrent layers); zero for pure attention models."""
        return 0

    def feature_bytes_per_token(self, n_taps: int, dtype: torch.dtype = torch.float32) -> int:
        return n_taps * self.cfg.hidden_size * dtype.itemsize

    def decode_weight_bytes(self) -> int:
        """Weight bytes one decode step reads: everything but the embedding table (one row is read), and
        for MoE only the experts a token is routed to. A tied lm_head reads the full table anyway."""
        total = self.weight_bytes()
        if not self.cfg.tie_word_embeddings:
            total -= tensor_bytes(self.model.embed_tokens.weight)
        cfg = self.cfg
        if cfg.num_experts:
            unused = 1 - cfg.num_experts_per_tok / cfg.num_experts
            total -= sum(int(tensor_bytes(stack) * unused) for stack in self._expert_stacks())
        return total

    def _expert_stacks(self) -> list:
        """The routed experts' weights: parameters of layers.Experts, or quant.experts.QuantizedExperts."""
        from ..quant.experts import QuantizedExperts

        stacks = [p for name, p in self.named_parameters() if ".experts." in name]
        return stacks + [m for m in self.modules() if isinstance(m, QuantizedExperts)]

    def flops_per_token(self) -> int:
        """2 x the parameters a token multiplies with (attention over the context excluded)."""
        active = self.parameter_count()
        if not self.cfg.tie_word_embeddings:
            active -= self.model.embed_tokens.weight.numel()
        cfg = self.cfg
        if cfg.num_experts:
            unused = 1 - cfg.num_experts_per_tok / cfg.num_experts
            active -= sum(int(stack.numel() * unused) for stack in self._expert_stacks())
        return 2 * active
