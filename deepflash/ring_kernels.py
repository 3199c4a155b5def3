"""Feature-ring kernels in Triton: encode + scatter of a run of rows in one pass, and decode in one pass.

quant.py's torch forms run a q4_0 write as about 15 kernels and reach 3% of the device's copy bandwidth
(BENCHMARKS.md); these read each input byte once and write each output byte once. One program handles
GROUPS blocks of 32 values of one row: it loads them, converts or quantizes them (per-block scale,
rounding and nibble packing exactly as quant.py, in float32 with IEEE division and no fused
multiply-add, so the bytes are the same), and stores them at slot = position % capacity, plus the
slot's position tag. Decoding is the inverse, for a contiguous run of stored rows.

Triton is optional (CUDA machines have it with torch); `TRITON_INTERPRET=1` runs the kernels on the
CPU, which is how the tests check them without a GPU.
"""

from __future__ import annotations

import torch

from .quant import QK, RowFormat

try:
    import triton
    import triton.language as tl
except ImportError:  # torch's CPU builds do not bring Triton
    triton = None

GROUPS = 32  # blocks of 32 values per program
CODES = {"f32": 0, "f16": 1, "bf16": 2, "q8_0": 3, "q4_0": 4}


def available() -> bool:
    return triton is not None


def write(fmt: RowFormat, data: torch.Tensor, tags: torch.Tensor, positions: torch.Tensor,
          rows: torch.Tensor) -> None:
    """Encode rows [n, width] and store them at slot = position % capacity, tags included."""
    n, width = rows.shape
    rows = rows.contiguous()
    grid = (n, triton.cdiv(triton.cdiv(width, QK), GROUPS))
    _write[grid](rows, positions, data, tags, width, data.shape[1], data.shape[0], CODES[fmt.name],
                 GROUPS=GROUPS, enable_fp_fusion=False)


def decode(fmt: RowFormat, data: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored rows [n, row elements] -> values [n, width] in dtype."""
    width = data.shape[1] if fmt.dtype is not None else data.shape[1] // fmt.block_bytes * QK
    data = data.contiguous()
    out = torch.empty((data.shape[0], width), dtype=dtype, device=data.device)
    grid = (data.shape[0], triton.cdiv(triton.cdiv(width, QK), GROUPS))
    _decode[grid](data, out, width, data.shape[1], CODES[fmt.name], GROUPS=GROUPS, enable_fp_fusion=False)
    return out


if triton is not None:

    @triton.jit
    def _write(rows, positions, data, tags, width, row_elems, capacity, FMT: tl.constexpr, GROUPS: tl.constexpr):
        r = tl.program_id(0)
        chunk = tl.program_id(1)
        pos = tl.load(positions + r)
        slot = pos % capacity
        if chunk == 0:
            tl.store(tags + slot, pos)
        group = chunk * GROUPS + tl.arange(0, GROUPS)
        cols = group[:, None] * 32 + tl.arange(0, 32)[None, :]
        inside = cols < width
        x = tl.load(rows + r * width + cols, mask=inside, other=0.0).to(tl.float32)
        out = data + slot * row_elems
        if FMT < 3:  # plain: a cast
            tl.store(out + cols, x.to(out.dtype.element_ty), mask=inside)
        else:
            live = group < width // 32
            if FMT == 3:  # q8_0: d = amax / 127, q = round half away from zero (x / d)
                d = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 127.0)
                inv = tl.where(d > 0, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d), 0.0)
                v = x * inv[:, None]
                q = tl.where(v < 0, -tl.floor(-v + 0.5), tl.floor(v + 0.5))
                payload = q.to(tl.int8).to(tl.uint8, bitcast=True)
                block = group * (2 + 32)
                tl.store(out + block[:, None] + 2 + tl.arange(0, 32)[None, :], payload, mask=live[:, None])
            else:  # q4_0: the signed value of largest magnitude maps to -8; codes x / d + 8.5, floored
                at = tl.argmax(tl.abs(x), axis=1, tie_break_left=True)
                peak = tl.sum(tl.where(tl.arange(0, 32)[None, :] == at[:, None], x, 0.0), axis=1)
                d = tl.math.div_rn(peak, -8.0)
                inv = tl.where(d != 0, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d), 0.0)
                q = tl.minimum(tl.floor(x * inv[:, None] + 8.5), 15.0).to(tl.uint8)
                low, high = tl.split(tl.permute(tl.reshape(q, [GROUPS, 2, 16]), [0, 2, 1]))
                block = group * (2 + 16)
                tl.store(out + block[:, None] + 2 + tl.arange(0, 16)[None, :], low | (high << 4),
                         mask=live[:, None])
            bits = d.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
            tl.store(out + block, (bits & 0xFF).to(tl.uint8), mask=live)
            tl.store(out + block + 1, ((bits >> 8) & 0xFF).to(tl.uint8), mask=live)

    @triton.jit
    def _decode(data, out, width, row_elems, FMT: tl.constexpr, GROUPS: tl.constexpr):
        r = tl.program_id(0)
        group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        cols = group[:, None] * 32 + tl.arange(0, 32)[None, :]
        inside = cols < width
        src = data + r * row_elems
        if FMT < 3:
            x = tl.load(src + cols, mask=inside, other=0.0).to(tl.float32)
        else:
            live = group < width // 32
            block = group * (2 + 32 if FMT == 3 else 2 + 16)
            lo = tl.load(src + block, mask=live, other=0).to(tl.int32)
            hi = tl.load(src + block + 1, mask=live, other=0).to(tl.int32)
            scale = (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            if FMT == 3:
                codes = tl.load(src + block[:, None] + 2 + tl.arange(0, 32)[None, :], mask=live[:, None], other=0)
                q = codes.to(tl.int8, bitcast=True).to(tl.float32)
            else:
                nibbles = tl.load(src + block[:, None] + 2 + tl.arange(0, 16)[None, :], mask=live[:, None], other=0)
                both = tl.join(nibbles & 0x0F, nibbles >> 4)  # [GROUPS, 16, 2]
                q = tl.reshape(tl.permute(both, [0, 2, 1]), [GROUPS, 32]).to(tl.float32) - 8
            x = scale[:, None] * q
        tl.store(out + r * width + cols, x.to(out.dtype.element_ty), mask=inside)
