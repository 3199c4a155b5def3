"""GGUF quantized weight blocks in torch: the block layouts of ggml's Q8_0 ... Q6_K and their dequantization.

This is the reference for GGUF weights that stay quantized in memory instead of being converted to bf16 at load
time, and the prefill path for them: a prefill's matmul is large enough that dequantizing a weight to a dense
tensor first costs little next to the matmul itself. The Triton kernels that read the blocks directly during
decode live elsewhere and are tested against `dequantize` here.

Layouts and formulas are ggml's (ggml-quants.c `dequantize_row_*`), written in the same operation order as the
numpy reference in the gguf package (`gguf/quants.py`, `dequantize_blocks`) so that float32 results are
bit-identical to it. Everything is vectorized over blocks, runs on the device of its input and never syncs the
host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256  # weights per super-block of the K-quants


@dataclass(frozen=True)
class BlockFormat:
    name: str  # "Q4_K"
    ggml_type: int  # gguf.GGMLQuantizationType value
    block: int  # weights per block (32 or 256)
    nbytes: int  # bytes per block (gguf.quants.GGML_QUANT_SIZES)


def _format(name: str) -> BlockFormat:
    qtype = GGMLQuantizationType[name]
    block, nbytes = GGML_QUANT_SIZES[qtype]
    return BlockFormat(name, int(qtype), block, nbytes)


_NAMES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
FORMATS: dict[int, BlockFormat] = {f.ggml_type: f for f in map(_format, _NAMES)}


def block_format(ggml_type: int) -> BlockFormat | None:
    """The block format of a ggml tensor type, or None where this module cannot dequantize it."""
    return FORMATS.get(int(ggml_type))


def row_bytes(fmt: BlockFormat, cols: int) -> int:
    """Bytes of one row of `cols` weights; ggml never splits a block across rows."""
    if cols % fmt.block:
        raise ValueError(f"{fmt.name} rows hold whole blocks of {fmt.block} weights; {cols} columns do not")
    return cols // fmt.block * fmt.nbytes


# --- reading fields of a [n_blocks, nbytes] uint8 tensor -------------------------------------------------------


def _f16(b: torch.Tensor, offset: int) -> torch.Tensor:
    """The f16 field at byte `offset` of each block, as float32 [n, 1].

    The two-byte slice is strided by the block size, which a dtype view does not accept, hence the copy (it is
    2 / nbytes of the input). The view reads the bytes in host order, little-endian on every machine torch runs
    this on, as GGUF stores them."""
    return b[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _unpack(x: torch.Tensor, width: int, run: int) -> torch.Tensor:
    """The `width`-bit fields of x [n, bytes] in ggml's order: for each run of `run` bytes, the lowest field of
    every byte in the run, then the next field of every byte, and so on. [n, bytes * 8 // width]"""
    n, nbytes = x.shape
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=x.device).view(-1, 1)
    fields = (x.reshape(n, nbytes // run, 1, run) >> shifts) & ((1 << width) - 1)
    return fields.reshape(n, nbytes * 8 // width)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's get_scale_min_k4 for all 8 sub-blocks at once: 6-bit scales and mins packed into 12 bytes.

    Bytes 0..3 hold scales 0..3 in their low 6 bits, bytes 4..7 mins 0..3; bytes 8..11 hold the low 4 bits of
    scales 4..7 (low nibble) and mins 4..7 (high nibble), whose top 2 bits are the spare top bits of 0..7."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


# --- one function per format: uint8 [n_blocks, nbytes] -> float32 [n_blocks, block] ---------------------------


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    # d | qs[32] (int8)
    d = _f16(b, 0)
    return b[:, 2:].view(torch.int8).float() * d


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    # d | qs[16]: low nibbles are weights 0..15, high nibbles 16..31
    d = _f16(b, 0)
    q = _unpack(b[:, 2:], 4, 16).to(torch.int8) - 8
    return d * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    # d | m | qs[16]
    d, m = _f16(b, 0), _f16(b, 2)
    return d * _unpack(b[:, 4:], 4, 16).float() + m


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    # d | qh (little-endian uint32: bit j is the fifth bit of weight j) | qs[16]
    d = _f16(b, 0)
    q = (_unpack(b[:, 6:], 4, 16) | (_unpack(b[:, 2:6], 1, 1) << 4)).to(torch.int8) - 16
    return d * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    # d | m | qh | qs[16]
    d, m = _f16(b, 0), _f16(b, 2)
    q = _unpack(b[:, 8:], 4, 16) | (_unpack(b[:, 4:8], 1, 1) << 4)
    return d * q.float() + m


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    # scales[16] | qs[64] | d | dmin. Each qs byte holds the 2-bit quants of 4 weights 32 apart in a 128-weight
    # half; each scales byte is the 4-bit scale (low nibble) and min (high nibble) of 16 weights.
    n = b.shape[0]
    scales = b[:, :16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = _unpack(b[:, 16:80], 2, 32).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    # hmask[32] | qs[64] | scales[12] | d. The low 2 bits of a quant are laid out as in Q2_K; bit j of hmask[l]
    # is the third bit of weight 32 * j + l, stored inverted: a clear bit subtracts 4.
    n = b.shape[0]
    d = _f16(b, 108)
    # 16 signed 6-bit scales: the low 4 bits are the nibbles of bytes 0..7 (low nibbles first), the top 2 bits
    # come from bytes 8..11, 2 bits per scale (scale i: bits 2 * (i // 4) of byte 8 + i % 4).
    low = _unpack(b[:, 96:104], 4, 8)
    high = _unpack(b[:, 104:108], 2, 4)
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (d * scales).reshape(n, 16, 1)
    ql = _unpack(b[:, 32:96], 2, 32).reshape(n, 16, 16)
    qh = _unpack(b[:, :32], 1, 32).reshape(n, 16, 16) ^ 1
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, QK_K)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # d | dmin | scales[12] | qs[128]: 8 sub-blocks of 32 weights; each 32 bytes of qs hold two sub-blocks, the
    # first in the low nibbles.
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = (d * sc.float()).reshape(n, 8, 1)
    dm = (dmin * mn.float()).reshape(n, 8, 1)
    q = _unpack(b[:, 16:], 4, 32).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    # d | dmin | scales[12] | qh[32] | qs[128]: Q4_K plus a fifth bit, bit j of qh[l] for weight 32 * j + l.
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = (d * sc.float()).reshape(n, 8, 1)
    dm = (dmin * mn.float()).reshape(n, 8, 1)
    q = _unpack(b[:, 48:], 4, 32) | (_unpack(b[:, 16:48], 1, 32) << 4)
    return (d * q.reshape(n, 8, 32).float() - dm).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # ql[128] | qh[64] | scales[16] (int8) | d. Per 128-weight half: 64 ql bytes give the low 4 bits of weights
    # 0..63 (low nibbles) and 64..127 (high nibbles); 32 qh bytes give the top 2 bits of 4 weights 32 apart.
    n = b.shape[0]
    scales = b[:, 192:208].view(torch.int8).float()
    d = (_f16(b, 208) * scales).reshape(n, 16, 1)
    q = _unpack(b[:, :128], 4, 64) | (_unpack(b[:, 128:192], 2, 32) << 4)
    q = (q.to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, QK_K)


_DEQUANTIZE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def dequantize(blocks: torch.Tensor, fmt: BlockFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., row_bytes] -> [..., weights per row] in `dtype`, computed in float32 then cast.

    Any leading dims (rows, or experts and rows); the last dim must be a whole number of blocks."""
    if blocks.dtype != torch.uint8:
        raise ValueError(f"{fmt.name} blocks must be uint8 bytes, not {blocks.dtype}")
    width = blocks.shape[-1]
    if width % fmt.nbytes:
        raise ValueError(f"{fmt.name} rows are whole blocks of {fmt.nbytes} bytes; {width} bytes are not")
    lead = blocks.shape[:-1]
    out = _DEQUANTIZE[fmt.name](blocks.reshape(-1, fmt.nbytes))
    return out.reshape(*lead, width // fmt.nbytes * fmt.block).to(dtype)


# For random_blocks: the byte offsets of each format's f16 fields (d, and dmin or m where there is one) and the
# largest |multiplier| of such a field in a weight (sub-block scale times quant), which sizes them.
_SCALE_FIELDS: dict[str, tuple[tuple[int, ...], int]] = {
    "Q8_0": ((0,), 128),
    "Q4_0": ((0,), 8),
    "Q4_1": ((0, 2), 15),
    "Q5_0": ((0,), 16),
    "Q5_1": ((0, 2), 31),
    "Q2_K": ((80, 82), 15 * 3),
    "Q3_K": ((108,), 32 * 4),
    "Q4_K": ((0, 2), 63 * 15),
    "Q5_K": ((0, 2), 63 * 31),
    "Q6_K": ((208,), 128 * 32),
}


def random_blocks(rows: int, cols: int, fmt: BlockFormat, generator: torch.Generator, scale: float = 1.0
                  ) -> torch.Tensor:
    """uint8 [rows, row_bytes]: random quant bits and sub-block scales, with finite f16 scale fields.

    Each f16 field gets a random sign and a magnitude in [0.5, 1) * scale / (its largest multiplier * sqrt(cols)),
    so that no weight exceeds about scale / sqrt(cols) (their std is 0.2-0.5 scale / sqrt(cols), by format) and a random
    model built from them stays far inside bf16's range. For tests and benchmarks that need quantized weights
    without a quantizer: gguf's Python package quantizes only the legacy formats."""
    n = cols // fmt.block
    dev = generator.device
    out = torch.randint(0, 256, (rows, row_bytes(fmt, cols)), generator=generator, dtype=torch.uint8, device=dev)
    blocks = out.view(rows, n, fmt.nbytes)
    offsets, span = _SCALE_FIELDS[fmt.name]
    for offset in offsets:
        size = torch.rand(rows, n, generator=generator, device=dev) * 0.5 + 0.5
        sign = torch.randint(0, 2, (rows, n), generator=generator, device=dev) * 2 - 1
        value = (sign * size * scale / (span * math.sqrt(cols))).to(torch.float16)
        blocks[:, :, offset : offset + 2] = value.view(torch.uint8).view(rows, n, 2)
    return out
