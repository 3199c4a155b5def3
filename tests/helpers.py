"""Tiny in-process models and tokenizers for the tests (no network, no files)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepflash.config import DrafterConfig, ModelConfig
from deepflash.drafter import DFlashDrafter, save_drafter
from deepflash.models import init_random_, materialize, random_model
from deepflash.tokenizer import Tokenizer, word_tokenizer

VOCAB = 96
EOS = 1


def tiny_tokenizer(vocab: int = VOCAB) -> Tokenizer:
    """Word-level tokenizer over 'w0'..'wN'; id 1 is the end token, with a minimal chat template."""
    return word_tokenizer(vocab, EOS)


def llama_config(**overrides) -> ModelConfig:
    return ModelConfig.from_hf(llama_config_dict(**overrides))


def llama_config_dict(**overrides) -> dict:
    cfg = dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               rms_norm_eps=1e-6, max_position_embeddings=512, rope_theta=10000.0,
               tie_word_embeddings=True, eos_token_id=EOS)
    cfg.update(overrides)
    return cfg


def tiny_target(dtype=torch.float64, seed=0, std=0.2, **overrides):
    return random_model(llama_config(**overrides), dtype=dtype, seed=seed, std=std)


def drafter_config(target_cfg: ModelConfig, layers: int = 2, block_size: int = 16, sliding: bool = False,
                   window: int = 8, taps=(0, 2), **overrides) -> DrafterConfig:
    types = ["sliding_attention" if sliding and i < layers - 1 else "full_attention" for i in range(layers)]
    cfg = dict(architectures=["DFlashDraftModel"], hidden_size=target_cfg.hidden_size, intermediate_size=96,
               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=target_cfg.max_position_embeddings,
               layer_types=types, sliding_window=window, block_size=block_size,
               num_target_layers=target_cfg.num_layers, vocab_size=target_cfg.vocab_size,
               dflash_config={"mask_token_id": target_cfg.vocab_size - 1, "target_layer_ids": list(taps)})
    cfg.update(overrides)
    return DrafterConfig.from_hf(cfg)


def tiny_drafter(cfg: DrafterConfig, dtype=torch.float64, seed=1, std=0.2) -> DFlashDrafter:
    drafter = DFlashDrafter(cfg).to(dtype)
    init_random_(drafter, seed, std)
    return materialize(drafter, "cpu").eval().requires_grad_(False)


def save_tiny_model(folder: Path, **overrides) -> Path:
    """A tiny model folder as users have them: config.json, model.safetensors, tokenizer files."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = llama_config_dict(**overrides)
    model = random_model(ModelConfig.from_hf(cfg), std=0.2)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    tiny_tokenizer().hf.save_pretrained(str(folder))
    return folder


def save_tiny_drafter(folder: Path, **overrides) -> Path:
    save_drafter(tiny_drafter(drafter_config(llama_config(), **overrides), dtype=torch.float32), folder,
                 dtype=torch.float32)
    return folder
