"""GGUF files: converted once to a safetensors folder with an HF config and tokenizer."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import UserError
from ..progress import progress

GGUF_MODEL_TYPES = {"llama": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}


_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def cache_root() -> Path:
    """DEEPFLASH_CACHE, else $XDG_CACHE_HOME/deepflash, else ~/.cache/deepflash."""
    env = os.environ.get("DEEPFLASH_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deepflash"


def gguf_folder(path: Path) -> Path:
    """Convert a GGUF file once into an HF-style folder in the cache; later calls return the folder.

    Processes that load the same file at once (two training runs side by side) each convert into their
    own temporary folder and rename it into place; the folder only ever appears complete, and whoever
    renames second keeps the first one's (a shared temporary folder let one process delete the other's
    files, 2026-11-30)."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_root() / "gguf" / f"{path.stem}-{key}"
    if (folder / "model.safetensors").is_file():
        return folder
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _convert_gguf(path, tmp)
        if folder.is_dir() and not (folder / "model.safetensors").is_file():
            shutil.rmtree(folder)  # left incomplete by an older version
        try:
            tmp.rename(folder)
        except OSError:
            if not (folder / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _read_gguf(path: Path):
    """The file's GGUFReader; a file that is not one (text, truncated, corrupt) is the user's error."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (ValueError, OSError, EOFError) as err:
        raise UserError(f"{path} is not a readable GGUF file ({err})") from None


def _convert_gguf(path: Path, out: Path) -> None:
    from gguf.quants import dequantize

    reader = _read_gguf(path)
    meta = {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("tokenizer.ggml.")}
    arch = meta["general.architecture"]
    if arch not in GGUF_MODEL_TYPES:
        raise UserError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_MODEL_TYPES)}")
    names = {t.name for t in reader.tensors}
    config = _gguf_config(meta, arch, names)
    tensors = {}
    ups: dict[str, torch.Tensor] = {}
    for t in progress(reader.tensors, f"converting {path.name}"):
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        name = _gguf_name(t.name)
        if name is None:
            continue
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config["num_attention_heads"] if "attn_q" in t.name else config["num_key_value_heads"]
            w = _unpermute_rope_rows(w, heads)
        if name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
            ups[name] = w
            continue
        tensors[name] = w
    for layer in {n.split(".")[1] for n in ups}:
        gate, up = ups[f"blk.{layer}.ffn_gate_exps.weight"], ups[f"blk.{layer}.ffn_up_exps.weight"]
        tensors[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if "tokenizer.ggml.model" in reader.fields:
        _save_gguf_tokenizer(path, out)


def _gguf_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if not m:
        if name == "rope_freqs.weight":
            return None  # llama3 factors; recomputed from the config's rope scaling
        raise UserError(f"unexpected GGUF tensor {name!r}")
    layer, rest = m.groups()
    if rest in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
        return f"blk.{layer}.{rest}"  # fused after both are read
    if rest not in _GGUF_LAYER_NAMES:
        raise UserError(f"unexpected GGUF tensor {name!r}")
    return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[rest]}"


def _unpermute_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp interleaves q/k rows for its rope; undo it for rotate-half rope."""
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_config(meta: dict, arch: str, names: set[str]) -> dict:
    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    config = {
        "architectures": [f"{arch.capitalize()}ForCausalLM"],
        "model_type": GGUF_MODEL_TYPES[arch],
        "vocab_size": int(get("vocab_size") or meta.get("tokenizer.ggml.tokens_count", 0)),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", 0) or 0),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length") or hidden // heads),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
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
    elif "rope_freqs.weight" in names:
        raise UserError("this GGUF stores Llama-3 rope factors (rope_freqs); load the Hugging Face checkpoint instead")
    if arch == "qwen3moe":
        config.update(
            num_experts=int(get("expert_count")),
            num_experts_per_tok=int(get("expert_used_count")),
            moe_intermediate_size=int(get("expert_feed_forward_length")),
            norm_topk_prob=True,
        )
    return config


def _save_gguf_tokenizer(path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(out))

