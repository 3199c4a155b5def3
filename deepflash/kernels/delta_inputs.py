"""What a Gated DeltaNet layer computes between its input projection and the delta rule, for a decode or verify
step (1-16 tokens), in one Triton kernel.

The torch form (models/gated_deltanet.py) runs it as ~17 small kernels a layer: the conv state's concatenation
with the step's inputs, the depthwise conv's products and sums, SiLU, the repeat of q/k to the value heads, the
L2 norms of q and k, the decay g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), the fresh-sequence
masks and the conv state's copy. A decode step of a DeltaNet layer is bound by its launches, not its bytes
(scripts/count_launches.py), so here one program owns one head's channels of one sequence (a q, k or v head)
and walks the step's tokens in order:

- the causal conv over its channels: K taps from the conv state, then from the step's own inputs, products
  summed in float32 and rounded to the model's dtype (as the convolution returns it), then SiLU, rounded again;
- a q or k head: the head's L2 norm in float32 (q also scaled by Dk^-0.5), stored once per key head: the
  delta-rule kernel reads each key head for the value heads it serves;
- a v head: v, and the head's g and beta of each token;
- then the new conv state (the last K-1 inputs), written in place: each thread loads and stores only its own
  channels, so the writes never race the program's reads of the old state.

A token's values depend only on the conv state before it and its own row, and the number of tokens is not
specialised: a verify step computes each token as a decode step would (the greedy contract in bf16). At a
sequence's start (`fresh`, read on the device) the conv state counts as zeros and the first token's decay is
-inf, which makes the delta rule forget the state, as the torch form masks them. Outputs are float32, the
delta rule's arithmetic. `TRITON_INTERPRET=1` runs the kernel on the CPU for the tests.
"""

from __future__ import annotations

import torch

from . import pdl
from .triton_support import tl, triton

L2_EPS = 1e-6  # gated_deltanet.L2_EPS (not imported: the models import the kernels, not the reverse)
SOFTPLUS_THRESHOLD = 20.0  # torch's softplus: the identity above it


def delta_inputs(qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv: torch.Tensor, conv_weight: torch.Tensor,
                 fresh: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, heads: tuple[int, int],
                 dims: tuple[int, int], window: torch.Tensor | None = None):
    """The delta rule's inputs of a step. qkv [B, T, C] (C = 2 Hk Dk + Hv Dv: q, k, v channels), b and a [B, T, Hv]:
    rows of unit column stride, any batch and token strides (slices of the fused input projection). conv
    [B, C, K-1] contiguous, updated in place to the step's last K-1 inputs; conv_weight [C, 1, K]; fresh [1] bool
    (the step starts a sequence); a_log, dt_bias [Hv]; heads (Hk, Hv), dims (Dk, Dv). window [B, C, K-1+T] in
    qkv's dtype, or None: where to store the conv window (the state before the step, then the step's inputs)
    for a capture rollback (hybrid_cache.py). Returns float32 q, k [B, Hk, T, Dk] (q normalised and divided by
    Dk^0.5, k normalised), v [B, Hv, T, Dv], g and beta [B, Hv, T], as views of token-major storage
    ([B, T, H, D])."""
    batch, tokens, channels = qkv.shape
    (key_heads, value_heads), (key_dim, value_dim) = heads, dims
    width = conv.shape[-1]
    assert channels == 2 * key_heads * key_dim + value_heads * value_dim, (qkv.shape, heads, dims)
    assert conv.is_contiguous() and conv.shape == (batch, channels, width), (conv.shape, qkv.shape)
    assert conv_weight.shape == (channels, 1, width + 1), conv_weight.shape
    assert qkv.stride(-1) == b.stride(-1) == a.stride(-1) == 1 and conv_weight.is_contiguous()
    device, f32 = qkv.device, torch.float32
    q = torch.empty((batch, tokens, key_heads, key_dim), dtype=f32, device=device)
    k = torch.empty_like(q)
    v = torch.empty((batch, tokens, value_heads, value_dim), dtype=f32, device=device)
    g = torch.empty((batch, tokens, value_heads), dtype=f32, device=device)
    beta = torch.empty_like(g)
    store = window is not None
    dependent = pdl.dependent(qkv.device)  # a programmatic dependent launch (pdl.py)
    _delta_inputs[(batch, 2 * key_heads + value_heads)](
        qkv, b, a, conv, conv_weight, fresh, a_log, dt_bias, q, k, v, g, beta, window if store else conv, tokens,
        qkv.stride(0), qkv.stride(1), b.stride(0), b.stride(1), a.stride(0), a.stride(1),
        KEY_HEADS=key_heads, VALUE_HEADS=value_heads, DK=key_dim, DV=value_dim, WIDTH=width,
        BLOCK=triton.next_power_of_2(max(key_dim, value_dim)), ROOT_DK=key_dim**0.5, EPS=L2_EPS,
        THRESHOLD=SOFTPLUS_THRESHOLD, WINDOW=store, GDC=dependent, launch_pdl=dependent)
    return (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g.transpose(1, 2), beta.transpose(1, 2))


if triton is not None:

    @triton.jit
    def _silu(x):
        return x / (1.0 + tl.exp(-x))

    @triton.jit
    def _softplus(x, THRESHOLD: tl.constexpr):
        """torch's softplus: log(1 + exp(x)), the identity above the threshold (written so that exp never overflows)."""
        return tl.where(x > THRESHOLD, x, tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x))))

    @triton.jit(do_not_specialize=["tokens", "qkv_batch", "qkv_token", "b_batch", "b_token", "a_batch", "a_token"])
    def _delta_inputs(qkv, b_in, a_in, conv, conv_weight, fresh, a_log, dt_bias, q, k, v, g, beta, window, tokens,
                      qkv_batch, qkv_token, b_batch, b_token, a_batch, a_token,
                      KEY_HEADS: tl.constexpr, VALUE_HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      WIDTH: tl.constexpr, BLOCK: tl.constexpr, ROOT_DK: tl.constexpr, EPS: tl.constexpr,
                      THRESHOLD: tl.constexpr, WINDOW: tl.constexpr, GDC: tl.constexpr):
        if GDC:  # launched as a dependent (pdl.py): wait for the kernel before (the input projection)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()  # the next kernel waits for this one's end before it reads
        bi = tl.program_id(0).to(tl.int64)  # the sequence
        head = tl.program_id(1)  # q heads, then k heads, then v heads
        CHANNELS: tl.constexpr = 2 * KEY_HEADS * DK + VALUE_HEADS * DV
        is_value = head >= 2 * KEY_HEADS
        h = tl.where(is_value, head - 2 * KEY_HEADS, head % KEY_HEADS)  # the head among its kind's
        first = tl.where(is_value, 2 * KEY_HEADS * DK + h * DV, head * DK)  # its first channel
        lanes = tl.arange(0, BLOCK)
        inside = lanes < tl.where(is_value, DV, DK)
        c = first + lanes
        dtype = qkv.dtype.element_ty
        # at a sequence's start the conv state counts as zeros, else it holds the sequence's last inputs (loaded
        # per lane: masks are whole vectors)
        held = tl.load(fresh + lanes * 0) == 0
        state = conv + (bi * CHANNELS + c) * WIDTH  # this sequence's conv state of the head's channels
        inputs = qkv + bi * qkv_batch + c  # token t's inputs at + t * qkv_token
        if WINDOW:
            for j in tl.static_range(WIDTH):
                old = tl.load(state + j, mask=inside & held, other=0.0)
                tl.store(window + (bi * CHANNELS + c) * (WIDTH + tokens) + j, old, mask=inside)
        decay = -tl.exp(tl.load(a_log + h).to(tl.float32))  # a value head's (h < Hk < Hv for the others)
        bias = tl.load(dt_bias + h).to(tl.float32)
        for t in range(tokens):
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for j in tl.static_range(WIDTH + 1):  # window column t + j: the old state's below WIDTH
                col = t + j
                old = tl.load(state + col, mask=inside & held & (lanes * 0 + col < WIDTH), other=0.0)
                new = tl.load(inputs + (col - WIDTH) * qkv_token, mask=inside & (lanes * 0 + col >= WIDTH), other=0.0)
                tap = tl.load(conv_weight + c * (WIDTH + 1) + j, mask=inside, other=0.0).to(tl.float32)
                acc += (old.to(tl.float32) + new.to(tl.float32)) * tap
            x = _silu(acc.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            if WINDOW:
                raw = tl.load(inputs + t * qkv_token, mask=inside, other=0.0)
                tl.store(window + (bi * CHANNELS + c) * (WIDTH + tokens) + WIDTH + t, raw, mask=inside)
            if is_value:
                tl.store(v + ((bi * tokens + t) * VALUE_HEADS + h) * DV + lanes, x, mask=inside)
                a_t = tl.load(a_in + bi * a_batch + t * a_token + h).to(tl.float32)
                g_t = decay * _softplus(a_t + bias, THRESHOLD)
                cleared = tl.load(fresh) != 0
                g_t = tl.where(cleared & (t == 0), float("-inf"), g_t)  # forget the state: exp(-inf) = 0
                b_t = tl.load(b_in + bi * b_batch + t * b_token + h).to(tl.float32)
                beta_t = (1.0 / (1.0 + tl.exp(-b_t))).to(dtype).to(tl.float32)  # sigmoid, in the model's dtype
                tl.store(g + (bi * tokens + t) * VALUE_HEADS + h, g_t)
                tl.store(beta + (bi * tokens + t) * VALUE_HEADS + h, beta_t)
            else:
                x = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) + EPS))
                at = ((bi * tokens + t) * KEY_HEADS + h) * DK + lanes
                if head < KEY_HEADS:
                    tl.store(q + at, x / ROOT_DK, mask=inside)
                else:
                    tl.store(k + at, x, mask=inside)
        # the new conv state, window columns tokens .. tokens + WIDTH - 1: column j is stored after column
        # tokens + j > j is loaded, and later columns load further right, so no load reads a stored column
        for j in tl.static_range(WIDTH):
            col = tokens + j
            old = tl.load(state + col, mask=inside & held & (lanes * 0 + col < WIDTH), other=0.0)
            new = tl.load(inputs + (col - WIDTH) * qkv_token, mask=inside & (lanes * 0 + col >= WIDTH), other=0.0)
            tl.store(state + j, old + new, mask=inside)
