"""--quantize int8|int4: a Hugging Face checkpoint's matrices quantized at load into Q8_0 / Q4_1 blocks, byte for
byte as ggml's reference quantizer (the gguf package) writes them, running on the GGUF path: close logits, the
greedy contract, the memory plan counting the blocks, and a GGUF file refused."""

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize as reference
from helpers import drafter_config, save_tiny_model, tiny_drafter, tiny_tokenizer

from deepflash.engine.config import EngineConfig
from deepflash.engine.engine import Engine
from deepflash.engine.memory import plan_memory
from deepflash.engine.runtime import meta_models
from deepflash.engine.sampling import SamplingParams
from deepflash.errors import UserError
from deepflash.loading.targets import load_target
from deepflash.quant.gguf_blocks import dequantize
from deepflash.quant.quantize import quantize, quantize_format
from deepflash.quant.weight import QuantizedWeight


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_blocks_equal_the_gguf_reference_quantizer(kind):
    fmt = quantize_format(kind)
    for seed, scale in enumerate((0.01, 1.0, 300.0)):
        w = torch.randn(48, 256, generator=torch.Generator().manual_seed(seed)) * scale
        w[0, :32] = 0  # an all-zero block: a zero scale
        w[1, :32] = 5.0  # a constant block: a zero range for Q4_1
        expected = reference(w.numpy(), gguf.GGMLQuantizationType[fmt.name])
        assert np.array_equal(quantize(w, fmt).numpy(), expected)
        # each weight within half a step of its block's grid (Q8_0: amax / 127; Q4_1: range / 15), plus
        # the float16 rounding of the scale
        blocks = w.reshape(-1, 32)
        step = (blocks.abs().amax(-1) / 127 if kind == "int8" else (blocks.amax(-1) - blocks.amin(-1)) / 15)
        error = (dequantize(quantize(w, fmt), fmt) - w).reshape(-1, 32).abs().amax(-1)
        assert (error <= step * 0.51 + blocks.abs().amax(-1) * 2e-3).all()


# random weights are 4-bit quantization's worst case (no outliers to absorb the range; a random model's
# logits follow every weight): int4's logits only need to stay a clear echo of the float model's
@pytest.mark.parametrize("kind, cosine", [("int8", 0.999), ("int4", 0.85)])
def test_quantized_checkpoint_runs_close_to_float_with_the_greedy_contract(tmp_path, kind, cosine):
    folder = save_tiny_model(tmp_path / "model")
    dense, _ = load_target(str(folder))
    kept, _ = load_target(str(folder), quantize=kind)
    assert isinstance(kept.model.layers[0].self_attn.q_proj.weight, QuantizedWeight)
    assert kept.weight_bytes() < dense.weight_bytes() / 2
    ids = torch.randint(5, 90, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = dense(ids, torch.arange(16), dense.new_cache(1, 32))[0].flatten()
        b = kept(ids, torch.arange(16), kept.new_cache(1, 32))[0].flatten()
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > cosine
    drafter = tiny_drafter(drafter_config(kept.cfg), dtype=torch.float32)
    params = SamplingParams(max_new_tokens=24)
    plain = Engine(kept, tiny_tokenizer()).complete([5, 6, 7], params)
    spec = Engine(kept, tiny_tokenizer(), drafter, config=EngineConfig(spec="on", block_size=4)).complete([5, 6, 7],
                                                                                                          params)
    assert spec.token_ids == plain.token_ids
    config = EngineConfig(model=str(folder), no_draft=True, quantize=kind, max_ctx=64)
    assert plan_memory(meta_models(config)[0], None, 64, config).parts["target weights"] == kept.weight_bytes()


def test_quantize_refuses_a_gguf_file(tmp_path, monkeypatch):
    from test_weights import tiny_hf_llama, write_llama_gguf

    monkeypatch.setenv("DEEPFLASH_CACHE", str(tmp_path / "cache"))
    write_llama_gguf(tmp_path / "tiny.gguf", tiny_hf_llama())
    with pytest.raises(UserError, match="--quantize is for Hugging Face checkpoints"):
        load_target(str(tmp_path / "tiny.gguf"), quantize="int8")
