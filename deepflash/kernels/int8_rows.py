"""Rows quantized to int8 and integer products with k-quant blocks on int8 tensor cores (Triton).

quant_gemv.py's exact path turns every weight into a float (ggml's dequantization, then bf16) before the
tensor-core product: some 10 instructions a weight per thread compiled for sm_90, twice what streaming a Q4_K
weight at the memory's bandwidth allows. Here the rows are quantized instead, as llama.cpp's CPU dot
products do (its q8_K): each row's 256-column chunks to int8, q = round(x / d) with d = max |x| / 127, with the
sums of q over each 32 columns. A Q4_K superblock then needs its 4-bit quants only as int8 tiles (one LOP3
turns 4 bytes' low nibbles into 4 int8, a shift and a LOP3 the high ones), and its sums are exact integers:

    x . w = d_x * (d * sum_j sc_j * (q_x . q_j) - dmin * sum_j m_j * sum(q_x over sub-block j))

for the 8 sub-blocks j of 32 columns with their 6-bit scales sc_j and mins m_j. The products q_x . q_j are
tl.dot of int8 [BLOCK_N, 32] by [32, 16] into int32 (IGMMA on an H100), the rest integer multiply-adds on
the [BLOCK_N, 16] tile and a float epilogue once a superblock: about 4 SASS instructions a weight per thread at
64 rows a program, compiled for sm_90 (quant_gemv.py's exact path: 9.5).

Integer sums are exact, so a row's result depends on its own chunks alone: the same bits whatever the
number of rows in the call, as the exact path guarantees. The price is the rows' rounding to int8: each
product is off by at most d_x / 2 * sum |w| over a chunk, the error of llama.cpp's CPU path, against the
dequantize-then-GEMM of bf16 rows (tests/test_quant_gemv_kernel.py bounds it).
"""

from __future__ import annotations

import torch

from .triton_support import tl, triton

CHUNK = 256  # columns of a row sharing one int8 scale
SUM = 32  # columns of each integer sum (a Q4_K sub-block)
TILE = 16  # rows of the product: the quantized rows are padded to it with zeros


def quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows <= 16, cols] (cols a multiple of 256) as int8 q [16, cols], float32 scales d [16, cols / 256]
    and int32 sums [16, cols / 32] of q; rows past x's are left unwritten (the products do not read them)."""
    rows, cols = x.shape
    assert rows <= TILE and cols % CHUNK == 0, (rows, cols)
    q = torch.empty(TILE, cols, dtype=torch.int8, device=x.device)
    scales = torch.empty(TILE, cols // CHUNK, dtype=torch.float32, device=x.device)
    sums = torch.empty(TILE, cols // SUM, dtype=torch.int32, device=x.device)
    _quantize[(rows, cols // CHUNK)](x.contiguous(), q, scales, sums, COLS=cols, num_warps=4)
    return q, scales, sums


if triton is not None:
    _LOW_NIBBLES = tl.constexpr("lop3.b32 $0, $1, 0x0F0F0F0F, 0, 0xC0;")  # $1 & 0x0F0F0F0F
    _HIGH_NIBBLES = tl.constexpr("{ .reg .b32 t; shr.b32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F; }")

    @triton.jit
    def _quantize(x, q, scales, sums, COLS: tl.constexpr):
        """Row r's chunk c: q = x / d rounded half away from zero (ggml's roundf), d = max |x| / 127."""
        r, c = tl.program_id(0), tl.program_id(1)
        cols = c * 256 + tl.arange(0, 8)[:, None] * 32 + tl.arange(0, 32)[None, :]  # [8 sums, 32]
        v = tl.load(x + r * COLS + cols).to(tl.float32)
        peak = tl.max(tl.max(tl.abs(v), axis=1), axis=0)
        scaled = v * tl.where(peak > 0, 127.0 / tl.where(peak > 0, peak, 1.0), 0.0)
        units = tl.where(scaled >= 0, tl.floor(scaled + 0.5), -tl.floor(0.5 - scaled)).to(tl.int32)
        tl.store(q + r * COLS + cols, units.to(tl.int8))
        tl.store(sums + r * (COLS // 32) + c * 8 + tl.arange(0, 8), tl.sum(units, axis=1))
        tl.store(scales + r * (COLS // 256) + c, peak / 127.0)

    @triton.jit
    def _nibbles(b, HIGH: tl.constexpr, EMULATE: tl.constexpr):
        """The low (or HIGH) nibbles of uint8 b as int8, 4 bytes an instruction (EMULATE: the interpreter)."""
        if EMULATE:
            return ((b >> (4 * HIGH)) & 15).to(tl.int8)
        elif HIGH:
            return tl.inline_asm_elementwise(_HIGH_NIBBLES, "=r,r", [b], dtype=tl.int8, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(_LOW_NIBBLES, "=r,r", [b], dtype=tl.int8, is_pure=True, pack=4)

    @triton.jit
    def _q4k_scales(fields, w0, w1, w2):
        """Q4_K's f16 d and dmin (float32) and its 8 sub-blocks' 6-bit scales and mins as the bytes of 4 words
        (scales 0-3, 4-7, mins 0-3, 4-7): ggml's get_scale_min_k4 on 4 sub-blocks an instruction, from the
        block's first 16 bytes as int32 words ([BLOCK_N] each)."""
        d = (fields & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = ((fields >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return (d, dmin, w0 & 0x3F3F3F3F, (w2 & 0x0F0F0F0F) | ((w0 >> 2) & 0x30303030),
                w1 & 0x3F3F3F3F, ((w2 >> 4) & 0x0F0F0F0F) | ((w1 >> 2) & 0x30303030))

    @triton.jit
    def _q4k_head(blocks, heads, at, row0, step, TMA: tl.constexpr):
        """The first 16 bytes of superblock `step` of each weight row as 4 int32 words [BLOCK_N]: through the
        tensor descriptor `heads` (blocks as int32 [N, row_bytes / 4], tiles [BLOCK_N, 4]) where TMA, else
        loaded at bytes `at`."""
        if TMA:
            words = tl.reshape(heads.load([row0, step * 36]), [at.shape[0], 2, 2])
            even, odd = tl.split(words)  # words 0, 2 and 1, 3
            fields, w1 = tl.split(even)
            w0, w2 = tl.split(odd)
        else:
            head = (blocks + at).to(tl.pointer_type(tl.int32))
            fields = tl.load(head)
            w0 = tl.load(head + 1)
            w1 = tl.load(head + 2)
            w2 = tl.load(head + 3)
        return fields, w0, w1, w2

    @triton.jit
    def q4k_step(acc, q, scales, sums, rows, blocks, heads, quants, at, row0, step, COLS: tl.constexpr,
                 EMULATE: tl.constexpr, TMA: tl.constexpr):
        """acc [BLOCK_N, 16] plus the product of the `rows` quantized rows (q, scales, sums: quantized_rows; the
        tile's other rows read as zeros, no bytes moved: a decode step reads one row) with superblock `step` of
        weight rows row0.. (bytes `at` [BLOCK_N], int64, inside the weight: rows past its end read another row's
        bytes, for the caller to drop). With TMA the weight's bytes come through the tensor descriptors `heads`
        and `quants` (blocks as uint8 [N, row_bytes], tiles [BLOCK_N, 32]): Hopper's bulk copies, which Triton
        stages num_stages steps ahead (plain loads feeding the nibbles' inline PTX are not)."""
        r = tl.arange(0, 16)
        real = r < rows
        i = tl.arange(0, 32)
        fields, w0, w1, w2 = _q4k_head(blocks, heads, at, row0, step, TMA)
        d, dmin, sc03, sc47, mn03, mn47 = _q4k_scales(fields, w0, w1, w2)
        dots = tl.zeros(acc.shape, dtype=tl.int32)  # sum_j sc_j * (q_x . q_j)
        mins = tl.zeros(acc.shape, dtype=tl.int32)  # sum_j m_j * sum(q_x over j)
        for c in tl.static_range(4):  # bytes 16 + 32c..: sub-block 2c in the low nibbles, 2c + 1 in the high
            if TMA:
                b = quants.load([row0, step * 144 + 16 + c * 32])
            else:
                b = tl.load(blocks + at[:, None] + 16 + c * 32 + i[None, :])
            for h in tl.static_range(2):
                if c < 2:
                    sc = (sc03 >> (16 * c + 8 * h)) & 255
                    mn = (mn03 >> (16 * c + 8 * h)) & 255
                else:
                    sc = (sc47 >> (16 * c - 32 + 8 * h)) & 255
                    mn = (mn47 >> (16 * c - 32 + 8 * h)) & 255
                x = tl.load(q + r[:, None] * COLS + step * 256 + c * 64 + h * 32 + i[None, :], mask=real[:, None],
                            other=0)  # [16, 32]
                dots += sc[:, None] * tl.dot(_nibbles(b, h, EMULATE), tl.trans(x))
                row_sums = tl.load(sums + r * (COLS // 32) + step * 8 + 2 * c + h, mask=real, other=0)
                mins += mn[:, None] * row_sums[None, :]
        row_scale = tl.load(scales + r * (COLS // 256) + step, mask=real, other=0.0)
        return acc + (d[:, None] * dots.to(tl.float32) - dmin[:, None] * mins.to(tl.float32)) * row_scale[None, :]
