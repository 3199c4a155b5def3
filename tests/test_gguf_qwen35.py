"""Qwen3.5 / Qwen3.6 GGUF files (llama.cpp's qwen35 and qwen35moe): written here as llama.cpp's converter
writes them, from a random transformers model, they load to the same logits as its safetensors folder.

The writer follows llama.cpp's conversion/qwen.py (Qwen3_5TextModel, Qwen3_5MoeTextModel: the
_Qwen35MtpMixin, _Qwen35MRopeMixin, _LinearAttentionVReorderBase, Qwen3NextModel and Qwen2MoeModel steps)
and conversion/base.py (TextModel.set_gguf_parameters, ModelBase.modify_tensors), step by step, rather than
inverting deepflash's loader."""

import numpy as np
import pytest
import torch
from helpers import hf_qwen35

from deepflash.errors import UserError
from deepflash.loading.gguf_names import hf_config, hf_tensor
from deepflash.loading.targets import load_target
from deepflash.quant.experts import QuantizedExperts
from deepflash.quant.weight import QuantizedWeight

LAYERS = 8  # the converter writes full_attention_interval 4: layers 3 and 7 are full attention
LAYER_TYPES = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(LAYERS)]


def random_hf_model(kind: str):
    """A transformers Qwen3.5 text model (k heads 2, v heads 4: the value-head reorder matters) with random
    weights, norm offsets included."""
    return hf_qwen35(kind, num_hidden_layers=LAYERS, layer_types=LAYER_TYPES)


def mtp_block(state: dict, hidden: int) -> dict:
    """The checkpoints' `mtp.*` tensors: one full-attention decoder layer and its fusion of token and state."""
    last = f"model.layers.{LAYERS - 1}."
    block = {f"mtp.layers.0.{k.removeprefix(last)}": v.clone() for k, v in state.items() if k.startswith(last)}
    block.update({"mtp.fc.weight": torch.randn(hidden, 2 * hidden), "mtp.pre_fc_norm_embedding.weight":
                  torch.randn(hidden), "mtp.pre_fc_norm_hidden.weight": torch.randn(hidden),
                  "mtp.norm.weight": torch.randn(hidden)})
    return block


# --- llama.cpp's converter, step by step -----------------------------------------------------------------
def mtp_names(name: str) -> str:
    """_Qwen35MtpMixin.filter_tensors: mtp.* becomes the block after the decoder's layers."""
    remap = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
             "norm": "shared_head.norm"}
    if not name.startswith("mtp."):
        return name
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[1] == "layers":
        return f"model.layers.{LAYERS + int(parts[2])}.{parts[3]}"
    if len(parts) == 3 and parts[1] in remap:
        return f"model.layers.{LAYERS}.{remap[parts[1]]}.{parts[2]}"
    return name


def reorder_v_heads(t, dim, num_k_heads, num_v_per_k, head_dim):
    """_LinearAttentionVReorderBase._reorder_v_heads: grouped value heads -> tiled."""
    shape = list(t.shape)
    dim %= len(shape)
    t = t.reshape(*shape[:dim], num_k_heads, num_v_per_k, head_dim, *shape[dim + 1:])
    perm = list(range(t.dim()))
    perm[dim], perm[dim + 1] = perm[dim + 1], perm[dim]
    return t.permute(*perm).contiguous().reshape(*shape)


def v_reorder(t, name, hp):
    """_LinearAttentionVReorderBase.modify_tensors."""
    num_k_heads, num_v_heads = hp["linear_num_key_heads"], hp["linear_num_value_heads"]
    if num_k_heads == num_v_heads or "linear_attn." not in name:
        return t
    head_k_dim, head_v_dim = hp["linear_key_head_dim"], hp["linear_value_head_dim"]
    r = num_v_heads // num_k_heads
    qk = 2 * head_k_dim * num_k_heads
    if ".in_proj_qkv." in name:
        return torch.cat([t[:qk], reorder_v_heads(t[qk:], 0, num_k_heads, r, head_v_dim)])
    if ".in_proj_z." in name:
        return reorder_v_heads(t, 0, num_k_heads, r, head_v_dim)
    if ".in_proj_b." in name or ".in_proj_a." in name:
        return reorder_v_heads(t, 0, num_k_heads, r, 1)
    if ".A_log" in name or ".dt_bias" in name:
        return reorder_v_heads(t.unsqueeze(-1), 0, num_k_heads, r, 1).squeeze(-1)
    if ".conv1d" in name:
        data = t.squeeze()
        return torch.cat([data[:qk], reorder_v_heads(data[qk:], 0, num_k_heads, r, head_v_dim)])
    if ".out_proj." in name:
        return reorder_v_heads(t, 1, num_k_heads, r, head_v_dim)
    return t


def qwen3next(t, name):
    """Qwen3NextModel.modify_tensors (Qwen3.5 has separate in_proj_qkv / in_proj_z: no qkvz split)."""
    if name.endswith(".A_log"):
        t = -torch.exp(t)
    elif name.endswith(".dt_bias"):
        name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
    elif "conv1d" in name:
        t = t.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    return t, name


def qwen2moe(t, name):
    """Qwen2MoeModel.modify_tensors: fused experts as transformers stores them, split into gate and up."""
    if name.endswith("mlp.experts.down_proj"):
        return [(t, f"{name}.weight")]
    if name.endswith("mlp.experts.gate_up_proj"):
        n_ff = t.shape[-2] // 2
        base = name.removesuffix(".gate_up_proj")
        return [(t[..., :n_ff, :], f"{base}.gate_proj.weight"), (t[..., n_ff:, :], f"{base}.up_proj.weight")]
    return [(t, name)]


# gguf 0.19.0's QWEN35 tensor list predates the MTP block; upstream gguf-py/gguf/tensor_mapping.py maps these
NEXTN = {"eh_proj": "nextn.eh_proj", "enorm": "nextn.enorm", "hnorm": "nextn.hnorm",
         "shared_head.norm": "nextn.shared_head_norm"}


def gguf_name(name, tensor_map):
    """ModelBase.map_tensor_name, through gguf-py's TensorNameMap."""
    mapped = tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
    if mapped is None:
        block, leaf = name.removeprefix("model.layers.").split(".", 1)
        mapped = f"blk.{block}.{NEXTN[leaf.removesuffix('.weight')]}.weight"
    return mapped


def write_gguf(path, hf, arch, q8_0=False):
    """The GGUF convert_hf_to_gguf.py writes for `hf` with --outtype f32 (every tensor float32), or with
    `q8_0` its matrices in Q8_0 blocks (norms, the short convolution and the MTP block stay float32)."""
    import gguf

    hp = hf.config.to_dict()
    state = {k: v.float() for k, v in hf.state_dict().items()}
    state.update(mtp_block(state, hp["hidden_size"]))
    block_count = hp["num_hidden_layers"] + 1  # _Qwen35MtpMixin: the decoder's layers and the MTP block
    w = gguf.GGUFWriter(str(path), arch)
    # TextModel.set_gguf_parameters
    w.add_block_count(block_count)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    if "intermediate_size" in hp:
        w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_rope_freq_base(hp["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if arch == "qwen35moe":
        w.add_expert_count(hp["num_experts"])
        w.add_expert_used_count(hp["num_experts_per_tok"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    # Qwen2MoeModel.set_gguf_parameters
    if arch == "qwen35moe":
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])
    # Qwen3NextModel.set_gguf_parameters
    w.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
    w.add_ssm_state_size(hp["linear_key_head_dim"])
    w.add_ssm_group_count(hp["linear_num_key_heads"])
    w.add_ssm_time_step_rank(hp["linear_num_value_heads"])
    w.add_ssm_inner_size(hp["linear_value_head_dim"] * hp["linear_num_value_heads"])
    w.add_full_attention_interval(hp.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(hp["head_dim"] * hp.get("partial_rotary_factor", 0.25)))
    # _Qwen35MRopeMixin, _Qwen35MtpMixin
    w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_nextn_predict_layers(1)
    w.add_eos_token_id(hp["eos_token_id"])  # set_vocab's special tokens (the vocabulary itself left out)

    tensor_map = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), block_count)
    for name, t in state.items():
        name = mtp_names(name)
        t = v_reorder(t, name, hp)
        t, name = qwen3next(t, name)
        for part, part_name in qwen2moe(t, name):
            data = np.ascontiguousarray(part.numpy())
            if q8_0 and data.ndim >= 2 and data.shape[-1] % 32 == 0 and not any(
                    key in part_name for key in ("norm", "conv1d", "mtp")):
                qtype = gguf.GGMLQuantizationType.Q8_0
                w.add_tensor(gguf_name(part_name, tensor_map), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
            else:
                w.add_tensor(gguf_name(part_name, tensor_map), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# --- the tests ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, arch", [("dense", "qwen35"), ("moe", "qwen35moe")])
def test_gguf_loads_like_its_safetensors_folder(tmp_path, monkeypatch, kind, arch):
    monkeypatch.setenv("DEEPFLASH_CACHE", str(tmp_path / "cache"))
    hf = random_hf_model(kind)
    hf.save_pretrained(tmp_path / "folder")
    write_gguf(tmp_path / "tiny.gguf", hf, arch)
    want, _ = load_target(str(tmp_path / "folder"))
    got, folder = load_target(str(tmp_path / "tiny.gguf"))
    assert got.cfg.raw["layer_types"] == LAYER_TYPES and got.cfg.eos_token_ids == (1,)
    assert folder.parent == tmp_path / "cache" / "gguf"
    tokens = torch.randint(5, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = want(tokens, torch.arange(40), want.new_cache(1, 64))[0]
        logits = got(tokens, torch.arange(40), got.new_cache(1, 64))[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind, arch", [("dense", "qwen35"), ("moe", "qwen35moe")])
def test_q8_0_file_kept_quantized_matches_its_dequantized_load(tmp_path, monkeypatch, kind, arch):
    """Matrices and expert stacks stay in their blocks: rows reordered as whole rows, the DeltaNet output
    projection's input gathered into the file's order (QuantizedWeight.columns); routers dequantized."""
    monkeypatch.setenv("DEEPFLASH_CACHE", str(tmp_path / "cache"))
    write_gguf(tmp_path / "tiny.gguf", random_hf_model(kind), arch, q8_0=True)
    dense, _ = load_target(str(tmp_path / "tiny.gguf"), gguf_weights="dequantized")
    kept, _ = load_target(str(tmp_path / "tiny.gguf"), gguf_weights="quantized")
    quantized = {name for name, m in kept.named_modules() if isinstance(m, QuantizedWeight)}
    assert "model.layers.0.linear_attn.out_proj.weight" in quantized
    assert kept.get_submodule("model.layers.0.linear_attn.out_proj.weight").columns is not None
    assert kept.get_submodule("model.layers.0.linear_attn").out_order is not None  # the norm writes file order
    assert "model.layers.3.self_attn.q_proj.weight" in quantized
    assert kept.weight_bytes() < dense.weight_bytes() / 2
    if kind == "moe":
        assert isinstance(kept.get_submodule("model.layers.0.mlp.experts"), QuantizedExperts)
    tokens = torch.randint(5, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = dense(tokens, torch.arange(40), dense.new_cache(1, 64))[0]
        logits = kept(tokens, torch.arange(40), kept.new_cache(1, 64))[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def qwen35_meta(**extra) -> dict:
    meta = {"general.architecture": "qwen35", "qwen35.block_count": 4, "qwen35.embedding_length": 64,
            "qwen35.attention.head_count": 4, "qwen35.attention.key_length": 16, "qwen35.ssm.conv_kernel": 4,
            "qwen35.ssm.state_size": 16, "qwen35.ssm.group_count": 2, "qwen35.ssm.time_step_rank": 4,
            "qwen35.ssm.inner_size": 32, "qwen35.rope.dimension_count": 4}
    return meta | {f"qwen35.{k}": v for k, v in extra.items()}


def test_recurrent_layer_flags_win_over_the_interval():
    shapes = {"token_embd.weight": (128, 64)}
    assert hf_config(qwen35_meta(), shapes)["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    flags = qwen35_meta(**{"attention.recurrent_layers": [True, False, True, False]})
    assert hf_config(flags, shapes)["layer_types"] == ["linear_attention", "full_attention"] * 2


def test_only_the_deltanet_output_projection_reorders_columns():
    """What a loader keeping quantized blocks relies on: every 2-D weight llama.cpp may quantize maps by whole
    rows, except ssm_out; value maps touch float32 tensors only (norms, ssm_a)."""
    cfg = hf_config(qwen35_meta(), {"token_embd.weight": (128, 64)})
    leaves = ["attn_qkv.weight", "attn_gate.weight", "ssm_alpha.weight", "ssm_beta.weight", "ssm_out.weight",
              "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight"]
    not_rows = [leaf for leaf in leaves if not hf_tensor(f"blk.0.{leaf}", cfg).rows_only]
    assert not_rows == ["ssm_out.weight"]
    assert hf_tensor("blk.0.ssm_out.weight", cfg).rows is None
    assert not hf_tensor("blk.0.attn_norm.weight", cfg).rows_only and not hf_tensor("blk.0.ssm_a", cfg).rows_only
    assert hf_tensor("blk.4.nextn.eh_proj.weight", cfg) is None  # the MTP block past the 4 layers


def test_unknown_architecture_and_tensor_are_one_line_errors(tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("DEEPFLASH_CACHE", str(tmp_path / "cache"))
    w = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError, match=r"^unsupported GGUF architecture 'mamba'; supported: llama, .*qwen35moe$") as err:
        load_target(str(tmp_path / "mamba.gguf"))
    assert "\n" not in str(err.value)
    cfg = hf_config(qwen35_meta(), {"token_embd.weight": (128, 64)})
    with pytest.raises(UserError, match=r"^unexpected GGUF tensor 'blk.0.ffn_gate_exps.weight' for a qwen3_5_text"):
        hf_tensor("blk.0.ffn_gate_exps.weight", cfg)
