"""Feature-ring kernels in Triton: encode + scatter of a run of rows in one pass, and decode in one pass.

kernels/row_formats.py's torch forms run a q4_0 write as about 15 kernels and reach 3% of the device's copy bandwidth
(BENCHMARKS.md); these write each output byte once. One program handles GROUPS blocks of 32 values of
one row: it loads them, converts or quantizes them (per-block scale, rounding and nibble packing exactly
as kernels/row_formats.py, in float32 with IEEE division and no fused multiply-add, so the bytes are the same), and
stores them at slot = position % capacity, plus the slot's position tag. Decoding is the inverse, for a
contiguous run of stored rows. A q4_0 write loads a block as its two halves of 16 values (low and high
nibbles), and a q4_0 decode stores it so, so neither shuffles registers (the decode's interleave of the
halves would go through shared memory: 240 sm_90 instructions per 32-block program against 152; the
halves dequantize 15% faster on the H200). With SCALED, a write multiplies the rows by a
per-channel scale as it loads them and a decode multiplies by its inverse (features.storage_scale). A
program's work items are the same columns of ITEMS consecutive rows, so it loads that scale once for
all of them.
Rings hold the scale in bf16 (2 bytes, exact for its powers of two): loaded as float32 (4 bytes per
value next to q4_0's 0.56) the scaled writes ran 6-18% slower (q4_0 at 8192 rows 0.68 against 0.80 of the
copy bandwidth, H200). `bench rings` times the scaled and unscaled forms, and with `--triton-shapes`
shapes whose ITEMS > 1 share the scale.

A block format's write is bound by instructions, not memory (a straightforward q8_0 block takes ~37 warp
instructions where an f32 one takes ~10: 0.57 / 0.60 of the copy bandwidth on an H200). So it
stores the codes as 16-bit pairs (the block stride, 34 or 18 bytes, leaves them 2-byte aligned), the
fp16 scale as one 16-bit store, rounds by a truncating conversion, and finds q4_0's peak from the
block's largest and smallest values, searching positions only in a tile with a +m / -m tie: ~25 (q8_0)
and ~18 (q4_0) warp instructions per block in the sm_90 PTX. Two other forms measure slower on an H200:
each block as one run of byte lanes, the codes loaded again at their lanes, and the codes as
16-bit pairs from strided loads.

How the work is cut comes from SHAPES (the best measured on the H200, BENCHMARKS.md): GROUPS blocks per
work item, warps per program, and ITEMS consecutive work items per program whose loads, with STAGES > 1,
Triton pipelines behind the previous items' work (cp.async on the GPU). `deepflash bench rings
--triton-shapes` times other shapes.

Triton is optional (CUDA machines have it with torch); `TRITON_INTERPRET=1` runs the kernels on the
CPU, which is how the tests check them without a GPU.
"""

from __future__ import annotations

import torch

from .config import Shape
from .row_formats import QK, RowFormat
from .triton_support import tl, triton

CODES = {"f32": 0, "f16": 1, "bf16": 2, "q8_0": 3, "q4_0": 4}


# q8_0: the write at 32x2 and the decode at 64x2 beat the default shape at 8192 and at 65,536 rows
# under CUDA graphs (H200)
SHAPES = {("write", "q4_0"): Shape(32, 1), ("write", "q8_0"): Shape(32, 2), ("decode", "q8_0"): Shape(64, 2)}
DEFAULT_SHAPE = Shape(32, 4)


def shipped_shape(kernel: str, fmt: RowFormat) -> Shape:
    """How `kernel` ("write" or "decode") cuts its work for `fmt` (SHAPES, else DEFAULT_SHAPE)."""
    return SHAPES.get((kernel, fmt.name), DEFAULT_SHAPE)


def _launch(kernel, shape: Shape, n: int, width: int, *args, **constexprs) -> None:
    """One program per ITEMS work items; a work item is GROUPS blocks of one of the n rows, and a
    program's items are the same columns of ITEMS consecutive rows (so a scaled kernel loads their
    scale once)."""
    per_row = triton.cdiv(triton.cdiv(width, QK), shape.groups)
    kernel[(per_row * triton.cdiv(n, shape.items),)](*args, n, width, GROUPS=shape.groups, ITEMS=shape.items,
                                                     STAGES=shape.stages, num_warps=shape.warps,
                                                     enable_fp_fusion=False, **constexprs)


def write(fmt: RowFormat, data: torch.Tensor, tags: torch.Tensor, positions: torch.Tensor,
          rows: torch.Tensor, scale: torch.Tensor | None = None, shape: Shape | None = None) -> None:
    """Encode rows [n, width] (times `scale` [width], bf16 or float32, if given) and store them at slot =
    position % capacity, tags included. shape: the work's cut (bench rings times others; shipped_shape)."""
    n, width = rows.shape
    rows = rows.contiguous()
    _launch(_write, shape or shipped_shape("write", fmt), n, width, rows, positions, data, tags, rows if scale is None else scale,
            data.shape[1], data.shape[0], FMT=CODES[fmt.name], BLOCK_BYTES=fmt.block_bytes,
            SCALED=scale is not None)


def decode(fmt: RowFormat, data: torch.Tensor, dtype: torch.dtype = torch.float32,
           inverse: torch.Tensor | None = None, shape: Shape | None = None) -> torch.Tensor:
    """Stored rows [n, row elements] -> values [n, width] in dtype (times `inverse` [width], bf16 or
    float32, if given). shape: as write's."""
    width = data.shape[1] if fmt.dtype is not None else data.shape[1] // fmt.block_bytes * QK
    data = data.contiguous()
    out = torch.empty((data.shape[0], width), dtype=dtype, device=data.device)
    _launch(_decode, shape or shipped_shape("decode", fmt), data.shape[0], width, data, out, out if inverse is None else inverse,
            data.shape[1], FMT=CODES[fmt.name], BLOCK_BYTES=fmt.block_bytes, SCALED=inverse is not None)
    return out


if triton is not None:

    @triton.jit
    def _peak(low, high):
        """Per block, the signed value of largest magnitude (the first one on a tie), from its halves. The
        largest and smallest values decide it unless they are opposite (+m and -m, or zeros of both signs):
        only a tile holding such a block pays for the positional search."""
        top = tl.maximum(tl.max(low, axis=1), tl.max(high, axis=1))
        bottom = tl.minimum(tl.min(low, axis=1), tl.min(high, axis=1))
        peak = tl.where(top > -bottom, top, bottom)
        tie = top == -bottom
        if tl.max(tie.to(tl.int32), axis=0) > 0:
            peak = tl.where(tie, _first_largest(low, high), peak)
        return peak

    @triton.jit
    def _first_largest(low, high):
        """Per block, the first value of largest magnitude (low half before high half)."""
        at_low = tl.argmax(tl.abs(low), axis=1, tie_break_left=True)
        at_high = tl.argmax(tl.abs(high), axis=1, tie_break_left=True)
        lanes = tl.arange(0, 16)[None, :]
        peak_low = tl.sum(tl.where(lanes == at_low[:, None], low, 0.0), axis=1)
        peak_high = tl.sum(tl.where(lanes == at_high[:, None], high, 0.0), axis=1)
        return tl.where(tl.abs(peak_low) >= tl.abs(peak_high), peak_low, peak_high)

    @triton.jit
    def _chunk(width, GROUPS: tl.constexpr):
        """This program's place in its rows, in GROUPS blocks."""
        return tl.program_id(0) % tl.cdiv(tl.cdiv(width, 32), GROUPS)

    @triton.jit
    def _row(n, width, ITEMS: tl.constexpr, GROUPS: tl.constexpr, i):
        """The row of this program's work item i, and whether it exists (the last row group's may not)."""
        r = tl.program_id(0) // tl.cdiv(tl.cdiv(width, 32), GROUPS) * ITEMS + i
        return r, r < n

    @triton.jit
    def _and_row(mask, exists):
        """mask & exists for a mask tile and the row's scalar flag, as a select: Triton 3.9's interpreter (the
        CPU tests) gives a bool tile & a bool scalar int32 data, which its loads refuse as a mask."""
        return tl.where(exists, mask, False)

    @triton.jit
    def _columns(chunk, width, GROUPS: tl.constexpr, HALF: tl.constexpr):
        """The chunk's blocks, their columns [GROUPS, 32] (HALF: the first 16 of each block) and which of
        those lie inside the row."""
        group = chunk * GROUPS + tl.arange(0, GROUPS)
        cols = group[:, None] * 32 + tl.arange(0, 32 // (1 + HALF))[None, :]
        return group, cols, cols < width

    @triton.jit
    def _scale_of(scale, cols, inside, SCALED: tl.constexpr):
        """The per-channel scale at cols (loaded once per program, for all its rows; stored as bf16, exact for
        the powers of two features.storage_scale makes), or 1."""
        # an else, not a fall-through: compiled (unlike interpreted) Triton types both returns alike
        if SCALED:
            return tl.load(scale + cols, mask=inside, other=0.0).to(tl.float32)
        else:
            return 1.0

    @triton.jit
    def _write(rows, positions, data, tags, scale, row_elems, capacity, n, width, FMT: tl.constexpr,
               GROUPS: tl.constexpr, BLOCK_BYTES: tl.constexpr, SCALED: tl.constexpr, ITEMS: tl.constexpr,
               STAGES: tl.constexpr):
        chunk = _chunk(width, GROUPS)
        # q4_0 loads a block as its two halves (module doc), the others as one run of 32
        group, cols, inside = _columns(chunk, width, GROUPS, FMT == 4)
        s = _scale_of(scale, cols, inside, SCALED)
        s_high = _scale_of(scale, cols + 16, inside, SCALED and FMT == 4)
        # a constant trip count: Triton's interpreter (the CPU tests) cannot loop to a runtime bound
        for i in tl.range(0, ITEMS, num_stages=STAGES):
            r, exists = _row(n, width, ITEMS, GROUPS, i)
            _write_item(rows, positions, data, tags, s, s_high, row_elems, capacity, width, r, chunk, group, cols,
                        _and_row(inside, exists), exists, FMT, GROUPS, BLOCK_BYTES, SCALED)

    @triton.jit
    def _load_row(rows, s, r, width, cols, mask, SCALED: tl.constexpr):
        """Values of row r at cols, times their channels' scale s if SCALED (in float32, as features.py)."""
        x = tl.load(rows + r * width + cols, mask=mask, other=0.0)
        if SCALED:
            x = x.to(tl.float32) * s
        return x

    @triton.jit
    def _write_item(rows, positions, data, tags, s, s_high, row_elems, capacity, width, r, chunk, group, cols,
                    inside, exists, FMT: tl.constexpr, GROUPS: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                    SCALED: tl.constexpr):
        pos = tl.load(positions + r, mask=exists, other=0)
        # a 32-bit remainder (positions are far below 2^31), where the 64-bit one called a subroutine in
        # every program (sm_90 SASS); the product below stays 64-bit
        slot = (pos.to(tl.int32) % capacity).to(tl.int64)
        tl.store(tags + slot, pos, mask=exists & (chunk == 0))
        out = data + slot * row_elems
        if FMT < 3:  # plain: a cast
            x = _load_row(rows, s, r, width, cols, inside, SCALED)
            tl.store(out + cols, x.to(out.dtype.element_ty), mask=inside)
        else:
            live = _and_row(group < width // 32, exists)
            block = group * BLOCK_BYTES  # even: the fp16 scale at a block's start is 2-byte aligned
            if FMT == 3:  # q8_0: d = amax / 127, q = round half away from zero (x / d)
                x = _load_row(rows, s, r, width, cols, inside, SCALED).to(tl.float32)
                d = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 127.0)
                inv = tl.where(d > 0, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d), 0.0)
                v = x * inv[:, None]
                # round half away from zero as a truncating conversion of v +- 0.5 (the same integer as
                # sign(v) * floor(|v| + 0.5): rounding to nearest is symmetric), 4 instructions where 8 were
                q = (v + tl.where(v < 0, -0.5, 0.5)).to(tl.int32)
                _store_pairs(out + block + 2, q & 0xFF, GROUPS, 32, live)
            else:  # q4_0: the signed value of largest magnitude maps to -8; codes x / d + 8.5, floored
                low = _load_row(rows, s, r, width, cols, live[:, None], SCALED).to(tl.float32)
                high = _load_row(rows, s_high, r, width, cols + 16, live[:, None], SCALED).to(tl.float32)
                # peak / -8 as a product: dividing by a power of two is exact, so the two agree to the bit and
                # the product skips a correctly rounded division (a dozen sm_90 instructions) per block
                d = _peak(low, high) * -0.125
                inv = tl.where(d != 0, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d), 0.0)
                # x / d lies in [-8, 8] (to a rounding), so x / d + 8.5 > 0: truncation is the floor
                q_low = tl.minimum((low * inv[:, None] + 8.5).to(tl.int32), 15)
                q_high = tl.minimum((high * inv[:, None] + 8.5).to(tl.int32), 15)
                _store_pairs(out + block + 2, q_low | (q_high << 4), GROUPS, 16, live)
            # the scale as one 16-bit store, where two one-byte stores were
            tl.store((out + block).to(tl.pointer_type(tl.float16)), d.to(tl.float16), mask=live)

    @triton.jit
    def _store_pairs(at, codes, GROUPS: tl.constexpr, BYTES: tl.constexpr, live):
        """Store each group's BYTES code bytes (int32 values 0..255, [GROUPS, BYTES]) from `at` [GROUPS]
        (2-byte aligned) as 16-bit pairs: half the stores and their addresses of one-byte stores."""
        low, high = tl.split(tl.reshape(codes, [GROUPS, BYTES // 2, 2]))
        pairs = (low | (high << 8)).to(tl.uint16)
        words = at.to(tl.pointer_type(tl.uint16))
        tl.store(words[:, None] + tl.arange(0, BYTES // 2)[None, :], pairs, mask=live[:, None])

    @triton.jit
    def _decode(data, out, inverse, row_elems, n, width, FMT: tl.constexpr, GROUPS: tl.constexpr,
                BLOCK_BYTES: tl.constexpr, SCALED: tl.constexpr, ITEMS: tl.constexpr, STAGES: tl.constexpr):
        # q4_0 decodes a block as its two halves (low and high nibbles), the others as one run of 32
        group, cols, inside = _columns(_chunk(width, GROUPS), width, GROUPS, FMT == 4)
        s = _scale_of(inverse, cols, inside, SCALED)
        s_high = _scale_of(inverse, cols + 16, inside, SCALED and FMT == 4)
        for i in tl.range(0, ITEMS, num_stages=STAGES):
            r, exists = _row(n, width, ITEMS, GROUPS, i)
            _decode_item(data, out, s, s_high, row_elems, width, r, group, cols, _and_row(inside, exists), exists, FMT,
                         GROUPS, BLOCK_BYTES, SCALED)

    @triton.jit
    def _decode_item(data, out, s, s_high, row_elems, width, r, group, cols, inside, exists, FMT: tl.constexpr,
                     GROUPS: tl.constexpr, BLOCK_BYTES: tl.constexpr, SCALED: tl.constexpr):
        src = data + r * row_elems
        if FMT < 3:
            _store_values(out, r, width, cols, tl.load(src + cols, mask=inside, other=0.0).to(tl.float32), s, inside,
                          SCALED)
        else:
            live = _and_row(group < width // 32, exists)
            block = group * BLOCK_BYTES
            lo = tl.load(src + block, mask=live, other=0).to(tl.int32)
            hi = tl.load(src + block + 1, mask=live, other=0).to(tl.int32)
            scale = (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)[:, None]
            if FMT == 3:
                codes = tl.load(src + block[:, None] + 2 + tl.arange(0, 32)[None, :], mask=live[:, None], other=0)
                _store_values(out, r, width, cols, scale * codes.to(tl.int8, bitcast=True).to(tl.float32), s, inside,
                              SCALED)
            else:  # the low nibbles are the block's first 16 values, the high ones its last 16: two stores, where
                # interleaving them into one run of 32 went through shared memory
                nibbles = tl.load(src + block[:, None] + 2 + tl.arange(0, 16)[None, :], mask=live[:, None], other=0)
                _store_values(out, r, width, cols, scale * ((nibbles & 0x0F).to(tl.float32) - 8), s, inside, SCALED)
                _store_values(out, r, width, cols + 16, scale * ((nibbles >> 4).to(tl.float32) - 8), s_high, inside,
                              SCALED)

    @triton.jit
    def _store_values(out, r, width, cols, x, s, inside, SCALED: tl.constexpr):
        """Row r's decoded values x at cols, times their channels' inverse scale s if SCALED."""
        if SCALED:
            x = x * s
        tl.store(out + r * width + cols, x.to(out.dtype.element_ty), mask=inside)
