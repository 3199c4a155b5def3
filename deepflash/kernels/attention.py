"""Attention of decode and verify steps in Triton (split over the keys, then one reduction).

SDPA serves a decode step with cuDNN's flash kernel at 10-14 us per layer, 22% of the SmolLM2-135M-
shaped step and 9% of the Qwen3-8B-shaped one (profile_step.py, BENCHMARKS.md). Here each program takes
a tile of consecutive query positions (ROWS rows: positions x one key/value head's G query heads) and
one chunk of CHUNK keys; scores and weighted values are matrix products, and a running softmax in
float32 spans them; a second kernel merges the chunks, one program per query token, query head and
slice of the head dims. Keys past every row's position (the rest of the CUDA-graph bucket) are skipped.
Programs taking 4 query tokens one after another over the same keys made the verify step slower (6.5
against 5.0 ms at a 5.8K-token prompt, H200).

A query's result does not depend on the cache span or on the other queries of its step, bit for bit:
the chunks are fixed, each query runs the same instructions of one binary (T is not specialised) in
the same row of its tile (tiles are aligned to positions), and the merge walks the chunks in fixed
tiles whose width its position alone sets, and reads none past it. So a verify step computes each
of its tokens exactly as a one-token decode step at that position would, and greedy speculative
decoding keeps matching plain decoding under bf16 rounding (with SDPA for the verify and this kernel
for plain steps it does not: 1 of 6 outputs equal on an H200).

Chosen with kernels/rope.py (TargetModel.use_kernels); `TRITON_INTERPRET=1` runs it on the CPU for the
tests.
"""

from __future__ import annotations

import math

import torch

from . import pdl
from .triton_support import INTERPRETED, tl, triton

MAX_QUERIES = 64  # steps of at most this many tokens (decode, verify blocks) use the kernel; prefill uses SDPA
CHUNK = 32  # keys per program: a 512-key span of a 3-kv-head model spreads over 16 programs per tile
# Query rows per program, tl.dot's least: a tile of ROWS // GROUP_PAD consecutive positions, each with
# the kv head's query heads (padded to a power of two). The scores and the weighted values are matrix
# products on the tensor cores: a program per query token, summing products in registers, took 122 us
# per layer for a 16-token verify at a 5.8K-token prompt against 12 for one token (H200 profile at
# depth), and 16 rows so summed saved only 13% of it. Tiles are aligned to positions (a
# position's row is position % tokens per tile, whatever the step), since a matrix product's row may
# round by where it sits in the tile (numpy's does, in the interpreter).
ROWS = 16
# The merge reduces a query's chunks in tiles, in a program per (query token, query head, MERGE_DIMS head
# dims). Its tiles run one after another, so few and wide: with 32-chunk tiles in one program per (token, kv
# head), plain decode at a 5.8K-token prompt ran 603 tok/s, with 256-chunk ones 771 (SmolLM2-135M on an
# H200); 64-chunk tiles cost plain decode 8% at a 5849-token prompt (three tiles in turn). But a wide tile's
# masked lanes cost a short span's rows their work too: a 16-token verify's merges took 96 us a step against
# 52 for one token. So a
# row's tile width follows the chunks it sees (its own position, never the step or the cache span, so a
# position is merged the same way in every step): the first width of MERGE_TILES that holds them all, the
# last one's tiles in turn beyond. Against 256 for every row: a spec step's device time -2.4%, plain decode +1.9%
# on the embedded pair (H200).
MERGE_TILES = (16, 64, 256)
# Head dims per merge program: at 64 a spec step's device time -1.8% against 16 (32: -1.5%), short prompts' plain
# decode -0.3 to -0.8%, but the 5849-token prompt's -3.3% (its rows take the 256-chunk tiles). 16 on the
# 256-chunk tiles alone gave that prompt its plain decode back (1285.8 tok/s) and cost its speculative decode 9%
# (4539 tok/s against 4975 with 64): one width for every tile.
MERGE_DIMS = 64
# warps per merge program (Triton's default); 1, 2 and 8 measured no faster
MERGE_WARPS = 4


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     kv_len: int, gate: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, T, D], caches [B, Hkv, S, D], positions [T]: each query's position (keys 0..position
    are visible; a step's positions are consecutive), kv_len the cache span to consider. Returns
    [B, H, T, D] (a view of [B, T, H, D]). gate [B, T, H, D], any strides but a unit one over D: the output
    times sigmoid(gate), each rounded to q's dtype as torch's ops round (Qwen3.5's gated attention)."""
    b, heads, t, dim = q.shape
    kv_heads = k_cache.shape[1]
    groups = heads // kv_heads
    splits = triton.cdiv(kv_len, CHUNK)
    group_pad = triton.next_power_of_2(groups)
    tokens = max(1, ROWS // group_pad)  # per tile
    # tiles start at multiples of `tokens`: t tokens from any position fall in at most this many
    tiles = (t + tokens - 2) // tokens + 1
    partial = torch.empty((b * kv_heads * t, splits, group_pad, dim + 2), dtype=torch.float32, device=q.device)
    dependent = pdl.dependent(q.device)  # programmatic dependent launches (pdl.py)
    _chunk[(b * kv_heads, tiles, splits)](
        q.contiguous(), k_cache, v_cache, positions, partial, t, kv_len, k_cache.shape[2], 1.0 / math.sqrt(dim),
        GROUPS=groups, GROUP_PAD=group_pad, TOKENS=tokens, DIM=dim, CHUNK=CHUNK, UPCAST=INTERPRETED, GDC=dependent,
        enable_fp_fusion=False, launch_pdl=dependent)
    # written as [B, T, H, D], what the output projection reads: the caller's transpose back is then free,
    # where from [B, H, T, D] a verify step copied it in every layer (30 copy kernels per SmolLM2 step)
    out = torch.empty((b, t, heads, dim), dtype=q.dtype, device=q.device)
    # the merge's widest tiles loop to the whole cache's count and skip those past a row's chunks: a constant
    # bound (Triton's interpreter, which the CPU tests use, cannot loop to a runtime bound under numpy 2), one
    # binary per cache
    dims = min(MERGE_DIMS, dim)
    narrow, middle, wide = MERGE_TILES
    gated = gate is not None
    gate_strides = gate.stride()[:3] if gated else (0, 0, 0)
    assert not gated or gate.stride(-1) == 1, gate.stride()
    _merge[(b * kv_heads * t * groups, dim // dims)](partial, positions, out, gate if gated else out, *gate_strides,
                                                      t, kv_heads, splits, GATED=gated, GROUPS=groups,
                                                      GROUP_PAD=group_pad, DIM=dim, DIMS=dims, CHUNK=CHUNK,
                                                      NARROW=narrow, MIDDLE=middle, WIDE=wide,
                                                      TILES=triton.cdiv(k_cache.shape[2], CHUNK * wide),
                                                      GDC=dependent, enable_fp_fusion=False, launch_pdl=dependent,
                                                      num_warps=MERGE_WARPS)
    return out.transpose(1, 2)


if triton is not None:

    # T is never specialised (Triton would compile T == 1 apart), and no FMA contraction (it may differ
    # between binaries): one computation for every step size
    @triton.jit(do_not_specialize=["T"])
    def _chunk(q, k_cache, v_cache, positions, partial, T, kv_len, S, scale, GROUPS: tl.constexpr,
               GROUP_PAD: tl.constexpr, TOKENS: tl.constexpr, DIM: tl.constexpr, CHUNK: tl.constexpr,
               UPCAST: tl.constexpr, GDC: tl.constexpr):
        if GDC:  # launched as a dependent (pdl.py): wait for the kernel before and its writes
            tl.extra.cuda.gdc_wait()
        bh = tl.program_id(0)  # b * KV_HEADS + kv head
        split = tl.program_id(2)
        first = tl.load(positions).to(tl.int32)  # positions in int32 from here: no 64-bit reductions
        r = tl.arange(0, TOKENS * GROUP_PAD)  # rows: the tile's positions, each with the kv head's query heads
        token = (first // TOKENS + tl.program_id(1)) * TOKENS + r // GROUP_PAD - first
        g = r % GROUP_PAD
        live = (token >= 0) & (token < T) & (g < GROUPS)
        d = tl.arange(0, DIM)
        # q [B, H, T, D]: the kv head's query heads are consecutive, bh * GROUPS + g
        qv = tl.load(q + ((bh * GROUPS + g)[:, None] * T + token[:, None]) * DIM + d[None, :], mask=live[:, None],
                     other=0.0)
        # keys 0..last are visible to a row; a dead row sees none
        own = tl.load(positions + token, mask=live, other=0).to(tl.int32)
        last = tl.where(live, tl.minimum(own, kv_len - 1), -1)
        seen_by_any = tl.max(last, axis=0)
        m = tl.full((TOKENS * GROUP_PAD,), -1e30, tl.float32)
        total = tl.zeros((TOKENS * GROUP_PAD,), tl.float32)
        acc = tl.zeros((TOKENS * GROUP_PAD, DIM), tl.float32)
        # keys past every row's position (the rest of the bucket: on average a quarter of it) are skipped;
        # where some row sees them, a row that does not keeps m, total and acc exactly (its scores are
        # -1e30, its weights 0 and its rescale exp(0) = 1), as if they were skipped
        if split * CHUNK <= seen_by_any:
            n = split * CHUNK + tl.arange(0, CHUNK)
            kv_offsets = bh * S * DIM + n[:, None] * DIM + d[None, :]
            # keys no row sees are never loaded: a slot not written yet may hold a NaN, and 0 x NaN is NaN
            written = (n <= seen_by_any)[:, None]
            k = tl.load(k_cache + kv_offsets, mask=written, other=0.0)
            v = tl.load(v_cache + kv_offsets, mask=written, other=0.0)
            if UPCAST:  # Triton's interpreter (the CPU tests) multiplies bfloat16 matrices as if their
                # bits were integers (tl.dot off by 1e10 against torch): there the products run in float32
                qv, k, v = qv.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
            # float32 caches (the tests): products and sums in float32, where tf32 would round the inputs
            s = tl.dot(qv, tl.trans(k), input_precision="ieee") * scale  # [rows, CHUNK]
            seen = n[None, :] <= last[:, None]
            s = tl.where(seen, s, -1e30)
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.where(seen, tl.exp(s - m_new[:, None]), 0.0)
            keep = tl.exp(m - m_new)
            # the weights in the values' dtype for the product, as flash attention does
            acc = acc * keep[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            total = total * keep + tl.sum(p, axis=1)
            m = m_new
        if GDC:  # the merge may be placed now (it waits for this kernel's end before it reads)
            tl.extra.cuda.gdc_launch_dependents()
        out = partial + (((bh * T + token) * tl.num_programs(2) + split) * GROUP_PAD + g) * (DIM + 2)
        tl.store(out[:, None] + d[None, :], acc, mask=live[:, None])
        tl.store(out + DIM, m, mask=live)
        tl.store(out + DIM + 1, total, mask=live)

    @triton.jit
    def _merge_tiles(partial, row, g, d, seen, splits, WIDTH: tl.constexpr, TILES: tl.constexpr,
                     GROUP_PAD: tl.constexpr, DIM: tl.constexpr, DIMS: tl.constexpr):
        """(softmax normaliser, weighted values [DIMS]) of a row's first `seen` chunks, WIDTH at a time in a
        fixed order; a tile past them is skipped, and one past the query's position holds m = -1e30, total 0
        and acc 0, which leave best, norm and acc exactly as they were."""
        best = -1e30
        norm = 0.0
        acc = tl.zeros((DIMS,), tl.float32)
        for tile in range(TILES):
            if tile * WIDTH < seen:
                sp = tile * WIDTH + tl.arange(0, WIDTH)
                live = sp < seen
                at = ((row * splits + sp) * GROUP_PAD + g) * (DIM + 2)  # [WIDTH]
                m = tl.load(partial + at + DIM, mask=live, other=-1e30)
                total = tl.load(partial + at + DIM + 1, mask=live, other=0.0)
                part = tl.load(partial + at[:, None] + d[None, :], mask=live[:, None], other=0.0)
                best_new = tl.maximum(best, tl.max(m, axis=0))
                weight = tl.exp(m - best_new)
                keep = tl.exp(best - best_new)
                norm = norm * keep + tl.sum(total * weight, axis=0)
                acc = acc * keep + tl.sum(part * weight[:, None], axis=0)
                best = best_new
        return norm, acc

    @triton.jit(do_not_specialize=["T", "gate_batch"])
    def _merge(partial, positions, out, gate, gate_batch, gate_token, gate_head, T, kv_heads, splits,
               GATED: tl.constexpr, GROUPS: tl.constexpr, GROUP_PAD: tl.constexpr,
               DIM: tl.constexpr, DIMS: tl.constexpr, CHUNK: tl.constexpr, NARROW: tl.constexpr,
               MIDDLE: tl.constexpr, WIDE: tl.constexpr, TILES: tl.constexpr, GDC: tl.constexpr):
        if GDC:  # launched as a dependent (pdl.py): wait for the chunks and their writes
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0) // GROUPS  # (b * KV_HEADS + kv head) * T + query token
        g = tl.program_id(0) % GROUPS
        bh = row // T
        token = row % T
        b = bh // kv_heads
        head = (bh % kv_heads) * GROUPS + g
        d = tl.program_id(1) * DIMS + tl.arange(0, DIMS)
        # the chunks this row sees (keys 0..its position, as in _chunk): its position alone sets the tiles
        seen = tl.minimum(tl.load(positions + token).to(tl.int32) // CHUNK + 1, splits)
        if seen <= NARROW:
            norm, acc = _merge_tiles(partial, row, g, d, seen, splits, NARROW, 1, GROUP_PAD, DIM, DIMS)
        elif seen <= MIDDLE:
            norm, acc = _merge_tiles(partial, row, g, d, seen, splits, MIDDLE, 1, GROUP_PAD, DIM, DIMS)
        else:
            norm, acc = _merge_tiles(partial, row, g, d, seen, splits, WIDE, TILES, GROUP_PAD, DIM, DIMS)
        if GDC:
            tl.extra.cuda.gdc_launch_dependents()
        o = (acc / norm).to(out.dtype.element_ty)
        if GATED:  # o * sigmoid(gate), rounded as torch rounds each
            x = tl.load(gate + b * gate_batch + token * gate_token + head * gate_head + d).to(tl.float32)
            o = (o.to(tl.float32) * (1.0 / (1.0 + tl.exp(-x))).to(out.dtype.element_ty).to(tl.float32))
        tl.store(out + ((b * T + token) * kv_heads * GROUPS + head) * DIM + d, o.to(out.dtype.element_ty))
