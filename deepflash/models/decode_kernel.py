"""Attention of a one-token decode step in Triton (split over the keys, then one reduction).

SDPA serves a decode step with cuDNN's flash kernel at 10-14 us per layer, 22% of the SmolLM2-135M-
shaped step and 9% of the Qwen3-8B-shaped one (profile_step.py, BENCHMARKS.md). Here each program takes
one key/value head's G query heads and one chunk of keys (chunk_for), and keeps a running softmax over
them in float32; a second kernel merges the chunks. Keys past the query's position (the rest of the
CUDA-graph bucket) are masked. Opt-in with rope_kernel.py (TargetModel.use_kernels);
`TRITON_INTERPRET=1` runs it on the CPU for the tests.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch's CPU builds do not bring Triton
    triton = None

MAX_CHUNK = 256  # keys per program at most
PROGRAMS = 128  # programs a step should spread over: about one per SM of an H100 / H200 (132)
TILE = 8192  # score x value elements a program holds per loop iteration (query rows x keys x head dim)


def chunk_for(kv_len: int, rows: int) -> int:
    """Keys per program: small enough that rows (batch x kv heads) x splits fill the GPU. With a fixed 256,
    a 512-key span of a 3-kv-head model ran on 6 programs (the fifth session's profile, at spans up to
    512, found the Triton target kernels slower than torch's)."""
    return max(16, min(MAX_CHUNK, triton.next_power_of_2(triton.cdiv(kv_len * rows, PROGRAMS))))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, position: torch.Tensor,
                     kv_len: int) -> torch.Tensor:
    """q [B, H, 1, D] (contiguous), caches [B, Hkv, S, D], position [1]: the query's position (keys
    0..position are visible), kv_len the cache span to consider. Returns [B, H, 1, D]."""
    b, heads, _, dim = q.shape
    kv_heads = k_cache.shape[1]
    groups = heads // kv_heads
    chunk = chunk_for(kv_len, b * kv_heads)
    splits = triton.cdiv(kv_len, chunk)
    group_pad = triton.next_power_of_2(groups)
    partial = torch.empty((b * kv_heads, splits, group_pad, dim + 2), dtype=torch.float32, device=q.device)
    block = min(chunk, max(16, TILE // (group_pad * dim)))  # keys per loop iteration
    _chunk[(b * kv_heads, splits)](q.contiguous(), k_cache, v_cache, position, partial, kv_len, k_cache.shape[2],
                                   1.0 / math.sqrt(dim), GROUPS=groups, GROUP_PAD=group_pad, DIM=dim, CHUNK=chunk,
                                   BLOCK=block)
    out = torch.empty_like(q)
    _merge[(b * kv_heads,)](partial, out, splits, GROUPS=groups, GROUP_PAD=group_pad, DIM=dim,
                            SPLIT_PAD=triton.next_power_of_2(splits))
    return out


if triton is not None:

    @triton.jit
    def _chunk(q, k_cache, v_cache, position, partial, kv_len, S, scale, GROUPS: tl.constexpr,
               GROUP_PAD: tl.constexpr, DIM: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        bh = tl.program_id(0)  # b * KV_HEADS + kv head
        split = tl.program_id(1)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM)
        rows = g < GROUPS
        # q [B, H, 1, D]: the kv head's query heads are consecutive, bh * GROUPS + g
        qv = tl.load(q + (bh * GROUPS + g)[:, None] * DIM + d[None, :], mask=rows[:, None], other=0.0)
        qv = qv.to(tl.float32) * scale
        last = tl.minimum(tl.load(position), kv_len - 1)  # keys 0..last are visible
        m = tl.full((GROUP_PAD,), -1e30, tl.float32)
        total = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, DIM), tl.float32)
        base = bh * S * DIM
        for start in range(0, CHUNK, BLOCK):
            n = split * CHUNK + start + tl.arange(0, BLOCK)
            seen = n <= last
            kv_offsets = base + n[:, None] * DIM + d[None, :]
            k = tl.load(k_cache + kv_offsets, mask=seen[:, None], other=0.0).to(tl.float32)
            s = tl.sum(qv[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, BLOCK]
            s = tl.where(seen[None, :], s, -1e30)
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.where(seen[None, :], tl.exp(s - m_new[:, None]), 0.0)
            keep = tl.exp(m - m_new)
            v = tl.load(v_cache + kv_offsets, mask=seen[:, None], other=0.0).to(tl.float32)
            acc = acc * keep[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            total = total * keep + tl.sum(p, axis=1)
            m = m_new
        out = partial + ((bh * tl.num_programs(1) + split) * GROUP_PAD + g) * (DIM + 2)
        tl.store(out[:, None] + d[None, :], acc)
        tl.store(out + DIM, m)
        tl.store(out + DIM + 1, total)

    @triton.jit
    def _merge(partial, out, splits, GROUPS: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr,
               SPLIT_PAD: tl.constexpr):
        bh = tl.program_id(0)
        sp = tl.arange(0, SPLIT_PAD)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM)
        live = sp < splits
        rows = (bh * splits + sp)[:, None] * GROUP_PAD + g[None, :]  # [SPLIT_PAD, GROUP_PAD]
        m = tl.load(partial + rows * (DIM + 2) + DIM, mask=live[:, None], other=-1e30)
        total = tl.load(partial + rows * (DIM + 2) + DIM + 1, mask=live[:, None], other=0.0)
        best = tl.max(m, axis=0)  # [GROUP_PAD]
        weight = tl.exp(m - best[None, :])  # chunks with no visible key carry total 0 and weight <= 1
        norm = tl.sum(total * weight, axis=0)
        acc = tl.load(partial + rows[:, :, None] * (DIM + 2) + d[None, None, :], mask=live[:, None, None], other=0.0)
        merged = tl.sum(acc * weight[:, :, None], axis=0) / norm[:, None]  # [GROUP_PAD, DIM]
        g_ok = g < GROUPS
        tl.store(out + (bh * GROUPS + g)[:, None] * DIM + d[None, :], merged.to(out.dtype.element_ty),
                 mask=g_ok[:, None])
