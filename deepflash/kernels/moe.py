"""The routed experts of a decode or verify step (1-16 tokens, top-k experts each) in Triton.

The torch forms (layers.Experts) either run every expert over every token (E/k times the routed work)
or hand F.grouped_mm the pairs sorted by expert (bf16 on Hopper and Blackwell only). Here each routed
expert's weights are read once per step, however many of the block's tokens route to it, and nothing
runs before the kernels to group the pairs: each program finds its group itself.

Two kernels, each over the step's n * k (token, slot) pairs and a block of columns. The program of an
expert's first pair (token-major order) does that expert's work; the programs of its other pairs return
at once. A program compares its expert with the step's routed ids (at most 16 x k), which gives the
tokens routed to it: a tile of 16 rows indexed by token, since a token routes to an expert at most once.
1. _gate_up: silu(x @ Wg.T) * (x @ Wu.T) for those tokens, accumulated in float32 and rounded to x's
   dtype (as the torch forms round the activation before the down projection), into each pair's row of
   `hidden`.
2. _down: each pair's hidden row @ Wd.T times its routing weight, in float32, into the pair's row of
   `partial`; then (_settle) the program that stores a token's last pair for a column block sums the token's
   k partial rows in slot order, rounded once to x's dtype (plus a shared expert's gated output where there
   is one), counting arrivals as gemv.py's split reductions do: no third kernel to combine them.

A token's result depends only on its own row and routing, bit for bit, not on what the block's other
tokens route to: tile rows are computed apart and the k-sum has a fixed order, so a verify step computes
each token as a decode step does (gemv.py keeps the same property for the projections).

The tiles below are first choices, not yet measured on a GPU. Chosen with the target's other Triton
kernels (TargetModel.use_kernels); `TRITON_INTERPRET=1` runs them on the CPU for the tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import pdl
from .arrivals import arrival_counters
from .triton_support import INTERPRETED, tl, triton

MAX_TOKENS = 16  # a verify step's block (the kernels' tile of rows); longer inputs take the torch forms
DTYPES = (torch.bfloat16, torch.float32)
BLOCK_I = 32  # intermediate columns per _gate_up program (32 gate and 32 up weight rows)
BLOCK_H = 32  # output columns per _down program
BLOCK_K = 128  # reduction step of the tensor-core products
UPCAST_BLOCK_K = 32  # reduction step of the float32 products: they are a [16, BLOCK, BLOCK_K] tensor


def fits(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether a step's rows x [N, H] and the experts' weights go through the kernels (else the torch forms)."""
    return (x.shape[0] <= MAX_TOKENS and x.dtype in DTYPES and gate_up.dtype == down.dtype == x.dtype
            and gate_up.is_contiguous() and down.is_contiguous())


def routed_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """sum over each token's k experts e of weight * (silu(x @ Wg_e.T) * (x @ Wu_e.T)) @ Wd_e.T, for x [N, H]
    (N <= 16), experts / weights [N, k] (the router's), gate_up [E, 2I, H] (gate rows first) and down
    [E, H, I]. Returns [N, H] in x's dtype. shared: a shared expert's output and gate logits to add (_settle)."""
    n, width = x.shape
    top_k, inner = experts.shape[1], down.shape[-1]
    assert fits(x, gate_up, down), (x.shape, x.dtype, gate_up.dtype, down.dtype)
    hidden = torch.empty((n * top_k, inner), dtype=x.dtype, device=x.device)
    partial = torch.empty((n * top_k, width), dtype=torch.float32, device=x.device)
    out = torch.empty_like(x)
    upcast = x.dtype == torch.float32 or INTERPRETED
    dependent = pdl.dependent(x.device)  # a programmatic dependent launch (pdl.py)
    shape = dict(WIDTH=width, INNER=inner, TOP_K=top_k, SLOTS=triton.next_power_of_2(top_k),
                 BLOCK_K=UPCAST_BLOCK_K if upcast else BLOCK_K, UPCAST=upcast, GDC=dependent, launch_pdl=dependent)
    experts = experts.contiguous()
    _gate_up[(n * top_k, triton.cdiv(inner, BLOCK_I))](x.contiguous(), experts, gate_up, hidden, n,
                                                       BLOCK_I=BLOCK_I, **shape)
    _down[(n * top_k, triton.cdiv(width, BLOCK_H))](hidden, experts, weights.contiguous(), down, partial, n,
                                                    *settling(out, shared, BLOCK_H), SHARED=shared is not None,
                                                    ROUND=INTERPRETED and x.dtype == torch.bfloat16,
                                                    BLOCK_H=BLOCK_H, **shape)
    return out


def settling(out: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor] | None, block: int) -> tuple:
    """The arguments of _down's last step (_settle, here and in quant_moe.py) after its own: out, the shared
    expert's output and gate logits (or placeholders), the logits' row stride and the arrival counters [16,
    column blocks of `block`]."""
    expert, logits = (out, out) if shared is None else (shared[0].contiguous(), shared[1])
    counters = arrival_counters("moe_down", 16 * triton.cdiv(out.shape[-1], block), out.device)
    return out, expert, logits, logits.stride(0), counters


def routed_experts_torch(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                         down: torch.Tensor) -> torch.Tensor:
    """The kernels' computation in torch, rounding where they round (the tests' reference). It gathers
    each pair's expert weights, a copy the kernels never make: a reference for a few tokens only."""
    gate, up = torch.einsum("nh,nkih->nki", x.float(), gate_up[experts].float()).chunk(2, dim=-1)
    hidden = (F.silu(gate) * up).to(x.dtype).float()
    partial = torch.einsum("nki,nkhi->nkh", hidden, down[experts].float()) * weights[..., None].float()
    return partial.sum(1).to(x.dtype)


if triton is not None:
    from .quant_gemv import _to_nearest

    @triton.jit
    def _group(experts, pair, n, TOP_K: tl.constexpr, SLOTS: tl.constexpr):
        """(whether this program does its pair's expert's work, the expert, which of the 16 token rows route
        to it [16], and the pair of each such row [16]). The expert's first pair's program does it."""
        t = tl.arange(0, 16)
        slot = tl.arange(0, SLOTS)
        at = t[:, None] * TOP_K + slot[None, :]
        routed = tl.load(experts + at, mask=(t < n)[:, None] & (slot < TOP_K)[None, :], other=-1)
        expert = tl.load(experts + pair)
        same = routed == expert
        first = tl.sum(tl.sum((same & (at < pair)).to(tl.int32), axis=1), axis=0) == 0
        return first, expert, tl.sum(same.to(tl.int32), axis=1) > 0, tl.sum(tl.where(same, at, 0), axis=1)

    @triton.jit
    def _product(acc, rows, w, UPCAST: tl.constexpr):
        """acc + rows @ w.T. UPCAST: float32 weights (tf32 would round them), or bfloat16 in the interpreter,
        whose matrix product rounds a row by its place in the tile: products summed per row (gemv.py)."""
        if UPCAST:
            acc += tl.sum(rows.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        else:
            acc = tl.dot(rows, tl.trans(w), acc)
        return acc

    @triton.jit(do_not_specialize=["n"])  # one binary for 1-16 tokens
    def _gate_up(x, experts, gate_up, hidden, n, WIDTH: tl.constexpr, INNER: tl.constexpr, TOP_K: tl.constexpr,
                 SLOTS: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                 GDC: tl.constexpr):
        if GDC:  # launched as a dependent (pdl.py): wait for the kernel before (the router) and its writes
            tl.extra.cuda.gdc_wait()
        first, expert, routed, pairs = _group(experts, tl.program_id(0), n, TOP_K, SLOTS)
        if first:
            t = tl.arange(0, 16)
            cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
            weight = gate_up + expert * (2 * INNER * WIDTH)  # int64 offsets: the ids are int64
            gate = tl.zeros([16, BLOCK_I], dtype=tl.float32)
            up = tl.zeros([16, BLOCK_I], dtype=tl.float32)
            for k0 in range(0, WIDTH, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                rows = tl.load(x + t[:, None] * WIDTH + k[None, :], mask=routed[:, None] & (k < WIDTH)[None, :],
                               other=0.0)
                inside = (cols < INNER)[:, None] & (k < WIDTH)[None, :]
                gate = _product(gate, rows, tl.load(weight + cols[:, None] * WIDTH + k[None, :], mask=inside,
                                                    other=0.0), UPCAST)
                up = _product(up, rows, tl.load(weight + (INNER + cols)[:, None] * WIDTH + k[None, :], mask=inside,
                                                other=0.0), UPCAST)
            if GDC:  # the next kernel may be placed now (it waits for this one's end before it reads)
                tl.extra.cuda.gdc_launch_dependents()
            act = gate / (1.0 + tl.exp(-gate)) * up
            tl.store(hidden + pairs[:, None] * INNER + cols[None, :], act.to(hidden.dtype.element_ty),
                     mask=routed[:, None] & (cols < INNER)[None, :])

    @triton.jit(do_not_specialize=["n"])
    def _down(hidden, experts, weights, down, partial, n, out, shared, logits, logit_stride, arrivals,
              SHARED: tl.constexpr, ROUND: tl.constexpr, WIDTH: tl.constexpr, INNER: tl.constexpr,
              TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
              UPCAST: tl.constexpr, GDC: tl.constexpr):
        if GDC:
            tl.extra.cuda.gdc_wait()
        first, expert, routed, pairs = _group(experts, tl.program_id(0), n, TOP_K, SLOTS)
        if first:
            cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
            weight = down + expert * (WIDTH * INNER)
            acc = tl.zeros([16, BLOCK_H], dtype=tl.float32)
            for k0 in range(0, INNER, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                rows = tl.load(hidden + pairs[:, None] * INNER + k[None, :],
                               mask=routed[:, None] & (k < INNER)[None, :], other=0.0)
                w = tl.load(weight + cols[:, None] * INNER + k[None, :],
                            mask=(cols < WIDTH)[:, None] & (k < INNER)[None, :], other=0.0)
                acc = _product(acc, rows, w, UPCAST)
            if GDC:
                tl.extra.cuda.gdc_launch_dependents()
            scale = tl.load(weights + pairs, mask=routed, other=0.0).to(tl.float32)
            tl.store(partial + pairs[:, None] * WIDTH + cols[None, :], acc * scale[:, None],
                     mask=routed[:, None] & (cols < WIDTH)[None, :])
            _settle(partial, out, shared, logits, logit_stride, arrivals, routed, cols, WIDTH, TOP_K, BLOCK_H, SHARED,
                    ROUND)

    @triton.jit
    def _settle(partial, out, shared, logits, logit_stride, arrivals, routed, cols, WIDTH: tl.constexpr,
                TOP_K: tl.constexpr, BLOCK: tl.constexpr, SHARED: tl.constexpr, ROUND: tl.constexpr):
        """After a _down program stored its pairs' partial rows (`routed`: the tile's tokens among them) for the
        columns `cols`: each such token's arrival counted for this column block; the program bringing a token's
        count to TOP_K sums the token's k partial rows in slot order, rounded once to out's dtype (to nearest in
        the interpreter too: ROUND, quant_gemv._to_nearest), and with SHARED adds sigmoid(logit) * shared, each op
        rounded as torch rounds it (Qwen3.5's SharedExpertMoe). Whichever program arrives last, a token's sum
        has the same order: it never depends on the other tokens. The counter goes back to 0 for the next call."""
        tl.debug_barrier()  # every thread's partial stores precede the release below
        t = tl.arange(0, 16)
        counter = arrivals + t * tl.cdiv(WIDTH, BLOCK) + tl.program_id(1)
        seen = tl.atomic_add(counter, 1, mask=routed, sem="acq_rel", scope="gpu")
        last = routed & (seen == TOP_K - 1)
        if tl.sum(last.to(tl.int32), axis=0) > 0:
            tile = last[:, None] & (cols < WIDTH)[None, :]
            total = tl.zeros([16, BLOCK], dtype=tl.float32)
            for slot in tl.static_range(TOP_K):  # read through L2 (".cg"): other SMs wrote them
                total += tl.load(partial + (t * TOP_K + slot)[:, None] * WIDTH + cols[None, :], mask=tile, other=0.0,
                                 cache_modifier=".cg")
            tl.atomic_xchg(counter, 0, mask=last)
            if SHARED:
                dtype = out.dtype.element_ty
                routed_sum = _to_nearest(total, ROUND).to(dtype).to(tl.float32)
                logit = tl.load(logits + t * logit_stride, mask=last, other=0.0).to(tl.float32)
                scale = _to_nearest(1.0 / (1.0 + tl.exp(-logit)), ROUND).to(dtype).to(tl.float32)
                expert = tl.load(shared + t[:, None] * WIDTH + cols[None, :], mask=tile, other=0.0).to(tl.float32)
                total = routed_sum + _to_nearest(scale[:, None] * expert, ROUND).to(dtype).to(tl.float32)
            tl.store(out + t[:, None] * WIDTH + cols[None, :], _to_nearest(total, ROUND).to(out.dtype.element_ty),
                     mask=tile)
