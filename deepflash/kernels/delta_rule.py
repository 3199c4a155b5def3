"""The gated delta rule of a decode or verify step (1-16 tokens) in Triton, and the replay that rolls one back.

The recurrence of models/delta_rule.py, token by token in one launch:

    S_t = exp(g_t) S_{t-1} + k_t delta_t^T,   delta_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),   out_t = S_t^T q_t

A verify step must compute each token exactly as the decode step that would have computed it, or greedy
speculative output leaves plain decoding's in bf16; so must the rollback after it (hybrid_cache.py), which
leaves the state as if only the first n tokens had been fed. Torch's chunked form and the closed-form
prefix state (delta_rule.state_after_prefix) round apart from any decode step, and fla's fused recurrent
kernel runs another binary. Here a program owns one (batch, head) and a block of BLOCK_V state columns:
it holds that [Dk, BLOCK_V] slice of the state in registers, in float32, and walks the tokens in order. A
token's arithmetic is the same code on the state the program holds, with a reduction over Dk in an order
fixed by the tile: it depends neither on the number of tokens nor on the other tokens' values beyond the
state they left. The number of tokens, the strides that follow it (the batch strides) and the replay's
arguments are never specialised, so 1 and 16 tokens and a replay run one binary, and FMA contraction is
off (attention.py: it may differ between binaries); a decode step, a verify step and a replay computing
the same token from the same state then give the same bits.

The replay (`state_after`) is the same launch over a recorded run's inputs from its start state, of which
only the first n tokens are applied: n is read on the device, so a rollback needs no host sync and one
CUDA graph serves every n.

The final state is float32, the outputs float32 or the model's dtype (the layer's next kernel reads them so).
The q/k heads may be fewer than the value heads, each serving a group of them (kernels/delta_inputs.py stores
them once), and the final state may overwrite the start state in place. The state columns of a head split into
programs, not its Dk rows: each program's reductions stay whole and in registers. The tile is fla's, not yet
measured here on a GPU. Chosen for the DeltaNet layers with the target's kernels (TargetModel.use_kernels; Qwen3.5
takes it under "auto" on CUDA); `TRITON_INTERPRET=1` runs it on the CPU for the tests (models/delta_rule.py
recurrent_form is the reference).
"""

from __future__ import annotations

import torch

from . import pdl
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
              state: torch.Tensor, count: torch.Tensor | None = None, *, out_dtype: torch.dtype = torch.float32,
              final: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """recurrent_form's computation: q, k [B, Hk, T, Dk] (L2-normalised, q scaled by Dk^-0.5), v [B, H, T, Dv],
    g, beta [B, H, T], state [B, H, Dk, Dv], all float32, any strides. Hk divides H: each q/k head serves H / Hk
    consecutive value heads (delta_inputs.py stores them once). Returns out [B, H, T, Dv] in out_dtype (a view
    of [B, T, H, Dv], the layout the layer reads back) and the final state, written to `final` where given (it
    may be `state` itself: each program reads its slice of the state before it writes it). count, a 0-dim
    int64 tensor on the state's device: apply only the first `count` tokens (state_after's replay); None: all
    of them."""
    b, heads, tokens, value_dim = v.shape
    key_heads, key_dim = k.shape[1], k.shape[-1]
    assert fits(state, tokens) and q.dtype == k.dtype == v.dtype == g.dtype == beta.dtype == state.dtype, (
        tokens, state.dtype, state.shape, q.dtype)
    assert heads % key_heads == 0 and q.shape[1] == key_heads, (q.shape, k.shape, v.shape)
    q, k, v = (_rows(x) for x in (q, k, v))
    out = torch.empty((b, tokens, heads, value_dim), dtype=out_dtype, device=state.device)
    final = torch.empty_like(state) if final is None else final
    counted = count is not None
    if not counted:  # a placeholder the kernel does not read: a pointer of the same type keeps one binary
        count = torch.empty((), dtype=torch.int64, device=state.device)
    block_v = min(BLOCK_V, triton.next_power_of_2(value_dim))
    dependent = pdl.dependent(state.device)  # a programmatic dependent launch (pdl.py)
    _recurrent[(b * heads, triton.cdiv(value_dim, block_v))](
        q, k, v, g, beta, state, out, final, tokens, count, int(counted), *q.stride()[:3], *k.stride()[:3],
        *v.stride()[:3], *g.stride(), *beta.stride(), HEADS=heads, GROUP=heads // key_heads, DK=key_dim,
        DV=value_dim, BLOCK_K=triton.next_power_of_2(key_dim), BLOCK_V=block_v, GDC=dependent, num_warps=NUM_WARPS,
        enable_fp_fusion=False, launch_pdl=dependent)
    return out.transpose(1, 2), final


def state_after(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                n: int | torch.Tensor, final: torch.Tensor | None = None) -> torch.Tensor:
    """The state after the first n tokens of a run that `recurrent` computed from `state` with these k, v, g,
    beta (hybrid_cache.py's rollback), written to `final` where given: the same launch over the run's tokens,
    applying the first n, so its bits are those of n decode steps. n: an int, or a 0-dim int64 tensor on the
    state's device, read there (no host sync; one CUDA graph serves every n). Outputs are not wanted, so k
    stands in for q: GatedDeltaNet lays the two out alike, so the binary (specialised on their strides) is the
    run's own."""
    count = torch.as_tensor(n, dtype=torch.int64, device=state.device)
    return recurrent(k, k, v, g, beta, state, count, final=final)[1]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x with contiguous rows (the kernel's loads walk the last dim with stride 1); other strides are passed."""
    return x if x.stride(-1) == 1 else x.contiguous()


if triton is not None:

    @triton.jit(do_not_specialize=["tokens", "counted", "q_batch", "k_batch", "v_batch", "g_batch", "beta_batch"],
                do_not_specialize_on_alignment=["count"])
    def _recurrent(q, k, v, g, beta, start, out, final, tokens, count, counted, q_batch, q_head, q_token, k_batch,
                   k_head, k_token, v_batch, v_head, v_token, g_batch, g_head, g_token, beta_batch, beta_head,
                   beta_token, HEADS: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, GDC: tl.constexpr):
        if GDC:  # launched as a dependent (pdl.py): wait for the kernel before (delta_inputs) and its writes
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()  # the next kernel waits for this one's end before it reads
        bh = tl.program_id(0).to(tl.int64)  # b * HEADS + h
        b, h = bh // HEADS, bh % HEADS
        kh = h // GROUP  # the q/k head serving value head h
        rows = tl.arange(0, BLOCK_K)  # the state's Dk rows, padded to a power of two with zeros
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        row_in, col_in = rows < DK, cols < DV
        tile = bh * DK * DV + rows[:, None] * DV + cols[None, :]
        inside = row_in[:, None] & col_in[None, :]
        s = tl.load(start + tile, mask=inside, other=0.0)
        applied = tokens
        if counted != 0:  # a replay: the first `count` tokens of the run (clamped to it: count is not checked)
            applied = tl.minimum(tl.load(count).to(tl.int32), tokens)
        for t in range(applied):
            k_t = tl.load(k + b * k_batch + kh * k_head + t * k_token + rows, mask=row_in, other=0.0)
            q_t = tl.load(q + b * q_batch + kh * q_head + t * q_token + rows, mask=row_in, other=0.0)
            v_t = tl.load(v + b * v_batch + h * v_head + t * v_token + cols, mask=col_in, other=0.0)
            g_t = tl.load(g + b * g_batch + h * g_head + t * g_token)
            beta_t = tl.load(beta + b * beta_batch + h * beta_head + t * beta_token)
            s = s * tl.exp(g_t)  # g = -inf (a sequence's first decode token) forgets the state: exp = 0
            delta = beta_t * (v_t - tl.sum(k_t[:, None] * s, axis=0))
            s = s + k_t[:, None] * delta[None, :]
            o_t = tl.sum(q_t[:, None] * s, axis=0)
            tl.store(out + ((b * tokens + t) * HEADS + h) * DV + cols, o_t.to(out.dtype.element_ty), mask=col_in)
        tl.store(final + tile, s, mask=inside)
