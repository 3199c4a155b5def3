"""Projections of a few rows (decode and verify steps) by a GGUF-quantized weight kept in its blocks (Triton),
reading each byte of the weight once.

A GGUF model's weights come in ggml's quantized blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 of 32 columns; the
k-quants Q2_K..Q6_K of 256). A decode step multiplies 1-16 rows by each weight and streams the weight once,
so the step is as fast as the weight's 2.6-8.5 bits a weight stream. A kernel that computes, for each element
of its weight tile, the addresses of the bytes its value comes from and loads them one byte at a time issues 4-6
loads a weight (the quant byte, the scale bytes, the float16 fields, the latter again for every element of the
block). On a GPU that is bound by load instructions, far below the memory's bandwidth: streaming a Q4_K weight
at the copy bandwidth takes about 27 weights a cycle on each SM, 100+ one-byte loads a cycle.

Here a program's step takes whole blocks of its BLOCK_N weight rows: one 256-column superblock of a k-quant,
or BLOCKS (4-8) 32-column blocks of the others. Each byte is loaded once, as contiguous runs of each row's
block (Q4_K's 128 quant bytes at row + superblock * 144 + 16 + arange: 16-byte vector loads), and the bits are
unpacked with shifts and masks over a dimension of their own: a tile of bytes [BLOCK_N, 4, 1, 32] shifted by
[0, 4] along its size-1 dimension gives the [BLOCK_N, 4, 2, 32] nibbles, elements c * 64 + h * 32 + i. The
scales, mins and float16 fields are loaded once per row and sub-block as small tiles ([BLOCK_N, 4, 2, 1] for
Q4_K's 8 sub-blocks) and broadcast over their sub-block's weights. The tiles' dimensions are chosen so that
their row-major order is the columns' order (Q2_K: [BLOCK_N, 2, 4, 2, 16] for 128-column halves, 2-bit shifts,
16-column sub-blocks): a step's weights reshape to [BLOCK_N, 256] in column order and take the rows' plain
[16, 256] tile. Q6_K would need six dimensions; it takes two products a step instead, each of 128 columns in a
permuted order (S = 0: the low nibbles of its 128 quant bytes, columns 0-63 and 128-191; S = 1: the high
nibbles, 64-127 and 192-255), with the rows' tile gathered in the same permutation (a few KB, cached). Either
way the order of a row's sum is fixed by the format and the tiling, never by the row count.

Dequantization computes ggml's float32 values exactly: the operations and their order of gguf.quants'
dequantize_blocks (Q4_K: (d * scale) * q - dmin * min), the launch without fused multiply-adds
(enable_fp_fusion=False: a fused d * scale * q - m rounds once where ggml rounds twice), and the small integers
q converted to float32 through their bits ((0x4B000000 | q) is 2**23 + q, less 2**23 exactly) rather than
the GPU's quarter-rate integer conversion. The weights are rounded to the rows' dtype before the product (bf16
rows: a bf16 tensor-core product, as a dequantize-to-bf16-then-GEMM would round the weight); float32 rows
take an IEEE product (tl.dot's "ieee" precision: fused multiply-adds over k in order, no tf32). In the
interpreter every dtype takes the upcast sum of products (numpy's matrix product rounds a row by its place in
the tile), and the kernel rounds to bfloat16 to nearest itself (ROUND): the interpreter truncates.

The reduction is split into SLICES of whole steps where a weight has too few row blocks for the SMs (Qwen3-8B's
4096-row projections at 32-64 rows a program: 64-128 programs for 132 SMs): the count comes from the weight's
shape and the SM count only (split: about `waves` programs an SM), never from the number of rows. A slice
parks its float32 sums; the last of a row block's slices to finish (arrivals.py's counter) adds them in slice
order, so the result does not depend on which program finishes last (gemv.py's scheme).

Rows are a tile of 16 padded with zeros, the kernel compiled once for 1-16 rows (do_not_specialize=["rows"]),
and the tiling and split never depend on the row count: a row's result is the same bits whatever the number
of rows in the call, so a speculative verify step projects each token exactly as a one-token decode step.

Alignment: row byte offsets are int64 (a large embedding passes 2 GiB). Q4_K's 144-byte and Q5_K's 176-byte
blocks keep 16-byte alignment and their strides are constexpr, so Triton proves it and loads 16 bytes an
instruction; Q2_K's 84 and Q4_1's 20 keep 4 bytes, Q5_1's 24 keep 8. Q6_K's 210-byte, Q3_K's 110, Q8_0's 34,
Q4_0's 18 and Q5_0's 22-byte blocks are only 2-byte aligned within a row: their loads are 2 bytes wide at
most (still a load per 2 bytes against 4-6 a weight).

tests/test_quant_gemv_kernel.py checks each format against gguf.quants.dequantize bit for bit (one-hot rows) and
a float32 product (bf16 and float32 rows, a bias, 3-D rows, partial tiles), a split reduction, the GPU's
products, and the bitwise row invariance with and without a split, on the CPU in
Triton's interpreter (`TRITON_INTERPRET=1`).

On an H100 (BENCHMARKS.md) this exact path streams 450-680 GB/s of Q4_K blocks and ~1 TB/s of Q8_0, the same for
1 and 16 rows: 0.7-0.8x bf16's time on a Qwen3-8B layer, some 10 SASS instructions a weight per thread. Q4_K and
Q6_K, the bulk of a Q4_K_M file, therefore take int8_rows.py's integer products with bf16 rows (INTEGER_FORMATS):
the rows quantized to int8, the quants used as int8 tiles (4 instructions a weight per thread for Q4_K), each
row's sums exact integers, so a row's bits still do not depend on the row count. A Qwen3-8B layer in Q4_K takes
124 us at 1 row (its bytes through tensor descriptors on Hopper) against the exact path's 218 and bf16's 155,
about 0.9 TB/s of blocks, a third of bf16's bandwidth; in Q6_K 247 us against the exact path's 263. float32 rows
keep the exact path.
A kernel that is fast at 1 row but not at 16 (torch's tinygemm: 2.0x bf16 at 1 row, 0.69x at 16) would not serve,
since a verify step must project as a decode step does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import int8_rows, pdl
from .arrivals import arrival_counters
from .triton_support import INTERPRETED, tl, triton

TILE = 16  # rows of the product (the kernel's tl.arange(0, 16))
DTYPES = (torch.bfloat16, torch.float32)
MAX_BLOCKS = 1 << 16  # row blocks of the largest weight (a 1M-row output at BLOCK_N 16): its arrival counters

# ggml type ids (gguf.GGMLQuantizationType) -> (columns a block, bytes a block)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 10, 11, 12, 13, 14
BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
          Q2_K: (256, 84), Q3_K: (256, 110), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
SUPPORTED: tuple[int, ...] = tuple(BLOCKS)
K_QUANTS = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)
# bf16 rows take int8_rows.py's integer products with these. Q8_0 stays exact: on it (its int8 quants straight
# to the dot, a float multiply-add a block) a Qwen3-8B layer took 315 us at 1 row against the exact path's 199 (H100)
INTEGER_FORMATS = (Q4_K, Q6_K)


@dataclass(frozen=True)
class Tiling:
    """How the kernel cuts a weight into programs and steps."""

    block_n: int  # weight rows a program (a power of 2, >= 16 for tl.dot)
    blocks: int  # ggml blocks a step for the 32-column formats (a power of 2); k-quants take 1 superblock
    warps: int
    stages: int
    waves: float  # programs per SM that the split of the reduction aims for (split; 0: no split)
    weight_first: bool = False  # the product as weights @ rows.T (the weights on the M side)


# Chosen from the format (and the dtype) alone, never from the number of rows; the shape decides the split.
# 64 rows a program, weight first, ~3 waves (after gemv.py's bf16 tiling): of 27 tilings timed on an H100 on Q4_K
# (BENCHMARKS.md), within 3% of the best on two of three Qwen3-8B shapes and 20% under on 4096x12288; every
# tiling streamed 300-680 GB/s. Under Triton 3.9 it spills Q6_K and Q3_K (32 rows do not; they ran slower).
GPU_TILINGS = {fmt: Tiling(64, 8, 4, 2, 3.0, True) for fmt in SUPPORTED}
# int8_rows.py's integer products, the weights on tl.dot's M side: 64 rows a program, 4 warps, ~4 waves. Of 12
# tilings on a Qwen3-8B layer (H100, BENCHMARKS.md) the fastest at 1 and 16 rows (148 / 152 us; 128 rows at 2
# waves 150 / 158; 8 warps 169-276), timed before Q4_K's bytes came through tensor descriptors (now 124 us at 1 row)
INTEGER_TILING = Tiling(64, 1, 4, 2, 4.0, True)
# float32 rows on the GPU (tests' tiny models): tl.dot in "ieee" precision (fused multiply-adds over k in
# order, no tensor cores); 32 rows spilled hundreds of registers
FLOAT32_TILING = Tiling(16, 4, 4, 1, 3.0)
# the interpreter: one program per 16 rows, 256 columns a step; the upcast products are [16, 16, 256]
INTERPRETED_TILING = Tiling(16, 8, 4, 1, 0.0)


def tiling(ggml_type: int, dtype: torch.dtype) -> Tiling:
    """The tiling of a weight in `ggml_type` for rows of `dtype` (the place for shape rules once measured)."""
    return INTEGER_TILING if integer(ggml_type, dtype) and not INTERPRETED else exact_tiling(ggml_type, dtype)


def exact_tiling(ggml_type: int, dtype: torch.dtype) -> Tiling:
    """The tiling of the exact (dequantizing) path: float32 rows, the formats outside INTEGER_FORMATS, and
    kernels/quant_moe.py's expert projections."""
    if INTERPRETED:
        return INTERPRETED_TILING
    return FLOAT32_TILING if dtype == torch.float32 else GPU_TILINGS[ggml_type]


def integer(ggml_type: int, dtype: torch.dtype) -> bool:
    """Whether rows of `dtype` are quantized to int8 for a weight in `ggml_type` (int8_rows.py): bf16 rows of
    the INTEGER_FORMATS. float32 rows (tests' tiny models, references) keep the exact dequantization."""
    return ggml_type in INTEGER_FORMATS and dtype == torch.bfloat16


def fits(x: torch.Tensor) -> bool:
    """Whether x's rows go through this kernel (else dequantize and torch's GEMM). Never decided by the
    number of rows within a tile: a verify step must project as a decode step does."""
    return x.numel() // x.shape[-1] <= TILE and x.dtype in DTYPES


def row_bytes(ggml_type: int, cols: int) -> int:
    """Bytes of one weight row of `cols` columns in format `ggml_type`."""
    qk, nbytes = BLOCKS[ggml_type]
    assert cols % qk == 0, (ggml_type, cols)
    return cols // qk * nbytes


def linear(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, cols: int, bias: torch.Tensor | None = None, *,
           rows8: tuple[torch.Tensor, ...] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequantize(blocks).T + bias for x [..., cols] (bf16 or float32, at most 16 rows) and blocks uint8
    [N, row_bytes] (row n's blocks contiguous, in ggml's order); [..., N] in x's dtype. The dequantized
    weights are rounded to x's dtype and the products summed in float32, but for `integer` formats and dtypes
    (bf16 rows of Q4_K and Q6_K), where the rows are quantized to int8 instead (int8_rows.py): `rows8`, where
    given, holds them (int8_rows.quantized_rows of x). out: where the result goes, [..., N] at any row stride
    (a projection's columns of a wider output); a new tensor when None."""
    assert x.dtype in DTYPES, x.dtype
    return _launch(x, blocks, ggml_type, cols, bias, tiling(ggml_type, x.dtype), INTERPRETED, rows8=rows8, out=out)


def quantized_rows_for(x: torch.Tensor, ggml_types: list[int]) -> tuple[torch.Tensor, ...] | None:
    """x's rows quantized to int8 (int8_rows.quantized_rows) where a weight of one of `ggml_types` takes them
    (`integer`), once for all of them; else None."""
    if not any(integer(t, x.dtype) for t in ggml_types):
        return None
    return int8_rows.quantized_rows(x.reshape(-1, x.shape[-1]))


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def split(row_blocks: int, steps: int, sms: int, waves: float) -> tuple[int, int]:
    """(slices, steps per slice) of a reduction of `steps` steps over `row_blocks` programs' rows on a device
    of `sms` SMs: about `waves` programs per SM (0: one slice), every slice non-empty (gemv.split). From
    the shapes only, never the number of rows: a verify step sums each row in the order a decode step does."""
    per = triton.cdiv(steps, min(steps, max(1, triton.cdiv(int(sms * waves), row_blocks))))
    return triton.cdiv(steps, per), per


def plan(ggml_type: int, n: int, cols: int, tile: Tiling, sms: int, slices: int | None = None
         ) -> tuple[int, int, int, int]:
    """(blocks a step, steps of a row, slices, steps a slice) of a weight [n, cols]; `slices` forces a count
    (at most the steps; the tests split small shapes with it)."""
    qk, _ = BLOCKS[ggml_type]
    nb = 1 if qk == 256 else tile.blocks
    steps = triton.cdiv(cols // qk, nb)
    if slices is None:
        return (nb, steps, *split(triton.cdiv(n, tile.block_n), steps, sms, tile.waves))
    per = triton.cdiv(steps, min(slices, steps))
    return nb, steps, triton.cdiv(steps, per), per


def _launch(x, blocks, ggml_type, cols, bias, tile: Tiling, upcast: bool, slices: int | None = None,
            rows8: tuple[torch.Tensor, ...] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    assert ggml_type in BLOCKS, f"ggml type {ggml_type} is not one of {SUPPORTED}"
    assert x.shape[-1] == cols and x.dtype in DTYPES, (x.shape, cols, x.dtype)
    rows = x.numel() // cols
    n = blocks.shape[0]
    assert rows <= TILE, rows
    assert blocks.dtype == torch.uint8 and blocks.dim() == 2 and blocks.shape[1] == row_bytes(ggml_type, cols), (
        blocks.dtype, blocks.shape, ggml_type, cols)
    assert bias is None or bias.shape == (n,), (None if bias is None else bias.shape, n)
    if out is None:
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    assert out.shape == (*x.shape[:-1], n) and out.dtype == x.dtype and out.stride(-1) == 1, (out.shape, out.stride())
    if rows == 0 or n == 0:
        return out
    blocks = blocks.contiguous()
    qk, nbytes = BLOCKS[ggml_type]
    row_blocks = triton.cdiv(n, tile.block_n)
    assert row_blocks <= MAX_BLOCKS, (n, tile.block_n)
    nb, steps, count, per = plan(ggml_type, n, cols, tile, _sms(x.device), slices)
    # the slices' float32 sums [slices, rows, n]
    partial = torch.empty(count * rows * n if count > 1 else 1, dtype=torch.float32, device=x.device)
    arrivals = arrival_counters("quant_gemv", MAX_BLOCKS, x.device)  # per row block
    x = x.reshape(rows, cols).contiguous()
    is_integer = integer(ggml_type, x.dtype)
    q, scales, sums = (rows8 or int8_rows.quantized_rows(x)) if is_integer else (x, x, x)
    out_rows = out.view(-1, n)  # rows at one stride (a column slice's too)
    # a programmatic dependent launch (pdl.py), on the integer path (timed there; the exact path was not)
    dependent = pdl.dependent(x.device) and is_integer
    # Hopper's bulk copies for the integer path's weight bytes (int8_rows.q4k_step): rows of whole 16-byte units
    tma = (dependent and ggml_type == Q4_K and not upcast and blocks.shape[1] % 16 == 0
           and blocks.data_ptr() % 16 == 0)
    heads = TensorDescriptor.from_tensor(blocks.view(torch.int32), [tile.block_n, 4]) if tma else blocks
    quants = TensorDescriptor.from_tensor(blocks, [tile.block_n, 32]) if tma else blocks
    _quant_gemv[(row_blocks, count)](
        x, q, scales, sums, blocks, heads, quants, blocks.view(torch.float16),
        blocks if bias is None else bias.contiguous(), out_rows, out_rows.stride(0), partial, arrivals, rows, n,
        COLS=cols, FMT=ggml_type, QK=qk, BLOCK_BYTES=nbytes, NB=nb, STEPS=steps, SPAN=per, SLICES=count,
        INTEGER=is_integer, EMULATE=INTERPRETED, TMA=tma, GDC=dependent, HAS_BIAS=bias is not None, UPCAST=upcast,
        IEEE=x.dtype == torch.float32,
        ROUND=INTERPRETED and x.dtype == torch.bfloat16, WEIGHT_FIRST=tile.weight_first and not upcast,
        BLOCK_N=tile.block_n, num_warps=tile.warps, num_stages=tile.stages, launch_pdl=dependent,
        enable_fp_fusion=False)  # ggml's roundings (the module docstring); the interpreter ignores it
    return out


if triton is not None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .int8_rows import q4k_step, q6k_step

    @triton.jit
    def _to_nearest(v, ROUND: tl.constexpr):
        """float32 v rounded to bfloat16's precision, to nearest (ties to even) where ROUND: the interpreter's
        conversion to bfloat16 truncates, the GPU's rounds to nearest (bf16 rounds v with its own conversion)."""
        if ROUND:
            bits = v.to(tl.int32, bitcast=True)
            v = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        return v

    @triton.jit
    def _small(q, BIAS: tl.constexpr):
        """float32(q - BIAS) for int32 0 <= q < 2**23, exactly: the float of bits 0x4B000000 | q is 2**23 + q
        (an OR and a subtraction, where the GPU's int-to-float conversion runs at a quarter of their rate)."""
        return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + BIAS)

    @triton.jit
    def _rows(x, r, rows, cols, COLS: tl.constexpr):
        """The rows' tile [16, K] at columns `cols` [K] (zeros past the rows and the columns)."""
        return tl.load(x + r[:, None] * COLS + cols[None, :], mask=(r < rows)[:, None] & (cols < COLS)[None, :],
                       other=0.0)

    @triton.jit
    def _product(acc, a, w, ROUND: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                 WEIGHT_FIRST: tl.constexpr):
        """acc plus the rows a [16, K] times the float32 weights w [BLOCK_N, K], rounded to a's dtype first."""
        w = _to_nearest(w, ROUND).to(a.dtype)
        if UPCAST:  # the interpreter (any dtype): products summed per row (gemv.py's UPCAST)
            acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        elif WEIGHT_FIRST:  # acc [BLOCK_N, 16]
            if IEEE:
                acc = tl.dot(w, tl.trans(a), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(a), acc)
        else:
            if IEEE:
                acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w), acc)
        return acc

    @triton.jit
    def _k_scale_min(blocks, at, s, live):
        """Q4_K / Q5_K: the 6-bit scales and mins (float32) of sub-blocks s (0..7, any shape) packed in the 12
        bytes at 4 (ggml's get_scale_min_k4); each byte of a tile over the 8 sub-blocks loaded once or twice."""
        a = tl.load(blocks + at + 4 + s, mask=live, other=0).to(tl.int32)  # s < 4: the scale; else the min's top
        b = tl.load(blocks + at + 8 + s, mask=live, other=0).to(tl.int32)  # s < 4: the min; else low bits of both
        c = tl.load(blocks + at + 4 + s % 4, mask=live, other=0).to(tl.int32)  # s >= 4: the scale's top bits
        low = s < 4
        scale = tl.where(low, a & 63, (b & 15) | ((c >> 6) << 4))
        least = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
        return scale.to(tl.float32), least.to(tl.float32)

    @triton.jit
    def _k_quant(acc, x, blocks, half, at, live, k0, r, rows, COLS: tl.constexpr, FMT: tl.constexpr,
                 BLOCK_N: tl.constexpr, ROUND: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                 WEIGHT_FIRST: tl.constexpr):
        """acc plus the rows' product with one superblock (256 columns from k0) of each weight row, the
        superblocks at bytes `at` [BLOCK_N] (int64; rows past the weight not `live`)."""
        if FMT == 12 or FMT == 13:  # Q4_K / Q5_K: f16 d, f16 dmin, scales[12], (Q5_K: qh[32]), qs[128]
            # element c * 64 + h * 32 + i: nibble h of qs[c * 32 + i] (Q5_K: bit 2c + h of qh[i] above it),
            # sub-block 2c + h
            c = tl.arange(0, 4)[None, :, None, None]
            h = tl.arange(0, 2)[None, None, :, None]
            i = tl.arange(0, 32)[None, None, None, :]
            at4 = at[:, None, None, None]
            live4 = live[:, None, None, None]
            QS: tl.constexpr = 16 if FMT == 12 else 48
            q = (tl.load(blocks + at4 + QS + c * 32 + i, mask=live4, other=0).to(tl.int32) >> (h * 4)) & 15
            if FMT == 13:
                high = tl.load(blocks + at4 + 16 + i, mask=live4, other=0).to(tl.int32)  # [BLOCK_N, 1, 1, 32]
                q = q | (((high >> (c * 2 + h)) & 1) << 4)
            scale, least = _k_scale_min(blocks, at4, c * 2 + h, live4)  # [BLOCK_N, 4, 2, 1]
            d = tl.load(half + (at4 >> 1), mask=live4, other=0.0).to(tl.float32)
            dmin = tl.load(half + (at4 >> 1) + 1, mask=live4, other=0.0).to(tl.float32)
            w = (d * scale) * _small(q, 0) - dmin * least
            acc = _product(acc, _rows(x, r, rows, k0 + tl.arange(0, 256), COLS), tl.reshape(w, [BLOCK_N, 256]),
                           ROUND, UPCAST, IEEE, WEIGHT_FIRST)
        elif FMT == 14:  # Q6_K: ql[128], qh[64], int8 scales[16], f16 d
            # element H * 128 + S * 64 + s * 32 + g * 16 + i: nibble S of ql[H * 64 + s * 32 + g * 16 + i], bits
            # 2(2S + s) of qh[H * 32 + g * 16 + i] above it, sub-block H * 8 + S * 4 + s * 2 + g; a product per S
            big = tl.arange(0, 2)[None, :, None, None, None]  # H
            s = tl.arange(0, 2)[None, None, :, None, None]
            g = tl.arange(0, 2)[None, None, None, :, None]
            i = tl.arange(0, 16)[None, None, None, None, :]
            at5 = at[:, None, None, None, None]
            live5 = live[:, None, None, None, None]
            low = tl.load(blocks + at5 + big * 64 + s * 32 + g * 16 + i, mask=live5, other=0).to(tl.int32)
            high = tl.load(blocks + at5 + 128 + big * 32 + g * 16 + i, mask=live5, other=0).to(tl.int32)
            d = tl.load(half + (at5 >> 1) + 104, mask=live5, other=0.0).to(tl.float32)
            for S in tl.static_range(2):
                q = ((low >> (S * 4)) & 15) | (((high >> ((S * 2 + s) * 2)) & 3) << 4)
                scale = tl.load(blocks + at5 + 192 + big * 8 + S * 4 + s * 2 + g, mask=live5, other=0).to(tl.int32)
                w = (d * _small(scale ^ 128, 128)) * _small(q, 32)  # [BLOCK_N, 2, 2, 2, 16]
                cols = k0 + tl.reshape(big * 128 + S * 64 + s * 32 + g * 16 + i, [128])
                acc = _product(acc, _rows(x, r, rows, cols, COLS), tl.reshape(w, [BLOCK_N, 128]),
                               ROUND, UPCAST, IEEE, WEIGHT_FIRST)
        else:  # Q2_K (10): scales[16], qs[64], f16 d, f16 dmin; Q3_K (11): hmask[32], qs[64], scales[12], f16 d
            # element h * 128 + s * 32 + g * 16 + i: bits 2s of qs[h * 32 + g * 16 + i] (Q3_K: bit 4h + s of
            # hmask[g * 16 + i] above them), sub-block h * 8 + s * 2 + g
            h = tl.arange(0, 2)[None, :, None, None, None]
            s = tl.arange(0, 4)[None, None, :, None, None]
            g = tl.arange(0, 2)[None, None, None, :, None]
            i = tl.arange(0, 16)[None, None, None, None, :]
            at5 = at[:, None, None, None, None]
            live5 = live[:, None, None, None, None]
            QS: tl.constexpr = 16 if FMT == 10 else 32
            q = (tl.load(blocks + at5 + QS + h * 32 + g * 16 + i, mask=live5, other=0).to(tl.int32) >> (s * 2)) & 3
            if FMT == 10:
                sc = tl.load(blocks + at5 + h * 8 + s * 2 + g, mask=live5, other=0).to(tl.int32)  # [BN, 2, 4, 2, 1]
                d = tl.load(half + (at5 >> 1) + 40, mask=live5, other=0.0).to(tl.float32)
                dmin = tl.load(half + (at5 >> 1) + 41, mask=live5, other=0.0).to(tl.float32)
                w = (d * (sc & 15).to(tl.float32)) * _small(q, 0) - dmin * (sc >> 4).to(tl.float32)
            else:
                high = tl.load(blocks + at5 + g * 16 + i, mask=live5, other=0).to(tl.int32)  # [BN, 1, 1, 2, 16]
                q = q | (((high >> (h * 4 + s)) & 1) << 2)  # q - 4: 4 subtracted where the mask's bit is clear
                # the 6-bit scale of sub-block h * 8 + 2s + g: low 4 bits in byte 96 + 2s + g at 4h, high 2 bits
                # in byte 104 + (2s + g) % 4 at 2((8h + 2s + g) // 4)
                sl = tl.load(blocks + at5 + 96 + s * 2 + g, mask=live5, other=0).to(tl.int32)  # [BN, 1, 4, 2, 1]
                sh = tl.load(blocks + at5 + 104 + (s * 2 + g) % 4, mask=live5, other=0).to(tl.int32)
                scale = ((sl >> (h * 4)) & 15) | (((sh >> ((h * 8 + s * 2 + g) // 4 * 2)) & 3) << 4)
                d = tl.load(half + (at5 >> 1) + 54, mask=live5, other=0.0).to(tl.float32)
                w = (d * (scale - 32).to(tl.float32)) * _small(q, 4)
            acc = _product(acc, _rows(x, r, rows, k0 + tl.arange(0, 256), COLS), tl.reshape(w, [BLOCK_N, 256]),
                           ROUND, UPCAST, IEEE, WEIGHT_FIRST)
        return acc

    @triton.jit
    def _small_blocks(acc, x, blocks, half, at, live, step, r, rows, COLS: tl.constexpr, FMT: tl.constexpr,
                      BLOCK_BYTES: tl.constexpr, NB: tl.constexpr, BLOCK_N: tl.constexpr, ROUND: tl.constexpr,
                      UPCAST: tl.constexpr, IEEE: tl.constexpr, WEIGHT_FIRST: tl.constexpr):
        """acc plus the rows' product with NB blocks of 32 columns (step `step`) of each weight row, the step's
        first block at bytes `at` [BLOCK_N] (int64); blocks past the row's end read as zeros."""
        b = tl.arange(0, NB)[None, :, None]
        inside = live[:, None, None] & (step * NB + b < COLS // 32)  # [BLOCK_N, NB, 1]
        at3 = at[:, None, None] + b * BLOCK_BYTES  # each block's bytes
        d = tl.load(half + (at3 >> 1), mask=inside, other=0.0).to(tl.float32)  # [BLOCK_N, NB, 1]
        if FMT == 8:  # Q8_0: f16 d, int8 qs[32]
            i = tl.arange(0, 32)[None, None, :]
            q = tl.load(blocks + at3 + 2 + i, mask=inside, other=0).to(tl.int32)
            w = _small(q ^ 128, 128) * d
        elif FMT == 2 or FMT == 3:  # Q4_0: f16 d, qs[16]; Q4_1: f16 d, f16 m, qs[16]
            # element h * 16 + i: nibble h of qs[i]
            h = tl.arange(0, 2)[None, None, :, None]
            i = tl.arange(0, 16)[None, None, None, :]
            at4 = at3[:, :, :, None]
            inside4 = inside[:, :, :, None]
            QS: tl.constexpr = 2 if FMT == 2 else 4
            q = (tl.load(blocks + at4 + QS + i, mask=inside4, other=0).to(tl.int32) >> (h * 4)) & 15
            d = d[:, :, :, None]
            if FMT == 2:
                w = d * _small(q, 8)
            else:
                w = d * _small(q, 0) + tl.load(half + (at4 >> 1) + 1, mask=inside4, other=0.0).to(tl.float32)
        else:  # Q5_0 (6): f16 d, qh[4], qs[16]; Q5_1 (7): f16 d, f16 m, qh[4], qs[16]
            # element h * 16 + g * 8 + i: nibble h of qs[g * 8 + i], bit i of qh[2h + g] above it
            h = tl.arange(0, 2)[None, None, :, None, None]
            g = tl.arange(0, 2)[None, None, None, :, None]
            i = tl.arange(0, 8)[None, None, None, None, :]
            at5 = at3[:, :, :, None, None]
            inside5 = inside[:, :, :, None, None]
            QH: tl.constexpr = 2 if FMT == 6 else 4
            q = (tl.load(blocks + at5 + QH + 4 + g * 8 + i, mask=inside5, other=0).to(tl.int32) >> (h * 4)) & 15
            high = tl.load(blocks + at5 + QH + h * 2 + g, mask=inside5, other=0).to(tl.int32)  # [BN, NB, 2, 2, 1]
            q = q | (((high >> i) & 1) << 4)
            d = d[:, :, :, None, None]
            if FMT == 6:
                w = d * _small(q, 16)
            else:
                w = d * _small(q, 0) + tl.load(half + (at5 >> 1) + 1, mask=inside5, other=0.0).to(tl.float32)
        cols = step * (NB * 32) + tl.arange(0, NB * 32)
        return _product(acc, _rows(x, r, rows, cols, COLS), tl.reshape(w, [BLOCK_N, NB * 32]),
                        ROUND, UPCAST, IEEE, WEIGHT_FIRST)

    @triton.jit
    def _project(x, blocks, half, row_at, first, stop, live, r, rows, COLS: tl.constexpr, FMT: tl.constexpr,
                 QK: tl.constexpr, BLOCK_BYTES: tl.constexpr, NB: tl.constexpr, BLOCK_N: tl.constexpr,
                 ROUND: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, WEIGHT_FIRST: tl.constexpr):
        """The rows' tile (row i: x's row r[i] where r[i] < rows, else zeros) times the weight rows whose blocks
        start at byte row_at [BLOCK_N] (`live`: rows that exist), over steps [first, stop) of the reduction:
        [16, BLOCK_N] float32 (kernels/quant_moe.py projects an expert's rows with it too)."""
        STEP_BYTES: tl.constexpr = NB * BLOCK_BYTES
        if WEIGHT_FIRST and not UPCAST:  # the products transposed, [BLOCK_N, 16], until the loop ends
            acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
        else:
            acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        for step in range(first, stop):
            at = row_at + step * STEP_BYTES
            if QK == 256:
                acc = _k_quant(acc, x, blocks, half, at, live, step * 256, r, rows, COLS, FMT, BLOCK_N, ROUND,
                               UPCAST, IEEE, WEIGHT_FIRST)
            else:
                acc = _small_blocks(acc, x, blocks, half, at, live, step, r, rows, COLS, FMT, BLOCK_BYTES, NB,
                                    BLOCK_N, ROUND, UPCAST, IEEE, WEIGHT_FIRST)
        if WEIGHT_FIRST and not UPCAST:
            acc = tl.trans(acc)
        return acc

    @triton.jit
    def _finish(acc, bias, out, out_stride, rows, n, r, outs, HAS_BIAS: tl.constexpr, ROUND: tl.constexpr):
        if HAS_BIAS:
            acc += tl.load(bias + outs, mask=outs < n, other=0.0).to(tl.float32)[None, :]
        tl.store(out + r[:, None] * out_stride + outs[None, :], _to_nearest(acc, ROUND).to(out.dtype.element_ty),
                 mask=(r < rows)[:, None] & (outs < n)[None, :])

    @triton.jit(do_not_specialize=["rows"])  # one binary for 1-16 rows: a row's result is the same
    def _quant_gemv(x, q, scales, sums, blocks, heads, quants, half, bias, out, out_stride, partial, arrivals, rows, n,
                    COLS: tl.constexpr, FMT: tl.constexpr, QK: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                    NB: tl.constexpr, STEPS: tl.constexpr, SPAN: tl.constexpr, SLICES: tl.constexpr,
                    INTEGER: tl.constexpr, EMULATE: tl.constexpr, TMA: tl.constexpr, GDC: tl.constexpr,
                    HAS_BIAS: tl.constexpr,
                    UPCAST: tl.constexpr, IEEE: tl.constexpr, ROUND: tl.constexpr,
                    WEIGHT_FIRST: tl.constexpr, BLOCK_N: tl.constexpr):
        """x's rows times row block `block` of the weight over slice `piece` of the reduction; with INTEGER, the
        rows quantized (q, scales, sums: int8_rows.quantized_rows) and int8_rows' integer products (EMULATE: the
        interpreter, without inline PTX)."""
        if GDC:  # launched as a dependent (pdl.py): wait for the kernel before (the rows' quantization) and its writes
            tl.extra.cuda.gdc_wait()
        block, piece = tl.program_id(0), tl.program_id(1)
        r = tl.arange(0, 16)
        outs = block * BLOCK_N + tl.arange(0, BLOCK_N)
        live = outs < n
        # byte offset of each weight row (int64: a large embedding passes 2 GiB); constexpr strides, so that
        # Triton sees the blocks' alignment. Rows past n read row n - 1, unmasked (their sums are not stored).
        ROW_BYTES: tl.constexpr = (COLS // QK) * BLOCK_BYTES
        row_at = tl.minimum(outs, n - 1).to(tl.int64) * ROW_BYTES
        first, stop = piece * SPAN, tl.minimum(piece * SPAN + SPAN, STEPS)
        if INTEGER:
            acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
            for step in range(first, stop):
                if FMT == 12:
                    acc = q4k_step(acc, q, scales, sums, rows, blocks, heads, quants, row_at + step * BLOCK_BYTES,
                                   block * BLOCK_N, step, COLS, EMULATE, TMA)
                else:
                    acc = q6k_step(acc, q, scales, sums, rows, blocks, row_at + step * BLOCK_BYTES, step, COLS,
                                   EMULATE)
            acc = tl.trans(acc)
        else:
            acc = _project(x, blocks, half, row_at, first, stop, live, r, rows, COLS, FMT, QK, BLOCK_BYTES, NB,
                           BLOCK_N, ROUND, UPCAST, IEEE, WEIGHT_FIRST)
        if GDC:  # the next kernel may be placed now (it waits for this one's end before it reads)
            tl.extra.cuda.gdc_launch_dependents()
        if SLICES == 1:
            _finish(acc, bias, out, out_stride, rows, n, r, outs, HAS_BIAS, ROUND)
        else:  # park this slice's sums; the row block's last slice to arrive adds them in slice order
            tile = (r < rows)[:, None] & live[None, :]
            tl.store(partial + (piece * rows + r[:, None]) * n + outs[None, :], acc, mask=tile)
            tl.debug_barrier()  # every thread's stores precede the release below
            if tl.atomic_add(arrivals + block, 1, sem="acq_rel", scope="gpu") == SLICES - 1:
                acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
                for j in range(SLICES):  # read through L2 (".cg"): other SMs wrote them
                    acc += tl.load(partial + (j * rows + r[:, None]) * n + outs[None, :], mask=tile, other=0.0,
                                   cache_modifier=".cg")
                tl.atomic_xchg(arrivals + block, 0)  # ready for the next call
                _finish(acc, bias, out, out_stride, rows, n, r, outs, HAS_BIAS, ROUND)
