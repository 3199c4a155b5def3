"""Configs parsed from Hugging Face config.json dicts (GGUF metadata is mapped to the same dict form).

Only what the engine needs is lifted into typed fields; the raw dict stays available for
architecture-specific extras. Unknown fields are tolerated everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings; `kind` is one of default, linear, llama3, yarn."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    original_max_position: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    partial_rotary_factor: float = 1.0

    @classmethod
    def from_hf(cls, cfg: dict) -> RopeConfig:
        params = dict(cfg.get("rope_parameters") or {})
        params.update(cfg.get("rope_scaling") or {})
        kind = params.get("rope_type") or params.get("type") or "default"
        if kind not in ("default", "linear", "llama3", "yarn"):
            raise UserError(f"unsupported rope type {kind!r}; supported: default, linear, llama3, yarn")
        factor = params.get("factor")
        original = params.get("original_max_position_embeddings")
        if kind == "yarn" and factor is None and original:
            factor = cfg["max_position_embeddings"] / original
        return cls(
            theta=float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            kind=kind,
            factor=float(factor if factor is not None else 1.0),
            original_max_position=int(original) if original else None,
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
            partial_rotary_factor=float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))),
        )

    def to_hf(self) -> dict:
        out = {"rope_theta": self.theta, "rope_type": self.kind}
        if self.kind != "default":
            out["factor"] = self.factor
        if self.original_max_position:
            out["original_max_position_embeddings"] = self.original_max_position
        if self.kind == "llama3":
            out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor)
        if self.kind == "yarn":
            out.update(beta_fast=self.beta_fast, beta_slow=self.beta_slow, truncate=self.truncate)
            for name in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(self, name) is not None:
                    out[name] = getattr(self, name)
        if self.partial_rotary_factor != 1.0:
            out["partial_rotary_factor"] = self.partial_rotary_factor
        return out


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def decoder_shape(cfg: dict) -> dict:
    """The fields targets and drafters share, from an HF config (head_dim and kv heads defaulted)."""
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    return dict(
        hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=RopeConfig.from_hf(cfg),
    )


def _text_config(cfg: dict) -> dict:
    """Multimodal wrappers (Qwen3.5 ...ForConditionalGeneration) nest the language model's config."""
    text = cfg.get("text_config")
    if isinstance(text, dict):
        merged = dict(text)
        merged.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        return merged
    return cfg


@dataclass(frozen=True)
class ModelConfig:
    """A target model's shape. `raw` keeps the full (text) config for architecture extras."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        cfg = _text_config(cfg)
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(
                f"unsupported architecture {model_type!r} ({cfg.get('architectures')}); "
                f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        moe = model_type in ("qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text")
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            **decoder_shape(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=model_type != "llama",
            attention_bias=bool(cfg.get("attention_bias", False)),
            num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0) if moe else 0,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0)) if moe else 0,
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0)) if moe else 0,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
            raw=cfg,
        )

    @property
    def positions(self) -> int:
        """The positions the model is defined on: max_position_embeddings, or beyond where YaRN stretches the
        rope of an original window by its factor (from the checkpoint, or with_rope_scaling)."""
        rope = self.rope
        if rope.kind == "yarn" and rope.original_max_position:
            return max(self.max_position_embeddings, int(rope.original_max_position * rope.factor))
        return self.max_position_embeddings

    def with_rope_scaling(self, spec: str) -> ModelConfig:
        """This config with YaRN over its native window ('yarn:FACTOR', --rope-scaling): positions up to
        FACTOR x the window the checkpoint's rope was made for."""
        kind, _, value = spec.partition(":")
        try:
            factor = float(value)
        except ValueError:
            factor = 0.0
        if kind != "yarn" or factor <= 1:
            raise UserError(f"--rope-scaling takes yarn:FACTOR with a factor above 1 (yarn:4 stretches the native "
                            f"window four times), got {spec!r}")
        original = self.rope.original_max_position or self.max_position_embeddings
        return replace(self, rope=replace(self.rope, kind="yarn", factor=factor, original_max_position=original))

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )


