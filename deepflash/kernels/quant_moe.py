"""The routed experts of a decode or verify step (1-16 tokens, top-k experts each) computed straight from
GGUF-quantized expert weights (Triton): quant/experts.py's place for kernels/moe.py.

llama.cpp stores an expert stack's gate, up and down projections as three uint8 tensors [E, rows, row_bytes],
possibly of different formats (Q4_K_M: gate and up in Q4_K, down in Q6_K for some layers). The two kernels
are moe.py's, over the step's n * k (token, slot) pairs and a block of weight rows, with moe.py's grouping
(`_group`): the program of an expert's first pair (token-major order) does that expert's work for every token
routed to it, the programs of its other pairs return at once, so each routed expert's blocks are read once per
step however many tokens route to it, and nothing runs before the kernels to group the pairs.
1. _gate_up: silu(x @ Wg.T) * (x @ Wu.T) for the expert's tokens, in float32, rounded to x's dtype into each
   pair's row of `hidden` (gate and up each a loop over their own format's steps).
2. _down: each pair's hidden row @ Wd.T times its routing weight, in float32, into the pair's row of `partial`,
   and (moe._settle) the program storing a token's last pair sums its k partial rows in slot order, rounded once
   to x's dtype.

The products are quant_gemv.py's: its dequantization helpers (_k_quant for the k-quants' 256-column
superblocks, _small_blocks for NB 32-column blocks a step) take each weight row's byte offset `at` [BLOCK_N]
(int64), here the expert's base (expert * rows * row_bytes) plus the row's, so the helpers serve unchanged;
the float32 values are ggml's bit for bit (enable_fp_fusion=False), rounded to x's dtype before the product.
The rows' tile is 16 rows indexed by token (by the pair's token in _down, which reads the pair's hidden row):
the helpers load the tile's row i from `r[i]` where `r[i] < rows`, here r = the token (or its pair) where it
routes to the expert and an index past `rows` where not (a row of zeros).

A token's result depends only on its own row and routing, bit for bit, whatever the step's other tokens: a
token sits in its own tile row, the reduction's order is fixed by the format and the tiling (never by the
number of tokens or the routing), and the k-sum runs in slot order. A verify step computes each token as a
decode step does.

`reference` is the same computation in torch (gguf_blocks.dequantize of the routed experts' blocks, gathered
with the experts tensor on the device: no host sync), rounding where the kernels round; the tests' reference
and the path without Triton for a step's few tokens (it holds one slot's dequantized weights for every
token at once: N * I * H floats).

The tiles are quant_gemv.py's (its untuned GPU guesses; 128 rows a program in the interpreter, to run fewer
programs), the gate's for gate and up. Not yet run on a GPU. Compiled for sm_90 without a GPU (Triton 3.9,
tests/compile_kernels.py's compile; Qwen3-30B-A3B's shapes): no spills but _gate_up's with Q6_K gate and up
(about 1 KB a thread; quant_gemv.py's Q6_K spills a little under 3.9 too) and Q3_K (4 bytes). One program
per (pair, row block): a decode step of 8 experts at 768 rows and 64 rows a program runs 96 working programs,
under one an SM. `TRITON_INTERPRET=1` runs the kernels on the CPU for the tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant.gguf_blocks import FORMATS, dequantize
from . import pdl, quant_gemv
from .moe import settling
from .triton_support import INTERPRETED, tl, triton

MAX_TOKENS = 16  # a verify step's block (the kernels' tile of rows)
DTYPES = (torch.bfloat16, torch.float32)
INTERPRETED_BLOCK_N = 128  # weight rows a program in the interpreter (it runs a program at a time: fewer, faster)

if triton is not None:
    from .moe import _group, _settle
    from .quant_gemv import _project, _to_nearest


def fits(x: torch.Tensor) -> bool:
    """Whether a step's rows x [N, H] go through the kernels (else the torch forms). Never decided by the number
    of tokens within the tile: a verify step must compute a token as a decode step does."""
    return x.dim() == 2 and x.shape[0] <= MAX_TOKENS and x.dtype in DTYPES


def _tile(ggml_type: int, dtype: torch.dtype) -> tuple[int, int, int, int, bool]:
    """(weight rows a program, 32-column blocks a step (1 for the k-quants), warps, stages, weight first)."""
    tile = quant_gemv.exact_tiling(ggml_type, dtype)
    block_n = INTERPRETED_BLOCK_N if INTERPRETED else tile.block_n
    nb = 1 if quant_gemv.BLOCKS[ggml_type][0] == 256 else tile.blocks
    return block_n, nb, tile.warps, tile.stages, tile.weight_first


def _format(name: str, ggml_type: int, dtype: torch.dtype) -> dict:
    """A weight's format constexprs for a kernel: {name}_FMT, _QK (columns a block), _BYTES, _NB (blocks a step)."""
    qk, nbytes = quant_gemv.BLOCKS[ggml_type]
    return {f"{name}_FMT": ggml_type, f"{name}_QK": qk, f"{name}_BYTES": nbytes,
            f"{name}_NB": _tile(ggml_type, dtype)[1]}


def routed_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor,
                   up: torch.Tensor, down: torch.Tensor, formats: tuple[int, int, int],
                   shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """sum over each token's k experts e of weight * (silu(x @ Wg_e.T) * (x @ Wu_e.T)) @ Wd_e.T, for x [N, H]
    (N <= 16, bf16 or float32), experts / weights [N, k] (the router's: int64 ids, weights in x's dtype), gate,
    up uint8 [E, I, row_bytes(H)], down uint8 [E, H, row_bytes(I)] in the ggml types `formats` (gate, up, down).
    Returns [N, H] in x's dtype. The ids are not checked against E (that would sync with the host). shared: a
    shared expert's output and gate logits to add (moe._settle)."""
    assert fits(x), (x.shape, x.dtype)
    n, width = x.shape
    top_k = experts.shape[1]
    inner = gate.shape[1]
    kinds = tuple(int(f) for f in formats)
    for blocks, kind, rows, cols in zip((gate, up, down), kinds, (inner, inner, width), (width, width, inner)):
        assert kind in quant_gemv.BLOCKS, f"ggml type {kind} is not one of {quant_gemv.SUPPORTED}"
        assert blocks.dtype == torch.uint8 and blocks.dim() == 3 and blocks.shape[1:] == (
            rows, quant_gemv.row_bytes(kind, cols)), (blocks.dtype, blocks.shape, kind, rows, cols)
    assert experts.shape == weights.shape == (n, top_k), (experts.shape, weights.shape, n)
    out = torch.empty_like(x)
    if n == 0 or top_k == 0:
        assert shared is None, "a shared expert's output is added by the experts' kernels"
        return out.zero_()
    gate, up, down = gate.contiguous(), up.contiguous(), down.contiguous()
    hidden = torch.empty((n * top_k, inner), dtype=x.dtype, device=x.device)
    partial = torch.empty((n * top_k, width), dtype=torch.float32, device=x.device)
    dependent = pdl.dependent(x.device)  # a programmatic dependent launch (pdl.py)
    rounded = INTERPRETED and x.dtype == torch.bfloat16  # the interpreter's bf16 conversion truncates
    common = {"WIDTH": width, "INNER": inner, "TOP_K": top_k, "SLOTS": triton.next_power_of_2(top_k),
              "ROUND": rounded, "UPCAST": INTERPRETED, "IEEE": x.dtype == torch.float32, "GDC": dependent,
              "launch_pdl": dependent,
              "enable_fp_fusion": False}  # ggml's roundings (quant_gemv.py); the interpreter ignores it
    experts = experts.contiguous()

    block_n, _, warps, stages, weight_first = _tile(kinds[0], x.dtype)  # the gate's tiling for both
    _gate_up[(n * top_k, triton.cdiv(inner, block_n))](
        x.contiguous(), experts, gate, gate.view(torch.float16), up, up.view(torch.float16), hidden, n,
        **_format("G", kinds[0], x.dtype), **_format("U", kinds[1], x.dtype), BLOCK_N=block_n,
        WEIGHT_FIRST=weight_first and not INTERPRETED, num_warps=warps, num_stages=stages, **common)

    block_n, _, warps, stages, weight_first = _tile(kinds[2], x.dtype)
    _down[(n * top_k, triton.cdiv(width, block_n))](
        hidden, experts, weights.contiguous(), down, down.view(torch.float16), partial, n,
        *settling(out, shared, block_n), **_format("D", kinds[2], x.dtype), BLOCK_N=block_n,
        SHARED=shared is not None, WEIGHT_FIRST=weight_first and not INTERPRETED, num_warps=warps,
        num_stages=stages, **common)
    return out


def reference(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
              down: torch.Tensor, formats: tuple[int, int, int]) -> torch.Tensor:
    """routed_experts' computation in torch, rounding where the kernels round: each slot's experts' blocks
    gathered on the device (experts indexes them: no host sync) and dequantized to x's dtype (ggml's float32
    values, rounded as the kernels round them), the products in float32, the activation rounded to x's dtype
    before the down projection, the k partials summed in slot order and rounded once. Any number of tokens,
    though it holds a slot's dequantized weights for every token ([N, I, H] floats) at once."""
    fg, fu, fd = (FORMATS[int(f)] for f in formats)
    xf = x.float()
    total = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for slot in range(experts.shape[1]):
        ids = experts[:, slot]
        g = torch.einsum("nh,nih->ni", xf, dequantize(gate[ids], fg, x.dtype).float())
        u = torch.einsum("nh,nih->ni", xf, dequantize(up[ids], fu, x.dtype).float())
        hidden = (F.silu(g) * u).to(x.dtype).float()
        part = torch.einsum("ni,nhi->nh", hidden, dequantize(down[ids], fd, x.dtype).float())
        total = total + part * weights[:, slot, None].float()
    return total.to(x.dtype)


if triton is not None:

    @triton.jit
    def _expert_rows(x, blocks, half, expert, outs, live, r, rows, COLS: tl.constexpr, N: tl.constexpr,
                     FMT: tl.constexpr, QK: tl.constexpr, BLOCK_BYTES: tl.constexpr, NB: tl.constexpr,
                     BLOCK_N: tl.constexpr, ROUND: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                     WEIGHT_FIRST: tl.constexpr):
        """The rows' tile (row i: x's row r[i] where r[i] < rows, else zeros) times expert `expert`'s weight
        rows `outs` [BLOCK_N] (`live`: inside its N rows) of COLS columns: [16, BLOCK_N] float32."""
        ROW_BYTES: tl.constexpr = (COLS // QK) * BLOCK_BYTES
        STEPS: tl.constexpr = (COLS // QK + NB - 1) // NB
        # int64 byte offsets (the ids are int64) with constexpr strides: Triton sees the blocks' alignment
        row_at = expert * (N * ROW_BYTES) + outs.to(tl.int64) * ROW_BYTES
        return _project(x, blocks, half, row_at, 0, STEPS, live, r, rows, COLS, FMT, QK, BLOCK_BYTES, NB, BLOCK_N,
                        ROUND, UPCAST, IEEE, WEIGHT_FIRST)

    @triton.jit(do_not_specialize=["n"])  # one binary for 1-16 tokens
    def _gate_up(x, experts, gate, gate_half, up, up_half, hidden, n, WIDTH: tl.constexpr, INNER: tl.constexpr,
                 TOP_K: tl.constexpr, SLOTS: tl.constexpr, G_FMT: tl.constexpr, G_QK: tl.constexpr,
                 G_BYTES: tl.constexpr, G_NB: tl.constexpr, U_FMT: tl.constexpr, U_QK: tl.constexpr,
                 U_BYTES: tl.constexpr, U_NB: tl.constexpr, BLOCK_N: tl.constexpr, ROUND: tl.constexpr,
                 UPCAST: tl.constexpr, IEEE: tl.constexpr, WEIGHT_FIRST: tl.constexpr, GDC: tl.constexpr):
        if GDC:  # launched as a dependent (pdl.py): wait for the kernel before (the router) and its writes
            tl.extra.cuda.gdc_wait()
        first, expert, routed, pairs = _group(experts, tl.program_id(0), n, TOP_K, SLOTS)
        if first:
            r = tl.where(routed, tl.arange(0, 16), 16)  # tile row t: token t where it routes here, else zeros
            outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            live = outs < INNER
            g = _expert_rows(x, gate, gate_half, expert, outs, live, r, 16, WIDTH, INNER, G_FMT, G_QK, G_BYTES, G_NB,
                         BLOCK_N, ROUND, UPCAST, IEEE, WEIGHT_FIRST)
            u = _expert_rows(x, up, up_half, expert, outs, live, r, 16, WIDTH, INNER, U_FMT, U_QK, U_BYTES, U_NB,
                         BLOCK_N, ROUND, UPCAST, IEEE, WEIGHT_FIRST)
            if GDC:  # the next kernel may be placed now (it waits for this one's end before it reads)
                tl.extra.cuda.gdc_launch_dependents()
            act = g / (1.0 + tl.exp(-g)) * u
            tl.store(hidden + pairs[:, None] * INNER + outs[None, :],
                     _to_nearest(act, ROUND).to(hidden.dtype.element_ty), mask=routed[:, None] & live[None, :])

    @triton.jit(do_not_specialize=["n"])
    def _down(hidden, experts, weights, down, down_half, partial, n, out, shared, logits, logit_stride, arrivals,
              SHARED: tl.constexpr, WIDTH: tl.constexpr, INNER: tl.constexpr,
              TOP_K: tl.constexpr, SLOTS: tl.constexpr, D_FMT: tl.constexpr, D_QK: tl.constexpr,
              D_BYTES: tl.constexpr, D_NB: tl.constexpr, BLOCK_N: tl.constexpr, ROUND: tl.constexpr,
              UPCAST: tl.constexpr, IEEE: tl.constexpr, WEIGHT_FIRST: tl.constexpr, GDC: tl.constexpr):
        if GDC:
            tl.extra.cuda.gdc_wait()
        first, expert, routed, pairs = _group(experts, tl.program_id(0), n, TOP_K, SLOTS)
        if first:
            PAIRS: tl.constexpr = 16 * TOP_K  # past every pair of the step
            r = tl.where(routed, pairs, PAIRS)  # tile row t: the hidden row of token t's pair with this expert
            outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            live = outs < WIDTH
            acc = _expert_rows(hidden, down, down_half, expert, outs, live, r, PAIRS, INNER, WIDTH, D_FMT, D_QK,
                           D_BYTES, D_NB, BLOCK_N, ROUND, UPCAST, IEEE, WEIGHT_FIRST)
            if GDC:
                tl.extra.cuda.gdc_launch_dependents()
            scale = tl.load(weights + pairs, mask=routed, other=0.0).to(tl.float32)
            tl.store(partial + pairs[:, None] * WIDTH + outs[None, :], acc * scale[:, None],
                     mask=routed[:, None] & live[None, :])
            _settle(partial, out, shared, logits, logit_stride, arrivals, routed, outs, WIDTH, TOP_K, BLOCK_N, SHARED,
                    ROUND)
