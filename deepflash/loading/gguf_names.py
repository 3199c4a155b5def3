"""GGUF metadata and tensors -> the Hugging Face config, names and layouts deepflash loads.

`hf_config` rebuilds an HF config dict from a file's metadata; `hf_tensor` says where one GGUF tensor goes
and how to undo what llama.cpp's converter did to it (convert_hf_to_gguf.py, whose model classes now live
in conversion/llama.py and conversion/qwen.py: LlamaModel, Qwen3Model, Qwen3MoeModel, Qwen3NextModel,
_LinearAttentionVReorderBase, Qwen3_5TextModel, Qwen3_5MoeTextModel).

A transform is described (HfTensor) before it is applied, so that a loader keeping matrices in their
quantized blocks can tell which it may keep: llama.cpp quantizes each row (output feature) of a matrix on
its own, so gathering or joining whole rows works on the blocks; a column permutation does not, and an
elementwise map of the values only ever meets tensors llama.cpp stores in float32 (vectors and norms).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import UserError

# GGUF general.architecture -> (HF model_type, HF architecture)
HF_MODELS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
    "qwen35moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
}


@dataclass(frozen=True)
class HfTensor:
    """Where one GGUF tensor goes: the HF `name`, and the inverse of the converter's transform, applied in
    the order of the fields.

    rows: indices of the GGUF rows that make the HF rows (dim -2 of a matrix or of each expert of a stack,
        dim 0 of a vector); works on quantized blocks.
    columns: the same along the last dim (input features); crosses quantization blocks.
    values: an elementwise map; only on tensors llama.cpp stores in float32.
    shape: the HF shape, where the converter squeezed a dim.
    part: this tensor is the part-th block of rows of `name` (the experts' gate, then up; join_parts)."""

    name: str
    rows: torch.Tensor | None = None
    columns: torch.Tensor | None = None
    values: Callable[[torch.Tensor], torch.Tensor] | None = None
    shape: tuple[int, ...] | None = None
    part: int | None = None

    @property
    def rows_only(self) -> bool:
        """Whether a quantized matrix can stay in its blocks: the transform gathers or joins whole rows only."""
        return self.columns is None and self.values is None

    def apply(self, w: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:
            w = w.index_select(max(w.dim() - 2, 0), self.rows)
        if self.columns is not None:
            w = w.index_select(-1, self.columns)
        if self.values is not None:
            w = self.values(w)
        return w if self.shape is None else w.reshape(self.shape)


def join_parts(parts: dict[str, dict[int, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Tensors the file stores in parts (HfTensor.part), each joined along its rows in part order."""
    return {name: torch.cat([blocks[i] for i in sorted(blocks)], dim=-2) for name, blocks in parts.items()}


# --- config -------------------------------------------------------------------------------------------
def hf_config(meta: dict, shapes: dict[str, tuple[int, ...]]) -> dict:
    """The HF config dict of a GGUF file: its metadata (key -> value) and tensor shapes (name -> torch order)."""
    arch = meta.get("general.architecture")
    if arch not in HF_MODELS:
        raise UserError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(HF_MODELS)}")
    config = _decoder_config(meta, arch, shapes)
    if arch in ("qwen3moe", "qwen35moe"):
        config.update(_experts_config(meta, arch))
    if arch in ("qwen35", "qwen35moe"):
        config.update(_hybrid_config(meta, arch, config["head_dim"]))
    if arch == "qwen35moe":
        config["shared_expert_intermediate_size"] = int(meta[f"{arch}.expert_shared_feed_forward_length"])
    return config


def _decoder_config(meta: dict, arch: str, shapes: dict[str, tuple[int, ...]]) -> dict:
    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    model_type, architecture = HF_MODELS[arch]
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": shapes["token_embd.weight"][0],  # qwen files state it only as the token list's length
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", 0) or 0),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length") or hidden // heads),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    scaling = get("rope.scaling.type")
    if scaling and scaling != "none":
        config["rope_scaling"] = {
            "rope_type": scaling,
            "factor": float(get("rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
        }
    elif "rope_freqs.weight" in shapes:
        raise UserError("this GGUF stores Llama-3 rope factors (rope_freqs); load the Hugging Face checkpoint instead")
    return config


def _experts_config(meta: dict, arch: str) -> dict:
    return {
        "num_experts": int(meta[f"{arch}.expert_count"]),
        "num_experts_per_tok": int(meta[f"{arch}.expert_used_count"]),
        "moe_intermediate_size": int(meta[f"{arch}.expert_feed_forward_length"]),
        "norm_topk_prob": True,
    }


def _hybrid_config(meta: dict, arch: str, head_dim: int) -> dict:
    """Qwen3.5's DeltaNet shape (Qwen3NextModel.set_gguf_parameters' ssm.* keys), its layer types, and its
    decoder depth: the file counts the multi-token-prediction block (nextn) among its blocks."""
    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    layers = int(get("block_count")) - int(get("nextn_predict_layers", 0))
    value_heads = int(get("ssm.time_step_rank"))
    return {
        "num_hidden_layers": layers,
        "layer_types": _layer_types(meta, arch, layers),
        "linear_conv_kernel_dim": int(get("ssm.conv_kernel")),
        "linear_key_head_dim": int(get("ssm.state_size")),
        "linear_num_key_heads": int(get("ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(get("ssm.inner_size")) // value_heads,  # stated whole, not per head
        "partial_rotary_factor": int(get("rope.dimension_count", head_dim)) / head_dim,
    }


def _layer_types(meta: dict, arch: str, layers: int) -> list[str]:
    """As llama.cpp reads them (src/models/qwen35.cpp): the attention.recurrent_layers flags where the file
    has them, else every full_attention_interval-th layer (default 4) is full attention."""
    recurrent = meta.get(f"{arch}.attention.recurrent_layers")
    if recurrent is None:
        interval = int(meta.get(f"{arch}.full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    return ["linear_attention" if flag else "full_attention" for flag in recurrent[:layers]]


# --- names --------------------------------------------------------------------------------------------
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ATTENTION = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
_QK_NORMS = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_FFN_NORM = {"ffn_norm.weight": "post_attention_layernorm.weight"}
_POST_ATTENTION_NORM = {"post_attention_norm.weight": "post_attention_layernorm.weight"}  # qwen35's name
_DENSE_MLP = {
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_EXPERTS = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_up_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",  # the converter's --fuse-gate-up-exps
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
_EXPERT_PARTS = {"ffn_gate_exps.weight": 0, "ffn_up_exps.weight": 1}  # gate_up_proj is [gate; up] per expert
_SHARED_EXPERT = {
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
_DELTANET = {
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
_HYBRID = _ATTENTION | _QK_NORMS | _POST_ATTENTION_NORM | _DELTANET
_LAYER_NAMES = {  # by HF model_type: a block's GGUF tensor -> its HF name under model.layers.N
    "llama": _ATTENTION | _FFN_NORM | _DENSE_MLP,
    "qwen3": _ATTENTION | _QK_NORMS | _FFN_NORM | _DENSE_MLP,
    "qwen3_moe": _ATTENTION | _QK_NORMS | _FFN_NORM | _EXPERTS,
    "qwen3_5_text": _HYBRID | _DENSE_MLP,
    "qwen3_5_moe_text": _HYBRID | _EXPERTS | _SHARED_EXPERT,
}


def hf_tensor(gguf_name: str, config: dict) -> HfTensor | None:
    """Where the GGUF tensor `gguf_name` goes in the HF checkpoint of `config` (hf_config's), with the inverse
    of the converter's transform; None for a tensor deepflash does without."""
    model_type = config["model_type"]
    if gguf_name == "rope_freqs.weight":
        return None  # llama3 factors; recomputed from the config's rope scaling
    if gguf_name in _GLOBAL_NAMES:
        name, leaf = _GLOBAL_NAMES[gguf_name], gguf_name
    else:
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
        if m and int(m[1]) >= config["num_hidden_layers"]:
            return None  # llama.cpp's multi-token-prediction block (nextn), which deepflash does not run
        if not m or m[2] not in _LAYER_NAMES[model_type]:
            raise UserError(f"unexpected GGUF tensor {gguf_name!r} for a {model_type} model")
        name, leaf = f"model.layers.{m[1]}.{_LAYER_NAMES[model_type][m[2]]}", m[2]
    inverse = _INVERSES.get(model_type, {}).get(leaf)
    return HfTensor(name, part=_EXPERT_PARTS.get(leaf), **(inverse(config) if inverse else {}))


# --- inverses of the converter's transforms ---------------------------------------------------------
def _rope_rows(heads: int, rows: int) -> torch.Tensor:
    """LlamaModel.permute interleaves each head's q/k rows for llama.cpp's rope: [h, 2, d/2] -> [h, d/2, 2].
    These indices take them back to rotate-half order."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def _llama_q(config: dict) -> dict:
    heads = config["num_attention_heads"]
    return {"rows": _rope_rows(heads, heads * config["head_dim"])}


def _llama_k(config: dict) -> dict:
    heads = config["num_key_value_heads"]
    return {"rows": _rope_rows(heads, heads * config["head_dim"])}


def _norm_offset(config: dict) -> dict:
    """Qwen3NextModel stores every `*norm.weight` but the DeltaNet's gated norm as 1 + w (llama.cpp's RMSNorm
    scales by the weight itself); HF keeps the offset w."""
    return {"values": lambda w: w - 1}


def _a_log(config: dict) -> dict:
    """ssm_a = -exp(A_log), per value head."""
    return {"rows": _grouped_value_rows(config, 1), "values": lambda a: torch.log(-a)}


def _grouped_value_rows(config: dict, width: int) -> torch.Tensor | None:
    """_LinearAttentionVReorderBase tiles the value heads for ggml's broadcast: HF's value head j of key head g
    (grouped, g * R + j) becomes j * K + g. These indices, over `width` rows per head, group them again;
    None where every key head has one value head (the converter leaves those alone)."""
    key_heads = config["linear_num_key_heads"]
    per_key = config["linear_num_value_heads"] // key_heads
    if per_key == 1:
        return None
    return torch.arange(key_heads * per_key * width).reshape(per_key, key_heads, width).transpose(0, 1).reshape(-1)


def _conv_rows(config: dict) -> torch.Tensor | None:
    """Rows of the fused q | k | v channels (in_proj_qkv, conv1d): only the value block is reordered."""
    values = _grouped_value_rows(config, config["linear_value_head_dim"])
    if values is None:
        return None
    qk = 2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
    return torch.cat([torch.arange(qk), qk + values])


def _qkv(config: dict) -> dict:
    return {"rows": _conv_rows(config)}


def _conv1d(config: dict) -> dict:
    """Qwen3NextModel squeezes the depthwise conv's [C, 1, K] kernel to [C, K]."""
    channels = (2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
                + config["linear_num_value_heads"] * config["linear_value_head_dim"])
    return {"rows": _conv_rows(config), "shape": (channels, 1, config["linear_conv_kernel_dim"])}


def _z(config: dict) -> dict:
    return {"rows": _grouped_value_rows(config, config["linear_value_head_dim"])}


def _per_value_head(config: dict) -> dict:
    return {"rows": _grouped_value_rows(config, 1)}


def _out_proj(config: dict) -> dict:
    """The one tensor that consumes the value heads: reordered along its input features. On quantized blocks
    the equivalent is to feed it the (grouped) DeltaNet output gathered into the file's tiled order."""
    return {"columns": _grouped_value_rows(config, config["linear_value_head_dim"])}


def _shared_expert_gate(config: dict) -> dict:
    """HF's [1, H]; llama.cpp reads a vector, which other writers may store."""
    return {"shape": (1, config["hidden_size"])}


_LLAMA_INVERSES = {"attn_q.weight": _llama_q, "attn_q.bias": _llama_q, "attn_k.weight": _llama_k,
                   "attn_k.bias": _llama_k}
_HYBRID_INVERSES = {
    **dict.fromkeys(("output_norm.weight", "attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight",
                     "attn_k_norm.weight"), _norm_offset),
    "ssm_a": _a_log,
    "attn_qkv.weight": _qkv,
    "ssm_conv1d.weight": _conv1d,
    "attn_gate.weight": _z,
    "ssm_alpha.weight": _per_value_head,
    "ssm_beta.weight": _per_value_head,
    "ssm_dt.bias": _per_value_head,
    "ssm_out.weight": _out_proj,
    "ffn_gate_inp_shexp.weight": _shared_expert_gate,
}
_INVERSES = {"llama": _LLAMA_INVERSES, "qwen3_5_text": _HYBRID_INVERSES, "qwen3_5_moe_text": _HYBRID_INVERSES}
