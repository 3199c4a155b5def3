"""Row storage formats for feature rings: f32, f16, bf16 and the GGML q8_0 / q4_0 block formats.

q8_0: blocks of 32 values = fp16 scale d + 32 int8 (34 bytes); x = d * q.
q4_0: blocks of 32 values = fp16 scale d + 16 bytes of nibbles (18 bytes); value j in the low nibble
of byte j, value j + 16 in the high nibble; x = d * (q - 8). Byte-identical to ggml's reference
quantizers. Whole runs of rows are (de)quantized in one vectorised call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UserError

QK = 32  # values per block in both GGML formats


@dataclass(frozen=True)
class RowFormat:
    name: str
    dtype: torch.dtype | None  # plain formats store rows in this dtype; block formats store bytes
    block_bytes: int = 0

    def row_shape(self, width: int) -> tuple[int]:
        """Shape of one stored row: width values, or the row's bytes for block formats."""
        if self.dtype is not None:
            return (width,)
        if width % QK:
            raise UserError(f"{self.name} needs a feature width that is a multiple of {QK}, got {width}")
        return (width // QK * self.block_bytes,)

    def storage_dtype(self) -> torch.dtype:
        return self.dtype or torch.uint8

    def row_bytes(self, width: int) -> int:
        return self.row_shape(width)[0] * self.storage_dtype().itemsize

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        if self.dtype is not None:
            return rows.to(self.dtype)
        return (_q8_0_encode if self.name == "q8_0" else _q4_0_encode)(rows.float())

    def decode(self, data: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.dtype is not None:
            return data.to(dtype)
        return (_q8_0_decode if self.name == "q8_0" else _q4_0_decode)(data).to(dtype)


FORMATS = {
    "f32": RowFormat("f32", torch.float32),
    "f16": RowFormat("f16", torch.float16),
    "bf16": RowFormat("bf16", torch.bfloat16),
    "q8_0": RowFormat("q8_0", None, 2 + QK),
    "q4_0": RowFormat("q4_0", None, 2 + QK // 2),
}


def row_format(name: str) -> RowFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise UserError(f"unknown feature dtype {name!r}; choose one of {', '.join(FORMATS)}") from None


def _blocks(rows: torch.Tensor) -> torch.Tensor:
    return rows.reshape(*rows.shape[:-1], rows.shape[-1] // QK, QK)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.floor(x.abs() + 0.5)  # C roundf, as ggml uses


def _pack(scale: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
    """[..., nb] fp16 scales + [..., nb, k] bytes -> [..., nb * (2 + k)] bytes."""
    scale_bytes = scale.to(torch.float16).contiguous().view(torch.uint8).reshape(*scale.shape, 2)
    packed = torch.cat([scale_bytes, payload], dim=-1)
    return packed.reshape(*packed.shape[:-2], -1)


def _unpack(data: torch.Tensor, payload: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = data.reshape(*data.shape[:-1], -1, 2 + payload)
    scale = blocks[..., :2].contiguous().view(torch.float16).float()  # [..., nb, 1]
    return scale, blocks[..., 2:]


def _q8_0_encode(rows: torch.Tensor) -> torch.Tensor:
    x = _blocks(rows)
    d = x.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = _round_half_away(x * inv).to(torch.int8).view(torch.uint8)
    return _pack(d[..., 0], q)


def _q8_0_decode(data: torch.Tensor) -> torch.Tensor:
    scale, q = _unpack(data, QK)
    x = scale * q.contiguous().view(torch.int8).float()
    return x.reshape(*x.shape[:-2], -1)


def _q4_0_encode(rows: torch.Tensor) -> torch.Tensor:
    x = _blocks(rows)
    # the value of largest magnitude, with its sign, maps to -8
    peak = x.gather(-1, x.abs().argmax(dim=-1, keepdim=True))
    d = peak / -8
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp(torch.floor(x * inv + 8.5), max=15).to(torch.uint8)
    nibbles = q[..., : QK // 2] | (q[..., QK // 2 :] << 4)
    return _pack(d[..., 0], nibbles)


def _q4_0_decode(data: torch.Tensor) -> torch.Tensor:
    scale, nibbles = _unpack(data, QK // 2)
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float() - 8
    x = scale * q
    return x.reshape(*x.shape[:-2], -1)
