"""The target forwards' attention mask (layers.forward_mask): the values of the mask it replaced, and a
peak the memory plan counts."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_target
from torch.profiler import ProfilerActivity, profile

from deepflash.engine.config import EngineConfig
from deepflash.engine.memory import plan_memory
from deepflash.models.layers import CAUSAL, attention, fold_mask, folded_mask_bytes, forward_mask


def reference_mask(positions, kv_len, key_mask, groups, dtype):
    """The mask forward_mask built before it was folded in place: boolean causal mask, repeated per group,
    negated into an additive one."""
    mask = torch.arange(kv_len)[None, :] <= positions[:, None]
    if key_mask is not None:
        pad_query = ~key_mask[:, positions]
        mask = (mask[None] & (key_mask[:, None, :kv_len] | pad_query[:, :, None]))[:, None]
    if groups > 1:
        mask = mask.repeat(groups, 1) if mask.dim() == 2 else mask.repeat(1, 1, groups, 1)
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))


# (first position, queries, kv_len): a decode token, a verify block and prefill pieces, ending at kv_len - 1 or
# below it in a KV bucket, from position 0 in a bucket too
STEPS = [(37, 1, 64), (37, 1, 256), (40, 8, 48), (40, 8, 256), (0, 16, 256), (64, 64, 128), (128, 64, 256)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("start,queries,kv_len", STEPS)
def test_forward_mask_has_the_values_of_the_repeated_mask(start, queries, kv_len, groups, dtype):
    positions = torch.arange(start, start + queries)
    mask = forward_mask(positions, kv_len, None, groups, dtype)
    assert mask.dtype == dtype and mask.is_contiguous()
    assert torch.equal(mask, reference_mask(positions, kv_len, None, groups, dtype))


def test_forward_mask_of_a_whole_key_range_is_causal():
    assert forward_mask(torch.arange(16), 16, None, 4, torch.bfloat16) is CAUSAL


@pytest.mark.parametrize("start,queries", [(0, 6), (6, 1), (3, 3)])
def test_forward_mask_with_left_padding_has_the_repeated_mask_values(start, queries):
    key_mask = torch.ones(3, 9, dtype=torch.bool)
    key_mask[0, :4] = key_mask[1, :1] = False
    positions = torch.arange(start, start + queries)
    mask = forward_mask(positions, 9, key_mask, 4, torch.bfloat16)
    assert torch.equal(mask, reference_mask(positions, 9, key_mask, 4, torch.bfloat16))


@pytest.mark.parametrize("shape", [(5, 11), (3, 1, 5, 11)])
def test_fold_mask_has_the_repeated_mask_values(shape):
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(0)) < 0.6
    repeated = mask.repeat(3, 1) if mask.dim() == 2 else mask.repeat(1, 1, 3, 1)
    expected = torch.zeros(repeated.shape).masked_fill_(~repeated, float("-inf"))
    assert torch.equal(fold_mask(mask, 3, torch.float32), expected)


@pytest.mark.parametrize("start,queries,kv_len", [(40, 8, 256), (128, 64, 256), (37, 1, 64)])
def test_attention_with_the_folded_mask_is_unchanged(start, queries, kv_len):
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim = 8, 2, 16
    q = torch.randn(1, heads, queries, dim, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, kv_heads, kv_len, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    positions = torch.arange(start, start + queries)
    out = attention(q, k, v, forward_mask(positions, kv_len, None, heads // kv_heads, q.dtype))
    assert torch.equal(out, attention(q, k, v, reference_mask(positions, kv_len, None, heads // kv_heads, q.dtype)))
    # and the attention it stands for: each query head over its K/V head's keys up to its position
    visible = torch.arange(kv_len)[None, :] <= positions[:, None]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1), attn_mask=visible)
    torch.testing.assert_close(out, expected)


def peak_bytes(build) -> int:
    """Peak CPU bytes allocated while `build` runs, from the profiler's per-op allocations and frees."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        kept = build()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    del kept
    return peak


def test_the_memory_plan_counts_the_prefill_mask():
    target = tiny_target(dtype=torch.bfloat16, num_attention_heads=8, num_key_value_heads=2)
    groups, chunk, max_ctx = 4, 64, 1024
    config = EngineConfig(prefill_chunk=chunk, block_size=8)
    positions = torch.arange(max_ctx - 2 * chunk, max_ctx - chunk)  # a piece in the last KV bucket

    def peak(kv_len: int) -> int:
        return peak_bytes(lambda: forward_mask(positions, kv_len, None, groups, torch.bfloat16))

    assert peak(max_ctx) == folded_mask_bytes(chunk, max_ctx, groups, 2)
    old = peak_bytes(lambda: reference_mask(positions, max_ctx, None, groups, torch.bfloat16))
    assert old >= chunk * max_ctx * 4 * groups  # the repeated bool, its negation and the additive mask
    workspace = plan_memory(target, None, max_ctx, config).parts["workspace"]
    deeper = plan_memory(target, None, 2 * max_ctx, config).parts["workspace"]
    assert peak(max_ctx) < workspace
    assert deeper - workspace == peak(2 * max_ctx) - peak(max_ctx)  # each token of depth counted in full
