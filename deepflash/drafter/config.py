"""The DFlash drafter's config (z-lab `DFlashDraftModel` config.json)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UserError
from ..models.config import RopeConfig, decoder_shape


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
        if cfg.get("use_sliding_window") is False:  # as transformers reads it: every layer a full-attention one
            layer_types = ("full_attention",) * layers
        # the explicit causality overrides vLLM, SGLang and TensorRT-LLM honour: config is_causal, then
        # dflash_config.causal; without either, sliding layers are causal inside the block (layer_is_causal)
        is_causal = cfg.get("is_causal", dflash.get("causal"))
        softcap = dflash.get("final_logit_softcapping")
        return cls(
            **decoder_shape(cfg),
            layer_types=layer_types,
            sliding_window=cfg.get("sliding_window") if "sliding_attention" in layer_types else None,
            block_size=int(dflash.get("block_size", cfg.get("block_size", 16))),
            mask_token_id=int(mask),
            target_layer_ids=tuple(int(i) for i in ids),
            num_target_layers=int(cfg.get("num_target_layers", 0)),
            vocab_size=int(cfg.get("vocab_size", 0)),
            max_position_embeddings=max_pos,
            trained_context_length=int(dflash.get("trained_context_length") or max_pos),
            is_causal=None if is_causal is None else bool(is_causal),
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

