"""The target's Triton kernels (models/rope_kernel.py, decode_kernel.py, layer_kernels.py) compute what
the torch forms do (on the CPU in Triton's interpreter: helpers.triton_device)."""

import pytest
import torch
from helpers import llama_config, triton_device

from deepflash.models import random_model

DEVICE = triton_device()


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_triton_kernels_match_torch_in_the_model(qk_norm, partial):
    """Prefill then decode steps with the kernels on and off: same logits and the same cache rows."""
    cfg = llama_config(model_type="qwen3" if qk_norm else "llama", partial_rotary_factor=partial,
                       num_hidden_layers=2)
    assert cfg.qk_norm == qk_norm
    models = [random_model(cfg, DEVICE, torch.float32, std=0.2) for _ in range(2)]
    models[1].use_kernels("triton")
    caches = [m.new_cache(2, 32) for m in models]
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    outs = [m(ids, torch.arange(12, device=DEVICE), c, 12)[0] for m, c in zip(models, caches)]
    for pos in range(12, 15):
        step = ids[:, pos - 12 : pos - 11]
        positions = torch.tensor([pos], device=DEVICE)
        outs += [m(step, positions, c, 16)[0] for m, c in zip(models, caches)]
    for torch_out, triton_out in zip(outs[::2], outs[1::2]):
        torch.testing.assert_close(triton_out, torch_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(caches[1].k[:, :, :, :15], caches[0].k[:, :, :, :15], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[1].v[:, :, :, :15], caches[0].v[:, :, :, :15])


@pytest.mark.parametrize("groups,dim", [(3, 64), (4, 128), (1, 16)])
@pytest.mark.parametrize("position,kv_len", [(0, 8), (70, 80), (300, 512), (599, 600)])
def test_decode_attention_matches_sdpa(groups, dim, position, kv_len):
    """One query per head over keys 0..position of a cache span kv_len (the rest of a CUDA-graph bucket
    is masked), against SDPA."""
    from deepflash.models.decode_kernel import decode_attention

    gen = torch.Generator().manual_seed(position)
    kv_heads, slots = 2, 640
    q = torch.randn(1, kv_heads * groups, 1, dim, generator=gen).to(DEVICE)
    k, v = (torch.randn(1, kv_heads, slots, dim, generator=gen).to(DEVICE) for _ in range(2))
    got = decode_attention(q, k, v, torch.tensor([position], device=DEVICE), kv_len)
    keys = k[:, :, : position + 1].repeat_interleave(groups, dim=1)
    values = v[:, :, : position + 1].repeat_interleave(groups, dim=1)
    want = torch.nn.functional.scaled_dot_product_attention(q, keys, values)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_decode_attention_spreads_short_spans_over_more_programs():
    from deepflash.models.decode_kernel import chunk_for

    assert chunk_for(512, 3) == 16  # 32 splits x 3 kv heads: 96 programs, not 6
    assert chunk_for(8192, 3) == 256 and chunk_for(8, 1) == 16


def test_engine_with_triton_attention_kernels_keeps_the_greedy_contract():
    """Greedy speculative == greedy plain with the target on its Triton kernels (on the GPU also under
    CUDA graphs); the plain reference runs on the torch kernels of the same shared target."""
    from helpers import drafter_config, tiny_drafter, tiny_tokenizer

    from deepflash.engine import Engine
    from deepflash.models import materialize
    from deepflash.sampling import SamplingParams

    target = random_model(llama_config(), DEVICE, torch.float32, std=0.2)
    drafter = materialize(tiny_drafter(drafter_config(target.cfg), dtype=torch.float32).to(DEVICE), DEVICE)
    tokenizer = tiny_tokenizer()
    ids = torch.randint(5, 90, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(max_new_tokens=24)
    spec = Engine(target, tokenizer, drafter, spec="on", target_kernels="triton").complete(ids, params)
    plain = Engine(target, tokenizer).complete(ids, params)
    assert target.model.layers[0].self_attn.kernels == "torch"  # the last request's engine set it
    assert spec.token_ids == plain.token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_kernels_match_torch(dtype):
    """add_rms_norm and silu_mul against the torch forms, on widths that are not powers of two."""
    from deepflash.models.layer_kernels import add_rms_norm, silu_mul

    gen = torch.Generator().manual_seed(5)
    x, y = (torch.randn(3, 2, 576, generator=gen).to(DEVICE, dtype) for _ in range(2))
    weight = (torch.rand(576, generator=gen) + 0.5).to(DEVICE, dtype)
    total, normed = add_rms_norm(x, y, weight, 1e-5)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(total, x + y)
    torch.testing.assert_close(normed, torch.nn.functional.rms_norm(x + y, (576,), weight, 1e-5), **tol)
    gate_up = torch.randn(4, 2 * 1536, generator=gen).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(gate_up), torch.nn.functional.silu(gate) * up, **tol)
