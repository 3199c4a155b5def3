"""Rows quantized to int8 and integer products with k-quant blocks on int8 tensor cores (Triton).

quant_gemv.py's exact path turns every weight into a float (ggml's dequantization, then bf16) before the
tensor-core product: some 10 instructions a weight per thread compiled for sm_90, twice what streaming a Q4_K
weight at the memory's bandwidth allows. Here the rows are quantized instead, as llama.cpp's CPU dot
products do (its q8_K): each row's 256-column chunks to int8, q = round(x / d) with d = max |x| / 127, with the
sums of q over each 16 columns (two make a Q4_K sub-block's). A Q4_K superblock then needs its 4-bit quants only as int8 tiles (one LOP3
turns 4 bytes' low nibbles into 4 int8, a shift and a LOP3 the high ones), and its sums are exact integers:

    x . w = d_x * (d * sum_j sc_j * (q_x . q_j) - dmin * sum_j m_j * sum(q_x over sub-block j))

for the 8 sub-blocks j of 32 columns with their 6-bit scales sc_j and mins m_j. The products q_x . q_j are
tl.dot of int8 [BLOCK_N, 32] by [32, 16] into int32 (IGMMA on an H100), the rest integer multiply-adds on
the [BLOCK_N, 16] tile and a float epilogue once a superblock: about 4 SASS instructions a weight per thread at
64 rows a program, compiled for sm_90 (quant_gemv.py's exact path: 9.5). On Hopper the Q4_K bytes come
through tensor descriptors, which Triton stages num_stages steps ahead. A Qwen3-8B layer's seven projections at 1
row on an H100: 124 us (the exact path 219, bf16 155).

Q6_K (q6k_step) is the same with 16 sub-blocks of 16 columns, int8 scales and unsigned 6-bit quants less 32
(the 32 times the rows' sums of 16 columns); its 210-byte blocks keep only 2-byte alignment, so its bytes come in
2-byte loads (9.8 SASS instructions a weight per thread at 64 rows, against the exact path's 15.7 with spills;
a Qwen3-8B layer at 1 row on an H100: 247 us against the exact path's 263).

Integer sums are exact, so a row's result depends on its own chunks alone: the same bits whatever the
number of rows in the call, as the exact path guarantees. The price is the rows' rounding to int8: each
product is off by at most d_x / 2 * sum |w| over a chunk, the error of llama.cpp's CPU path, against the
dequantize-then-GEMM of bf16 rows (tests/test_quant_gemv_kernel.py bounds it).
"""

from __future__ import annotations

import torch

from . import pdl
from .triton_support import tl, triton

CHUNK = 256  # columns of a row sharing one int8 scale
SUM = 16  # columns of each integer sum (a Q6_K sub-block; Q4_K's of 32 add two)
TILE = 16  # rows of the product: the quantized rows are padded to it with zeros


def quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows <= 16, cols] (cols a multiple of 256) as int8 q [16, cols], float32 scales d [16, cols / 256]
    and int32 sums [16, cols / 16] of q; rows past x's are left unwritten (the products do not read them)."""
    rows, cols = x.shape
    assert rows <= TILE, (rows, cols)
    q, scales, sums = row_buffers(cols, x.device)
    dependent = pdl.dependent(x.device)  # a programmatic dependent launch (pdl.py)
    _quantize[(rows, cols // CHUNK)](x.contiguous(), q, scales, sums, COLS=cols, GDC=dependent, num_warps=4,
                                     launch_pdl=dependent)
    return q, scales, sums


def row_buffers(cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty (q, scales, sums) for 16 rows of `cols` columns as quantized_rows returns them: where a kernel that
    makes rows writes their int8 form beside them (layer_ops.add_rms_norm, layer_ops.silu_mul: store_quantized),
    which saves quantized_rows' launch."""
    assert cols % CHUNK == 0, cols
    return (torch.empty(TILE, cols, dtype=torch.int8, device=device),
            torch.empty(TILE, cols // CHUNK, dtype=torch.float32, device=device),
            torch.empty(TILE, cols // SUM, dtype=torch.int32, device=device))


if triton is not None:
    _LOW_NIBBLES = tl.constexpr("lop3.b32 $0, $1, 0x0F0F0F0F, 0, 0xC0;")  # $1 & 0x0F0F0F0F
    _HIGH_NIBBLES = tl.constexpr("{ .reg .b32 t; shr.b32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F; }")
    # Q6_K's 6-bit quants, 4 bytes an instruction or so: nibble S of the low bytes $1 (shift 4S) below bits
    # 2(2S + s) of the high bytes $2, for the 4 (S, s)
    _Q6 = ("{ .reg .b32 a, b; shr.b32 a, $1, LOW; and.b32 a, a, 0x0F0F0F0F; "
           "shr.b32 b, $2, HIGH; and.b32 b, b, 0x03030303; shl.b32 b, b, 4; or.b32 $0, a, b; }")
    _Q6_00 = tl.constexpr(_Q6.replace("LOW", "0").replace("HIGH", "0"))
    _Q6_01 = tl.constexpr(_Q6.replace("LOW", "0").replace("HIGH", "2"))
    _Q6_10 = tl.constexpr(_Q6.replace("LOW", "4").replace("HIGH", "4"))
    _Q6_11 = tl.constexpr(_Q6.replace("LOW", "4").replace("HIGH", "6"))

    @triton.jit
    def store_quantized(v, q, scales, sums, r, chunk0, COLS: tl.constexpr):
        """Row r's chunks chunk0.. (v [chunks, 16, 16] float32, the row's values as stored in its dtype; chunks
        past COLS are dropped) into quantized_rows' buffers: q = x / d rounded half away from zero (ggml's
        roundf), d = max |x| / 127, and the sums of q over each 16 columns."""
        peak = tl.max(tl.max(tl.abs(v), axis=2), axis=1)  # [chunks]
        scaled = v * tl.where(peak > 0, 127.0 / tl.where(peak > 0, peak, 1.0), 0.0)[:, None, None]
        units = tl.where(scaled >= 0, tl.floor(scaled + 0.5), -tl.floor(0.5 - scaled)).to(tl.int32)
        c = chunk0 + tl.arange(0, v.shape[0])
        inside = c < COLS // 256
        cols = c[:, None, None] * 256 + tl.arange(0, 16)[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
        tl.store(q + r * COLS + cols, units.to(tl.int8), mask=inside[:, None, None])
        tl.store(sums + r * (COLS // 16) + c[:, None] * 16 + tl.arange(0, 16)[None, :], tl.sum(units, axis=2),
                 mask=inside[:, None])
        tl.store(scales + r * (COLS // 256) + c, peak / 127.0, mask=inside)

    @triton.jit
    def _quantize(x, q, scales, sums, COLS: tl.constexpr, GDC: tl.constexpr):
        """Row r's chunk c (store_quantized)."""
        if GDC:  # launched as a dependent (pdl.py): wait for the kernel before (the rows' producer) and its writes
            tl.extra.cuda.gdc_wait()
        r, c = tl.program_id(0), tl.program_id(1)
        cols = c * 256 + tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]  # [16 sums, 16]
        v = tl.load(x + r * COLS + cols).to(tl.float32)
        if GDC:  # the projection may be placed now (it waits for this kernel's end before it reads)
            tl.extra.cuda.gdc_launch_dependents()
        store_quantized(tl.reshape(v, [1, 16, 16]), q, scales, sums, r, c, COLS)

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
                pair = sums + r * (COLS // 16) + step * 16 + 4 * c + 2 * h  # the sub-block's two sums of 16
                row_sums = tl.load(pair, mask=real, other=0) + tl.load(pair + 1, mask=real, other=0)
                mins += mn[:, None] * row_sums[None, :]
        row_scale = tl.load(scales + r * (COLS // 256) + step, mask=real, other=0.0)
        return acc + (d[:, None] * dots.to(tl.float32) - dmin[:, None] * mins.to(tl.float32)) * row_scale[None, :]

    @triton.jit
    def _q6_quants(low, high, S: tl.constexpr, s: tl.constexpr, EMULATE: tl.constexpr):
        """Q6_K's unsigned 6-bit quants (int8, 0..63) of the 32 columns (H, S, s): nibble S of the low bytes
        `low` [BLOCK_N, 32] below bits 2(2S + s) of the high bytes `high` (EMULATE: the interpreter)."""
        if EMULATE:
            return (((low >> (4 * S)) & 15) | (((high >> (2 * (2 * S + s))) & 3) << 4)).to(tl.int8)
        elif S == 0 and s == 0:
            return tl.inline_asm_elementwise(_Q6_00, "=r,r,r", [low, high], dtype=tl.int8, is_pure=True, pack=4)
        elif S == 0:
            return tl.inline_asm_elementwise(_Q6_01, "=r,r,r", [low, high], dtype=tl.int8, is_pure=True, pack=4)
        elif s == 0:
            return tl.inline_asm_elementwise(_Q6_10, "=r,r,r", [low, high], dtype=tl.int8, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(_Q6_11, "=r,r,r", [low, high], dtype=tl.int8, is_pure=True, pack=4)

    @triton.jit
    def q6k_step(acc, q, scales, sums, rows, blocks, at, step, COLS: tl.constexpr, EMULATE: tl.constexpr):
        """acc [BLOCK_N, 16] plus the product of the `rows` quantized rows with Q6_K superblock `step` of each
        weight row at bytes `at` [BLOCK_N] (q4k_step's contract). Q6_K (ql[128], qh[64], int8 scales[16], f16 d):
        x . w = d_x * d * sum_j sc_j * (q_x . q_j - 32 * sum(q_x over j)) over its 16 sub-blocks j of 16 columns
        with unsigned quants q_j; column H * 128 + S * 64 + s * 32 + l is nibble S of ql[H * 64 + s * 32 + l]
        below bits 2(2S + s) of qh[H * 32 + l], sub-block H * 8 + S * 4 + s * 2 + l // 16. A dot takes 32
        columns; its two sub-blocks are the rows' halves (the other half zeroed), a dot each."""
        r = tl.arange(0, 16)
        real = r < rows
        i = tl.arange(0, 32)
        first = i < 16
        # the 16 int8 scales as 8 little-endian 16-bit words (the 210-byte blocks keep 2-byte alignment)
        head = (blocks + at + 192).to(tl.pointer_type(tl.int16))
        d = tl.load((blocks + at + 208).to(tl.pointer_type(tl.float16))).to(tl.float32)
        dots = tl.zeros(acc.shape, dtype=tl.int32)  # sum_j sc_j * (q_x . q_j - 32 * sum(q_x over j))
        for H in tl.static_range(2):
            high = tl.load(blocks + at[:, None] + 128 + H * 32 + i[None, :])
            for s in tl.static_range(2):
                low = tl.load(blocks + at[:, None] + H * 64 + s * 32 + i[None, :])
                for S in tl.static_range(2):
                    j = H * 8 + S * 4 + s * 2  # the first of the 32 columns' two sub-blocks
                    pair = tl.load(head + j // 2).to(tl.int32)
                    sc_first = (pair << 24) >> 24  # the low byte, sign-extended
                    sc_second = pair >> 8
                    col = step * 256 + H * 128 + S * 64 + s * 32
                    x = tl.load(q + r[:, None] * COLS + col + i[None, :], mask=real[:, None], other=0)  # [16, 32]
                    w = _q6_quants(low, high, S, s, EMULATE)
                    part_first = tl.dot(w, tl.trans(tl.where(first[None, :], x, 0).to(tl.int8)))
                    part_second = tl.dot(w, tl.trans(tl.where(first[None, :], 0, x).to(tl.int8)))
                    at_sums = sums + r * (COLS // 16) + step * 16 + j
                    sum_first = tl.load(at_sums, mask=real, other=0)
                    sum_second = tl.load(at_sums + 1, mask=real, other=0)
                    dots += sc_first[:, None] * (part_first - 32 * sum_first[None, :])
                    dots += sc_second[:, None] * (part_second - 32 * sum_second[None, :])
        row_scale = tl.load(scales + r * (COLS // 256) + step, mask=real, other=0.0)
        return acc + d[:, None] * dots.to(tl.float32) * row_scale[None, :]
