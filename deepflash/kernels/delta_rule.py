"""The gated delta rule of a decode or verify step (1-16 tokens) in Triton, with the deltas a rollback needs.

The recurrence of models/delta_rule.py, token by token in one launch:

    S_t = exp(g_t) S_{t-1} + k_t delta_t^T,   delta_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),   out_t = S_t^T q_t

A verify step must compute each token exactly as the decode step that would have computed it, or greedy
speculative output leaves plain decoding's in bf16. fla's fused recurrent kernel is token by token too,
but returns no deltas, which the capture rollback (hybrid_cache.py) needs; torch's chunked form returns
them, but rounds apart from any decode step. Here a program owns one (batch, head) and a block of
BLOCK_V state columns: it holds that [Dk, BLOCK_V] slice of the state in registers, in float32, and
walks the tokens in order. A token's arithmetic is the same code on the state the program holds, with a
reduction over Dk in an order fixed by the tile: it depends neither on the number of tokens nor on the
other tokens' values beyond the state they left. The number of tokens and the strides that follow it
(the batch strides) are never specialised, so 1 and 16 tokens run one binary, and FMA contraction is
off (attention.py: it may differ between binaries); a decode step and a verify step computing the
same token from the same state then give the same bits.

Outputs, deltas and the final state are float32. The state columns of a head split into programs, not
its Dk rows: each program's reductions stay whole and in registers. The tile is fla's, not yet measured
here on a GPU. Chosen with the target's other Triton kernels (TargetModel.use_kernels);
`TRITON_INTERPRET=1` runs it on the CPU for the tests (models/delta_rule.py recurrent_form is the reference).
"""

from __future__ import annotations

import torch

from .triton_support import tl, triton

MAX_TOKENS = 16  # a verify step's block; longer runs (prefill) take the chunked forms
# fla's fused recurrent kernel's tile, which decode steps ran before: 8 state columns a program (16 programs
# for a 128-wide head) in one warp, whose reductions over Dk stay within the warp (shuffles, no shared memory)
BLOCK_V = 8
NUM_WARPS = 1
MAX_KEY_DIM = 256  # the state slice [Dk, BLOCK_V] lives in registers: 64 float32 a thread at Dk 256


def fits(state: torch.Tensor, tokens: int) -> bool:
    """Whether a run of `tokens` from `state` [B, H, Dk, Dv] goes through the kernel (else the torch or fla
    forms). Its inputs come in the state's dtype, so the state alone decides: float32 (the kernel's
    arithmetic), contiguous, and key heads no wider than the register tile takes."""
    return (tokens <= MAX_TOKENS and state.dtype == torch.float32 and state.is_contiguous()
            and state.shape[-2] <= MAX_KEY_DIM)


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """recurrent_form's computation: q, k [B, H, T, Dk] (L2-normalised, q scaled by Dk^-0.5), v [B, H, T, Dv],
    g, beta [B, H, T], state [B, H, Dk, Dv], all float32, any strides. Returns out [B, H, T, Dv] (a view of
    [B, T, H, Dv], the layout the layer reads back), the final state and the deltas [B, H, T, Dv]."""
    b, heads, tokens, key_dim = k.shape
    value_dim = v.shape[-1]
    assert fits(state, tokens) and q.dtype == k.dtype == v.dtype == g.dtype == beta.dtype == state.dtype, (
        tokens, state.dtype, state.shape, q.dtype)
    q, k, v = (_rows(x) for x in (q, k, v))
    out = torch.empty((b, tokens, heads, value_dim), dtype=torch.float32, device=state.device)
    deltas = torch.empty((b, heads, tokens, value_dim), dtype=torch.float32, device=state.device)
    final = torch.empty_like(state)
    block_v = min(BLOCK_V, triton.next_power_of_2(value_dim))
    _recurrent[(b * heads, triton.cdiv(value_dim, block_v))](
        q, k, v, g, beta, state, out, deltas, final, tokens, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        *g.stride(), *beta.stride(), HEADS=heads, DK=key_dim, DV=value_dim,
        BLOCK_K=triton.next_power_of_2(key_dim), BLOCK_V=block_v, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out.transpose(1, 2), final, deltas


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x with contiguous rows (the kernel's loads walk the last dim with stride 1); other strides are passed."""
    return x if x.stride(-1) == 1 else x.contiguous()


if triton is not None:

    @triton.jit(do_not_specialize=["tokens", "q_batch", "k_batch", "v_batch", "g_batch", "beta_batch"])
    def _recurrent(q, k, v, g, beta, start, out, deltas, final, tokens, q_batch, q_head, q_token, k_batch, k_head,
                   k_token, v_batch, v_head, v_token, g_batch, g_head, g_token, beta_batch, beta_head, beta_token,
                   HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_V: tl.constexpr):
        bh = tl.program_id(0).to(tl.int64)  # b * HEADS + h
        b, h = bh // HEADS, bh % HEADS
        rows = tl.arange(0, BLOCK_K)  # the state's Dk rows, padded to a power of two with zeros
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        row_in, col_in = rows < DK, cols < DV
        tile = bh * DK * DV + rows[:, None] * DV + cols[None, :]
        inside = row_in[:, None] & col_in[None, :]
        s = tl.load(start + tile, mask=inside, other=0.0)
        for t in range(tokens):
            k_t = tl.load(k + b * k_batch + h * k_head + t * k_token + rows, mask=row_in, other=0.0)
            q_t = tl.load(q + b * q_batch + h * q_head + t * q_token + rows, mask=row_in, other=0.0)
            v_t = tl.load(v + b * v_batch + h * v_head + t * v_token + cols, mask=col_in, other=0.0)
            g_t = tl.load(g + b * g_batch + h * g_head + t * g_token)
            beta_t = tl.load(beta + b * beta_batch + h * beta_head + t * beta_token)
            s = s * tl.exp(g_t)  # g = -inf (a sequence's first decode token) forgets the state: exp = 0
            delta = beta_t * (v_t - tl.sum(k_t[:, None] * s, axis=0))
            s = s + k_t[:, None] * delta[None, :]
            tl.store(out + ((b * tokens + t) * HEADS + h) * DV + cols, tl.sum(q_t[:, None] * s, axis=0), mask=col_in)
            tl.store(deltas + (bh * tokens + t) * DV + cols, delta, mask=col_in)
        tl.store(final + tile, s, mask=inside)
