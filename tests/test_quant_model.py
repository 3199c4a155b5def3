"""Targets with weights kept in GGUF blocks (deepflash/quant): the same logits as the model holding the
dequantized weights, the greedy and sampled contracts with a quantized target, memory counted in blocks."""

import pytest
import torch
from gguf import GGMLQuantizationType as T
from helpers import drafter_config, tiny_drafter, tiny_target, tiny_tokenizer

from deepflash.engine.config import EngineConfig
from deepflash.engine.engine import Engine
from deepflash.engine.sampling import SamplingParams
from deepflash.quant.gguf_blocks import block_format
from deepflash.quant.random_weights import quantize_random_
from deepflash.quant.weight import QuantizedLinear, QuantizedWeight

TOKENIZER = tiny_tokenizer()


def mixed_formats(name: str):
    """As a Q4_K_M file mixes them: v and down in a wider format than the rest (legacy blocks of 32 fit
    the tiny model's 64-wide rows)."""
    return block_format(T.Q5_1 if "v_proj" in name or "down_proj" in name else T.Q4_0)


def quantized_target(fmt_of=mixed_formats, **overrides):
    return quantize_random_(tiny_target(dtype=torch.float32, **overrides), fmt_of, scale=8.0)


def dequantized_copy(model):
    """The same model with every quantized weight dequantized into an ordinary float layer."""
    plain = tiny_target(dtype=torch.float32)
    for name, module in model.named_modules():
        if isinstance(getattr(module, "weight", None), QuantizedWeight) and name != "lm_head":
            plain.get_submodule(name).weight.copy_(module.weight.dequantize())
    return plain.fuse_projections()


def test_logits_equal_the_dequantized_model():
    model = quantized_target()
    ids, positions = torch.randint(0, 96, (1, 20)), torch.arange(20)
    with torch.no_grad():
        logits, _ = model(ids, positions, model.new_cache(1, 32))
        reference, _ = dequantized_copy(model)(ids, positions, model.new_cache(1, 32))
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)


def test_fused_projection_keeps_each_format_and_the_members_view_its_rows():
    model = quantized_target()
    attention = model.model.layers[0].self_attn
    weight, _ = attention.qkv
    assert [f.name for f in weight.formats] == ["Q4_0", "Q5_1"]  # q and k joined, v apart
    assert isinstance(attention.q_proj, QuantizedLinear)
    assert attention.k_proj.weight.part0.data_ptr() == weight.part0.data_ptr() + 64 * 36
    assert torch.equal(weight.dequantize()[64:96], attention.k_proj.weight.dequantize())


def test_weight_bytes_count_the_blocks():
    model = quantized_target()
    cfg = model.cfg
    blocks = sum(m.nbytes for m in model.modules() if isinstance(m, QuantizedWeight))  # the tied table once
    floats = sum(p.numel() * 4 for p in model.parameters())  # the norms
    assert model.weight_bytes() == blocks + floats
    assert model.parameter_count() == floats // 4 + sum(
        m.numel() for m in model.modules() if isinstance(m, QuantizedWeight))
    # a Q4_0 block: 18 bytes for 32 weights
    assert model.model.embed_tokens.weight.nbytes == cfg.vocab_size * cfg.hidden_size // 32 * 18


@pytest.mark.parametrize("block", [2, 4, 16])
def test_greedy_speculative_equals_plain(block):
    model = quantized_target()
    drafter = tiny_drafter(drafter_config(model.cfg), dtype=torch.float32)
    params = SamplingParams(max_new_tokens=40)
    ids = torch.randint(5, 90, (11,), generator=torch.Generator().manual_seed(block)).tolist()
    plain = Engine(model, TOKENIZER).complete(ids, params)
    spec = Engine(model, TOKENIZER, drafter, config=EngineConfig(spec="on", block_size=block)).complete(ids, params)
    assert spec.token_ids == plain.token_ids
    assert len(set(plain.token_ids)) > 5  # the random weights give a varied text, not one token repeated


def test_sampled_speculative_equals_plain_with_the_same_seed():
    model = quantized_target()
    drafter = tiny_drafter(drafter_config(model.cfg), dtype=torch.float32)
    params = SamplingParams(max_new_tokens=30, temperature=0.8, seed=7)
    plain = Engine(model, TOKENIZER).complete([5, 6, 7], params)
    spec = Engine(model, TOKENIZER, drafter, config=EngineConfig(spec="on", block_size=4)).complete([5, 6, 7], params)
    assert spec.token_ids == plain.token_ids


def test_k_quants_in_a_model_of_256_wide_rows():
    fmt_of = lambda name: block_format(T.Q6_K if "v_proj" in name else T.Q4_K)  # noqa: E731
    model = quantized_target(fmt_of, hidden_size=256, intermediate_size=512, num_attention_heads=16,
                             num_key_value_heads=4)
    assert [f.name for f in model.model.layers[0].self_attn.qkv[0].formats] == ["Q4_K", "Q6_K"]
    drafter = tiny_drafter(drafter_config(model.cfg), dtype=torch.float32)
    params = SamplingParams(max_new_tokens=24)
    plain = Engine(model, TOKENIZER).complete([5, 6, 7], params)
    spec = Engine(model, TOKENIZER, drafter, config=EngineConfig(spec="on", block_size=4)).complete([5, 6, 7], params)
    assert spec.token_ids == plain.token_ids
