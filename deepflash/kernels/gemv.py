"""Projections of a few rows (decode and verify steps) with the small work before them fused in (Triton).

A decode step multiplies 1-16 rows by each weight; the GEMM itself streams the weight, and what ran
before it in a kernel of its own (the residual add + RMSNorm before the q/k/v and gate/up projections,
silu(gate) * up before the down projection) cost a launch and a round trip through memory each: 3 of a
fused layer's 9 kernels in the profile of a decode step.

The programs split both the weight rows (BLOCK_N) and the reduction (slices of SPAN columns), enough of
them that every SM has several weight loads in flight: one program walking a whole reduction alone
streams a weight at a fraction of the copy bandwidth (0.10 of it on Qwen3-8B's down projection, H200). Each program applies the prologue to its slice of the rows (a few KB, read
from L2). The RMSNorm's 1/rms is a per-row factor of the whole product, so a slice
multiplies the unnormalised s * gain and sums its squares; the last program of a column block to finish
(an arrival counter) adds the slices' products and squares in slice order and scales by 1/rms, so the
result does not depend on which program finishes last.

Rows are a tile of 16 for the tensor-core product, padded with zeros: a row's result depends only on
that row, bit for bit, whatever the number of rows, so a verify step projects each token exactly as a
one-token decode step does (attention.py keeps the same property for attention). More rows than a
tile (prefill) take torch's GEMM after the separate kernels (layers.norm_linear), as do float16 rows:
the unnormalised s * gain could pass float16's range where the normed rows would not.

Chosen with the target's other Triton kernels (TargetModel.use_kernels); `TRITON_INTERPRET=1` runs it
on the CPU for the tests.
"""

from __future__ import annotations

import functools

import torch

from . import pdl
from .arrivals import arrival_counters
from .config import SHIPPED as SHIPPED_KERNELS
from .config import ProjectionTiling
from .triton_support import INTERPRETED, tl, triton

if triton is not None:
    from triton.tools.tensor_descriptor import TensorDescriptor

TILE = 16  # rows of the tensor-core product (the kernel's tl.arange(0, 16)); more rows take torch's GEMM
DTYPES = (torch.bfloat16, torch.float32)
MAX_BLOCKS = 1 << 16  # column blocks of the widest projection (a 1M-wide output at BLOCK_N 16)
SHIPPED = SHIPPED_KERNELS.projections  # the tiling the engine runs
NORM, ADD_NORM, SILU, PLAIN = 0, 1, 2, 3  # the prologue (PLAIN: none)


def fits(x: torch.Tensor, weight: torch.Tensor, tiling: ProjectionTiling = SHIPPED) -> bool:
    """Whether x's rows and the weight go through these kernels (else torch's GEMM after the separate
    kernels). Never decided by the number of rows within a tile: a verify step must project as a
    decode step does. A weight stored transposed (layers.gemm_layout) takes torch's GEMM."""
    return (x.numel() // x.shape[-1] <= TILE and x.dtype in DTYPES and weight.is_contiguous()
            and small(weight, tiling))


def small(weight: torch.Tensor, tiling: ProjectionTiling = SHIPPED) -> bool:
    """Whether a weight is small enough for these kernels (tiling.max_weight_bytes); larger ones take torch's
    GEMM."""
    return tiling.takes(weight)


def norm_linear(x: torch.Tensor, delta: torch.Tensor | None, gain: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None,
                total: torch.Tensor | None = None, tiling: ProjectionTiling = SHIPPED, offset: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s) * gain @ weight.T + bias) with s = x + delta (x when delta is None), rounded to
    x's dtype as layer_ops.add_rms_norm rounds it; s * gain is rounded to the weight's dtype and the
    float32 product scaled by 1/rms (the module docstring). `total`: where s goes (a feature tap reads
    it there: layers.tap); a new tensor when None. offset: the gain is 1 + gain (Qwen3.5's norms)."""
    if delta is None:
        total = x  # nothing to add: the input is the residual stream
    elif total is None:
        total = torch.empty_like(x)
    out = _launch(ADD_NORM if delta is not None else NORM, x, x if delta is None else delta, gain, total,
                  weight, bias, x.shape[-1], eps, tiling, offset)
    return total, out


def silu_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                tiling: ProjectionTiling = SHIPPED) -> torch.Tensor:
    """(silu(gate) * up) @ weight.T + bias of a fused gate/up projection's output [..., 2I] (gate
    first), the product rounded to the weight's dtype as layer_ops.silu_mul's output is."""
    return _launch(SILU, gate_up, gate_up, weight, gate_up, weight, bias, gate_up.shape[-1] // 2, 0.0, tiling)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           tiling: ProjectionTiling = SHIPPED) -> torch.Tensor:
    """x @ weight.T + bias with no prologue (an attention output projection), each program walking its
    whole reduction (_launch): on SmolLM2-135M's o projection faster than torch's GEMM alone, and a kernel
    launched as a dependent (pdl.py) where torch's GEMM ended the chain of dependent launches in every
    layer: decode +2.9% (H200)."""
    return _launch(PLAIN, x, x, weight, x, weight, bias, x.shape[-1], 0.0, tiling)


def config(width: int, outputs: int, nbytes: int, tiling: ProjectionTiling = SHIPPED
           ) -> tuple[int, int, int, int, bool, float, bool]:
    """The tiling of a weight [outputs, width] of nbytes (tiling.small or tiling.large)."""
    table = tiling.small if nbytes <= tiling.small_weight_bytes else tiling.large
    return next(c for max_width, max_outputs, c in table
                if (max_width is None or width <= max_width) and (max_outputs is None or outputs <= max_outputs))


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def split(blocks: int, steps: int, sms: int, waves: float) -> tuple[int, int]:
    """(slices, BLOCK_K steps per slice) of a reduction of `steps` steps over `blocks` column blocks on a
    device of `sms` SMs: about `waves` programs per SM (0: one slice; a fraction aims between whole
    counts), every slice non-empty. It depends on the shapes only, never on the number of rows, so a
    verify step sums each row in the same order as a decode step."""
    per = triton.cdiv(steps, min(steps, max(1, triton.cdiv(int(sms * waves), blocks))))
    return triton.cdiv(steps, per), per


def _launch(mode, x, delta, gain, total, weight, bias, width, eps, tiling: ProjectionTiling,
            offset: bool = False) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    assert rows <= TILE and weight.shape[1] == width and weight.is_contiguous(), (rows, weight.shape, width)
    n = weight.shape[0]
    out = torch.empty((*x.shape[:-1], n), dtype=weight.dtype, device=x.device)
    upcast = weight.dtype == torch.float32 or INTERPRETED
    nbytes = weight.numel() * weight.element_size()
    block_n, block_k, warps, stages, weight_first, waves, tma = config(width, n, nbytes, tiling)
    # the upcast products are a [16, BLOCK_N, BLOCK_K] tensor: a smaller slice of the reduction
    block_k = min(32 if upcast else block_k, max(16, triton.next_power_of_2(width)))
    blocks = triton.cdiv(n, block_n)
    assert blocks <= MAX_BLOCKS, (n, block_n)
    # no prologue: each program walks its whole reduction, whose loads then pipeline (SmolLM2's o
    # projection: 3.2 us against 4.2-4.8 split, H200); a larger weight (Qwen3-8B's o projection) splits:
    # whole, its 32 column blocks would leave most SMs idle
    whole = mode == PLAIN and nbytes <= tiling.small_weight_bytes
    waves = 0 if whole else waves if tiling.waves is None else tiling.waves
    slices, steps = split(blocks, triton.cdiv(width, block_k), _sms(x.device), waves)
    # the slices' float32 products [slices, rows, n], then their squares [blocks, slices, 16]
    squares_at = slices * rows * n if slices > 1 else 0
    partial = torch.empty(squares_at + slices * blocks * TILE, dtype=torch.float32, device=x.device)
    dependent = pdl.dependent(x.device)  # a programmatic dependent launch (pdl.py)
    # TMA needs 16-byte aligned rows; the upcast products read the weight as any other load
    tma = tma and dependent and not upcast and width * weight.element_size() % 16 == 0 and weight.data_ptr() % 16 == 0
    tiles = TensorDescriptor.from_tensor(weight, [block_n, block_k]) if tma else weight
    arrivals = arrival_counters("gemv", MAX_BLOCKS, x.device)  # per column block
    _gemv[(blocks, slices)](
        x.contiguous(), delta.contiguous(), gain, total, weight, tiles, weight if bias is None else bias, out,
        partial, partial[squares_at:], arrivals, rows, n, eps, WIDTH=width, MODE=mode, OFFSET=offset,
        HAS_BIAS=bias is not None, UPCAST=upcast, GDC=dependent, SLICES=slices, SPAN=steps * block_k,
        BLOCK_N=block_n, BLOCK_K=block_k, UNROLL=tiling.unroll_from is not None and slices >= tiling.unroll_from,
        WEIGHT_FIRST=weight_first and not upcast, TMA=tma, num_warps=warps, num_stages=stages, launch_pdl=dependent)
    return out


if triton is not None:

    @triton.jit
    def _slice_rows(x, delta, gain, total, rows, r, k, write_total, WIDTH: tl.constexpr, MODE: tl.constexpr,
                    OFFSET: tl.constexpr, OUT: tl.constexpr):
        """(rows [16, BLOCK_K] of the projection's input at columns k before any 1/rms, rounded to OUT;
        their float32 sums of squares [16], zero for silu and plain)."""
        inside = (r < rows)[:, None] & (k < WIDTH)[None, :]
        if MODE == 2:  # silu(gate) * up: gate at column k, up at WIDTH + k of a 2 * WIDTH row
            at = r[:, None] * 2 * WIDTH + k[None, :]
            gate = tl.load(x + at, mask=inside, other=0.0).to(tl.float32)
            up = tl.load(x + at + WIDTH, mask=inside, other=0.0).to(tl.float32)
            return (gate / (1.0 + tl.exp(-gate)) * up).to(OUT), tl.zeros([16], dtype=tl.float32)
        at = r[:, None] * WIDTH + k[None, :]
        s = tl.load(x + at, mask=inside, other=0.0)
        if MODE == 3:  # no prologue
            return s.to(OUT), tl.zeros([16], dtype=tl.float32)
        if MODE == 1:
            s = (s.to(tl.float32) + tl.load(delta + at, mask=inside, other=0.0).to(tl.float32)).to(
                total.dtype.element_ty)
            if write_total:  # one column block writes the sum for the layers after
                tl.store(total + at, s, mask=inside)
        s = s.to(tl.float32)
        g = tl.load(gain + k, mask=k < WIDTH, other=0.0).to(tl.float32)
        if OFFSET:
            g = 1.0 + g
        return (s * g[None, :]).to(OUT), tl.sum(s * s, axis=1)

    @triton.jit
    def _finish(acc, squares, bias, out, rows, n, r, cols, eps, WIDTH: tl.constexpr, MODE: tl.constexpr,
                HAS_BIAS: tl.constexpr):
        if MODE < 2:  # the norm's 1/rms
            acc = acc * (1.0 / tl.sqrt(squares / WIDTH + eps))[:, None]
        if HAS_BIAS:
            acc += tl.load(bias + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
        tl.store(out + r[:, None] * n + cols[None, :], acc.to(out.dtype.element_ty),
                 mask=(r < rows)[:, None] & (cols < n)[None, :])

    @triton.jit
    def _add_parked(acc, squares, partial, partial_squares, j, block, rows, n, r, cols, tile, SLICES: tl.constexpr):
        """acc and squares plus slice j's parked sums [16, BLOCK_N] and squares [16], read through L2 (".cg"):
        other SMs wrote them."""
        sums = tl.load(partial + (j * rows + r[:, None]) * n + cols[None, :], mask=tile, other=0.0,
                       cache_modifier=".cg")
        return acc + sums, squares + tl.load(partial_squares + (block * SLICES + j) * 16 + r, cache_modifier=".cg")

    @triton.jit(do_not_specialize=["rows"])  # one binary for 1-16 rows: a row's result is the same
    def _gemv(x, delta, gain, total, weight, tiles, bias, out, partial, partial_squares, arrivals, rows, n, eps,
              WIDTH: tl.constexpr, MODE: tl.constexpr, OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
              UPCAST: tl.constexpr, GDC: tl.constexpr, SLICES: tl.constexpr, SPAN: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr, WEIGHT_FIRST: tl.constexpr,
              TMA: tl.constexpr):
        if GDC:  # launched as a dependent (pdl.py): wait for the kernel before and its writes
            tl.extra.cuda.gdc_wait()
        block, piece = tl.program_id(0), tl.program_id(1)
        r = tl.arange(0, 16)
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        if WEIGHT_FIRST:  # the products transposed, [BLOCK_N, 16], until the loop ends
            acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
        else:
            acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        squares = tl.zeros([16], dtype=tl.float32)
        for k0 in range(0, SPAN, BLOCK_K):
            k = piece * SPAN + k0 + tl.arange(0, BLOCK_K)
            a, sq = _slice_rows(x, delta, gain, total, rows, r, k, block == 0, WIDTH, MODE, OFFSET,
                                weight.dtype.element_ty)
            squares += sq
            if TMA:  # zeros past the weight's edges, as the masked load
                w = tiles.load([block * BLOCK_N, piece * SPAN + k0])
            else:
                w = tl.load(weight + cols[:, None] * WIDTH + k[None, :],
                            mask=(cols < n)[:, None] & (k < WIDTH)[None, :], other=0.0)
            if UPCAST:  # float32 weights (tf32 would round them), or bfloat16 in the interpreter (kernels/attention.py):
                # products summed per row, where numpy's matrix product rounds a row by its place in the tile
                acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
            elif WEIGHT_FIRST:
                acc = tl.dot(w, tl.trans(a), acc)
            else:
                acc += tl.dot(a, tl.trans(w))
        if WEIGHT_FIRST:
            acc = tl.trans(acc)
        if GDC:  # the next kernel may be placed now (it waits for this one's end before it reads)
            tl.extra.cuda.gdc_launch_dependents()
        if SLICES == 1:
            _finish(acc, squares, bias, out, rows, n, r, cols, eps, WIDTH, MODE, HAS_BIAS)
        else:  # park this slice's sums; the column block's last slice to arrive adds them in slice order
            tile = (r < rows)[:, None] & (cols < n)[None, :]
            tl.store(partial + (piece * rows + r[:, None]) * n + cols[None, :], acc, mask=tile)
            tl.store(partial_squares + (block * SLICES + piece) * 16 + r, squares)
            tl.debug_barrier()  # every thread's stores precede the release below
            if tl.atomic_add(arrivals + block, 1, sem="acq_rel", scope="gpu") == SLICES - 1:
                acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
                squares = tl.zeros([16], dtype=tl.float32)
                if UNROLL:  # every slice's loads in flight at once; the same sums in the same order
                    for j in tl.static_range(SLICES):
                        acc, squares = _add_parked(acc, squares, partial, partial_squares, j, block, rows, n, r,
                                                   cols, tile, SLICES)
                else:
                    for j in range(SLICES):
                        acc, squares = _add_parked(acc, squares, partial, partial_squares, j, block, rows, n, r,
                                                   cols, tile, SLICES)
                tl.atomic_xchg(arrivals + block, 0)  # ready for the next call
                _finish(acc, squares, bias, out, rows, n, r, cols, eps, WIDTH, MODE, HAS_BIAS)
