"""One Triton kernel for what an attention layer does between its q/k/v projection and attention:
optional per-head q/k RMSNorm (Qwen3), rotary embedding of q and k, and the cache write of k and v.

The torch form (llama.Attention) runs these as 5-8 small kernels per layer: a decode step of the
SmolLM2-135M-shaped target spent 263 of its 1412 device microseconds in the rope multiplies, the roll
and the two cache index_copies (H200 profile). Here one program handles one head of
a tile of tokens (config.ROPE_TOKENS): it loads the head's rows of the fused projection output, normalises and rotates them in
float32 (rounding once, where the torch form rounds after every operation), and stores q in the
[B, H, T, D] layout attention reads without a copy, or k / v at their cache slot. Qwen3.5's gated attention
(models/qwen3_5.py) takes it too: offset norms, a partial rotary width, and q heads interleaved with their
output gates. Chosen per model (TargetModel.use_kernels; the default on CUDA); `TRITON_INTERPRET=1` runs it
on the CPU for the tests.
"""

from __future__ import annotations

import torch

from . import pdl
from .config import ROPE_TOKENS
from .triton_support import tl, triton


def rope_and_write(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, positions: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int,
                   q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                   eps: float = 0.0, tokens: int = ROPE_TOKENS, *, gated: bool = False,
                   offset: bool = False) -> torch.Tensor:
    """qkv [B, T, (H + 2 Hkv) * D] (the fused projection output), rope tables [T, rot] from Rotary,
    positions [T], caches [B, Hkv, S, D]. Writes rotated k and v at slot = position; returns rotated
    q [B, H, T, D]. q_norm / k_norm: per-head RMSNorm gains (both or neither), scaling by (1 + gain) where
    `offset` (Qwen3.5's). gated: each q head is followed by a gate of its width (Qwen3.5's gated
    attention: qkv [B, T, (2 H + 2 Hkv) * D]), which the kernel skips. tokens: per program."""
    b, t, width = qkv.shape
    dim = width // ((2 if gated else 1) * heads + 2 * kv_heads)
    rot = cos.shape[-1]
    if dim & (dim - 1) or rot % 2 or rot > dim:
        raise ValueError(f"head dim {dim} must be a power of two and the rotary width {rot} even, at most it")
    qkv = qkv.contiguous()
    q = torch.empty((b, heads, t, dim), dtype=qkv.dtype, device=qkv.device)
    norm = q_norm is not None
    dependent = pdl.dependent(qkv.device)  # a programmatic dependent launch (pdl.py)
    _rope_and_write[(b * triton.cdiv(t, tokens), heads + 2 * kv_heads)](
        qkv, cos.contiguous(), signed_sin.contiguous(), positions, q, k_cache, v_cache,
        q_norm if norm else qkv, k_norm if norm else qkv, t, k_cache.shape[2], eps,
        HEADS=heads, KV_HEADS=kv_heads, DIM=dim, Q_STRIDE=(2 if gated else 1) * dim, ROT=rot, NORM=norm,
        OFFSET=offset, TOKENS=tokens, GDC=dependent, launch_pdl=dependent)
    return q


if triton is not None:

    @triton.jit
    def _rope_and_write(qkv, cos, sin, positions, q, k_cache, v_cache, q_gain, k_gain, T, S, eps,
                        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr, Q_STRIDE: tl.constexpr,
                        ROT: tl.constexpr, NORM: tl.constexpr, OFFSET: tl.constexpr, TOKENS: tl.constexpr,
                        GDC: tl.constexpr):
        if GDC:  # launched as a dependent (pdl.py): wait for the kernel before and its writes
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()  # a few rows per program: nothing long to wait for
        tiles = tl.cdiv(T, TOKENS)
        b = tl.program_id(0) // tiles
        t = (tl.program_id(0) % tiles) * TOKENS + tl.arange(0, TOKENS)  # the tile's tokens
        live = (t < T)[:, None]
        head = tl.program_id(1)  # q heads, then k heads, then v heads
        cols = tl.arange(0, DIM)
        # [TOKENS]: where the head's row of each token starts (q heads Q_STRIDE apart, then k and v heads)
        row = (b * T + t) * (HEADS * Q_STRIDE + 2 * KV_HEADS * DIM) + tl.where(
            head < HEADS, head * Q_STRIDE, HEADS * Q_STRIDE + (head - HEADS) * DIM)
        x = tl.load(qkv + row[:, None] + cols[None, :], mask=live, other=0.0).to(tl.float32)
        if head >= HEADS + KV_HEADS:  # v: stored as it is
            kv_head = head - HEADS - KV_HEADS
            pos = tl.load(positions + t, mask=t < T, other=0)
            tl.store(v_cache + ((b * KV_HEADS + kv_head) * S + pos[:, None]) * DIM + cols[None, :],
                     x.to(v_cache.dtype.element_ty), mask=live)
        else:
            # the partner of column i in rotate-half: i + rot/2 below rot/2, i - rot/2 up to rot
            partner = tl.where(cols < ROT // 2, cols + ROT // 2, cols - ROT // 2)
            partner = tl.where(cols < ROT, partner, cols)
            xp = tl.load(qkv + row[:, None] + partner[None, :], mask=live, other=0.0).to(tl.float32)
            if NORM:
                is_q = head < HEADS
                inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / DIM + eps)  # [TOKENS]
                gain = tl.where(is_q, tl.load(q_gain + cols), tl.load(k_gain + cols)).to(tl.float32)
                gain_p = tl.where(is_q, tl.load(q_gain + partner), tl.load(k_gain + partner)).to(tl.float32)
                if OFFSET:
                    gain, gain_p = 1.0 + gain, 1.0 + gain_p
                xp = xp * inv_rms[:, None] * gain_p[None, :]
                x = x * inv_rms[:, None] * gain[None, :]
            inside = live & (cols < ROT)[None, :]
            table = t[:, None] * ROT + cols[None, :]
            c = tl.load(cos + table, mask=inside, other=1.0).to(tl.float32)
            s = tl.load(sin + table, mask=inside, other=0.0).to(tl.float32)
            y = x * c + xp * s
            if head < HEADS:
                tl.store(q + ((b * HEADS + head) * T + t[:, None]) * DIM + cols[None, :], y.to(q.dtype.element_ty),
                         mask=live)
            else:
                kv_head = head - HEADS
                pos = tl.load(positions + t, mask=t < T, other=0)
                tl.store(k_cache + ((b * KV_HEADS + kv_head) * S + pos[:, None]) * DIM + cols[None, :],
                         y.to(k_cache.dtype.element_ty), mask=live)
