"""Qwen3.5's target kernels "triton": a verify step computes each token bit for bit as a decode step does
(on the CPU in Triton's interpreter: helpers.triton_device). Float32, since the interpreter truncates
float32 -> bf16 conversions where torch rounds them."""

import pytest
import torch
from helpers import hybrid_target, triton_device

from deepflash.models.gated_deltanet import GatedRMSNorm
from deepflash.models.qwen3_5 import OffsetRMSNorm

DEVICE = triton_device()
PROMPT, BLOCK, SPAN = 5, 16, 32  # prefill tokens, verify block, the steps' KV span (a graph bucket)


def two_layer_target(kind: str):
    """One DeltaNet and one full-attention layer on the kernels: every kind of layer, in little time. 32
    value heads: torch's transcendental elementwise ops on the CPU (softplus, sigmoid, silu) take SIMD code
    for runs of 32 floats (AVX512) and scalar code for the rest, which rounds apart (the DeltaNet's softplus
    of one token's 4 heads differed from the same values among 16 tokens' 64); every width a token gives
    them is then a multiple of 32. CUDA's compute every element alike."""
    types = ["linear_attention", "full_attention"]
    model = hybrid_target(kind, dtype=torch.float32, num_hidden_layers=2, layer_types=types,
                          linear_num_value_heads=32).to(DEVICE)
    return model.use_kernels("triton")


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_verify_block_computes_each_token_as_decode_steps(kind):
    """A 16-token forward's last hidden states (the final norm's output, the LM head's input) equal, bit for
    bit, those of the same tokens fed one at a time from the same cache state: what keeps greedy speculative
    output equal to plain output. The LM head itself is torch's GEMM (TargetModel.project), which on the CPU
    rounds a row by the number of rows."""
    model = two_layer_target(kind)
    ids = torch.randint(0, model.cfg.vocab_size, (1, PROMPT + BLOCK), generator=torch.Generator().manual_seed(3))
    ids = ids.to(DEVICE)
    caches = [model.new_cache(1, 64) for _ in range(2)]
    for cache in caches:
        model(ids[:, :PROMPT], torch.arange(PROMPT, device=DEVICE), cache, PROMPT, logits="none")
    last = len(model.model.layers) - 1
    positions = torch.arange(PROMPT, PROMPT + BLOCK, device=DEVICE)
    block = model(ids[:, PROMPT:], positions, caches[0], SPAN, capture=(last,), logits="none")[1]
    for i in range(BLOCK):
        alone = model(ids[:, PROMPT + i : PROMPT + i + 1], positions[i : i + 1], caches[1], SPAN, capture=(last,),
                      logits="none")[1]
        assert torch.equal(alone, block[:, i : i + 1]), i
    assert torch.equal(caches[0].state_all, caches[1].state_all)  # and the DeltaNet states they leave


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_kernels_compute_what_torch_does(kind):
    """Prefill and a verify block with the kernels on and off: the same logits up to rounding."""
    models = [two_layer_target(kind), two_layer_target(kind).use_kernels("torch")]
    ids = torch.randint(0, models[0].cfg.vocab_size, (1, PROMPT + 6), generator=torch.Generator().manual_seed(4))
    ids = ids.to(DEVICE)
    outs = []
    for model in models:
        cache = model.new_cache(1, 64)
        model(ids[:, :PROMPT], torch.arange(PROMPT, device=DEVICE), cache, PROMPT, logits="none")
        outs.append(model(ids[:, PROMPT:], torch.arange(PROMPT, PROMPT + 6, device=DEVICE), cache, SPAN)[0])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def test_row_norms_match_the_torch_forms():
    """layer_ops.row_norm's modes against OffsetRMSNorm and GatedRMSNorm in torch."""
    from deepflash.kernels import layer_ops

    gen = torch.Generator().manual_seed(5)
    x, gate = (torch.randn(3, 4, 24, generator=gen).to(DEVICE) for _ in range(2))
    weight = (0.5 * torch.randn(24, generator=gen)).to(DEVICE)
    offset, gated = OffsetRMSNorm(24, 1e-6).to(DEVICE), GatedRMSNorm(24, 1e-6).to(DEVICE)
    offset.weight.data.copy_(weight)
    gated.weight.data.copy_(weight)
    pairs = [(layer_ops.row_norm(x, layer_ops.OFFSET_RMS, 1e-6, weight), offset(x)),
             (layer_ops.row_norm(x, layer_ops.GATED_RMS, 1e-6, weight, gate), gated(x, gate))]
    order = torch.tensor([2, 0, 3, 1], device=DEVICE)  # the output's heads in another order (a GGUF file's)
    pairs.append((layer_ops.row_norm(x, layer_ops.GATED_RMS, 1e-6, weight, gate, order), gated(x, gate, order)))
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_quantized_moe_target_verifies_each_token_as_decode_steps():
    """A Qwen3.5-MoE target in bf16 with Q4_K_M blocks (bench quant's mix, widths of whole superblocks) on the
    kernels: the norms write their rows' int8 form for the integer-path projections, the shared expert's two
    input projections share one, the fused projections write each format's columns; a 16-token verify still
    leaves each token's final hidden state as one-token steps do, bit for bit."""
    from deepflash.bench.quant import format_of
    from deepflash.quant.random_weights import quantize_random_

    wide = dict(hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256, head_dim=64,
                linear_key_head_dim=64, linear_value_head_dim=64)
    model = hybrid_target("moe", dtype=torch.bfloat16, std=0.02, num_hidden_layers=2,
                          layer_types=["linear_attention", "full_attention"], **wide)
    model = quantize_random_(model, format_of("Q4_K_M", 2), seed=0).to(DEVICE).use_kernels("triton")
    assert model.model.layers[0].mlp.int8_buffers(torch.zeros(1, 1, 256, dtype=torch.bfloat16, device=DEVICE))
    ids = torch.randint(0, model.cfg.vocab_size, (1, PROMPT + BLOCK), generator=torch.Generator().manual_seed(5))
    ids = ids.to(DEVICE)
    caches = [model.new_cache(1, 64) for _ in range(2)]
    for cache in caches:
        model(ids[:, :PROMPT], torch.arange(PROMPT, device=DEVICE), cache, PROMPT, logits="none")
    positions = torch.arange(PROMPT, PROMPT + BLOCK, device=DEVICE)
    block = model(ids[:, PROMPT:], positions, caches[0], SPAN, capture=(1,), logits="none")[1]
    assert block.isfinite().all()
    for i in range(BLOCK):
        alone = model(ids[:, PROMPT + i : PROMPT + i + 1], positions[i : i + 1], caches[1], SPAN, capture=(1,),
                      logits="none")[1]
        assert torch.equal(alone, block[:, i : i + 1]), i


def test_a_gguf_targets_deltanet_norm_writes_the_output_projections_order(tmp_path, monkeypatch):
    """A Q8_0 qwen35 GGUF kept in blocks, on the kernels: the gated norm writes its heads in the file's column
    order of the output projection (GatedDeltaNet.out_order, layer_ops.row_norm's order), which then gathers
    nothing, and the logits are the dequantized load's."""
    from test_gguf_qwen35 import random_hf_model, write_gguf

    from deepflash.loading.targets import load_target

    monkeypatch.setenv("DEEPFLASH_CACHE", str(tmp_path / "cache"))
    write_gguf(tmp_path / "tiny.gguf", random_hf_model("dense"), "qwen35", q8_0=True)
    dense, _ = load_target(str(tmp_path / "tiny.gguf"), gguf_weights="dequantized")
    kept, _ = load_target(str(tmp_path / "tiny.gguf"), gguf_weights="quantized")
    kept = kept.to(DEVICE).use_kernels("triton")
    assert kept.model.layers[0].linear_attn.out_order is not None
    tokens = torch.randint(5, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = dense(tokens, torch.arange(12), dense.new_cache(1, 64))[0][:, -4:]
        cache = kept.new_cache(1, 64)
        kept(tokens[:, :8].to(DEVICE), torch.arange(8, device=DEVICE), cache, logits="none")
        logits = kept(tokens[:, 8:].to(DEVICE), torch.arange(8, 12, device=DEVICE), cache, 32)[0]
    torch.testing.assert_close(logits.cpu(), expected, rtol=1e-4, atol=1e-4)
