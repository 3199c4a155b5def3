"""Configs parsed from Hugging Face config.json dicts (GGUF metadata is mapped to the same dict form).

Only what the engine needs is lifted into typed fields; the raw dict stays available for
architecture-specific extras. Unknown fields are tolerated everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import UserError

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


def _decoder_shape(cfg: dict) -> dict:
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
            **_decoder_shape(cfg),
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

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )


@dataclass(frozen=True)
class DrafterConfig:
    """A DFlash drafter (z-lab `DFlashDraftModel` config.json)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    layer_types: tuple[str, ...]
    sliding_window: int | None
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    vocab_size: int
    max_position_embeddings: int
    trained_context_length: int
    is_causal: bool | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf(cls, cfg: dict) -> DrafterConfig:
        arch = (cfg.get("architectures") or ["DFlashDraftModel"])[0]
        if arch != "DFlashDraftModel":
            raise UserError(f"unsupported drafter architecture {arch!r}; supported: DFlashDraftModel")
        dflash = cfg.get("dflash_config") or {}
        ids = dflash.get("target_layer_ids", cfg.get("target_layer_ids"))
        mask = dflash.get("mask_token_id", cfg.get("mask_token_id"))
        if ids is None or mask is None:
            raise UserError("drafter config.json lacks dflash_config.target_layer_ids or mask_token_id")
        layers = int(cfg["num_hidden_layers"])
        max_pos = int(cfg.get("max_position_embeddings", 40960))
        layer_types = tuple(cfg.get("layer_types") or ["full_attention"] * layers)
        if len(layer_types) != layers or set(layer_types) - {"full_attention", "sliding_attention"}:
            raise UserError(f"drafter layer_types {list(layer_types)} must list {layers} of full/sliding_attention")
        softcap = dflash.get("final_logit_softcapping")
        return cls(
            **_decoder_shape(cfg),
            layer_types=layer_types,
            sliding_window=cfg.get("sliding_window") if "sliding_attention" in layer_types else None,
            block_size=int(dflash.get("block_size", cfg.get("block_size", 16))),
            mask_token_id=int(mask),
            target_layer_ids=tuple(int(i) for i in ids),
            num_target_layers=int(cfg.get("num_target_layers", 0)),
            vocab_size=int(cfg.get("vocab_size", 0)),
            max_position_embeddings=max_pos,
            trained_context_length=int(dflash.get("trained_context_length") or max_pos),
            is_causal=cfg.get("is_causal"),
            input_embedding_scale=float(dflash.get("input_embedding_scale", 1.0)),
            output_multiplier=float(dflash.get("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            raw=cfg,
        )

    def to_hf(self) -> dict:
        """The z-lab config.json; extra fields of a loaded config are carried through."""
        out = dict(self.raw)
        out.update(
            architectures=["DFlashDraftModel"],
            model_type="qwen3",
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            hidden_act="silu",
            attention_bias=False,
            layer_types=list(self.layer_types),
            sliding_window=self.sliding_window,
            block_size=self.block_size,
            num_target_layers=self.num_target_layers,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            rope_theta=self.rope.theta,
            rope_scaling=None if self.rope.kind == "default" else self.rope.to_hf(),
        )
        out.pop("rope_parameters", None)
        dflash = dict(out.get("dflash_config") or {})
        dflash.update(
            mask_token_id=self.mask_token_id,
            target_layer_ids=list(self.target_layer_ids),
            block_size=self.block_size,
            trained_context_length=self.trained_context_length,
        )
        out["dflash_config"] = dflash
        return out

    def layer_is_causal(self, layer: int) -> bool:
        """Sliding layers are causal inside the block unless the config overrides it (REFERENCE 1)."""
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self.layer_types[layer] == "sliding_attention"

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None


def default_target_layer_ids(num_target_layers: int, n: int) -> tuple[int, ...]:
    """n ids spread evenly from layer 1 to L-3 (36 layers, 5 ids -> 1, 9, 17, 25, 33); n == 1 -> L // 2."""
    if n == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(round(start + (end - start) * i / (n - 1)) for i in range(n))


DTYPES = {"float32": "float32", "f32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "f16": "float16"}
SPEC_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class EngineConfig:
    """Everything that decides how a model pair is loaded and run; shared by generate, serve and bench."""

    model: str | None = None  # path, .gguf, hub id; None = the embedded default
    draft: str | None = None  # None = the default drafter of the embedded model, if any
    no_draft: bool = False
    block_size: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    max_ctx: int | str | None = None  # tokens, "auto" (largest that fits the device), None = the model's
    feature_dtype: str = "f32"
    feat_ring_cap: int | None = None
    trained_ctx: int | None = None
    spec: str = "auto"
    reserve_mb: int = 1024  # device memory --max-ctx auto leaves free
    ring_kernels: str = "auto"  # feature-ring encode/decode: auto, torch, compile, triton (features.py)
    target_kernels: str = "auto"  # auto (Triton on CUDA), torch or triton: TargetModel.use_kernels

    def validated(self) -> EngineConfig:
        from .features import RING_KERNELS
        from .models.base import TARGET_KERNELS
        from .quant import FORMATS

        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise UserError(f"--dtype must be auto or one of {', '.join(sorted(set(DTYPES)))}, got {self.dtype!r}")
        if self.feature_dtype not in FORMATS:
            raise UserError(f"--feature-dtype must be one of {', '.join(FORMATS)}, got {self.feature_dtype!r}")
        if self.spec not in SPEC_MODES:
            raise UserError(f"--spec must be one of {', '.join(SPEC_MODES)}, got {self.spec!r}")
        if self.block_size is not None and self.block_size < 1:
            raise UserError(f"--block-size must be >= 1, got {self.block_size}")
        if isinstance(self.max_ctx, str) and self.max_ctx != "auto":
            raise UserError(f"--max-ctx must be a number of tokens or 'auto', got {self.max_ctx!r}")
        if isinstance(self.max_ctx, int) and self.max_ctx < 2:
            raise UserError(f"--max-ctx must be at least 2, got {self.max_ctx}")
        if self.ring_kernels not in RING_KERNELS:
            raise UserError(f"--ring-kernels must be one of {', '.join(RING_KERNELS)}, got {self.ring_kernels!r}")
        if self.target_kernels not in TARGET_KERNELS:
            raise UserError(f"--target-kernels must be one of {', '.join(TARGET_KERNELS)}, got {self.target_kernels!r}")
        if self.trained_ctx is not None and self.trained_ctx < 1:
            raise UserError(f"--trained-ctx must be >= 1, got {self.trained_ctx}")
        return self
