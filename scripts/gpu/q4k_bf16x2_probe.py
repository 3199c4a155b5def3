"""Probe for the next GGUF kernel: a Q4_K projection that dequantizes two weights an instruction (bf16x2 PTX,
Marlin's way), timed against kernels/quant_gemv.py and bf16 on one Qwen3-8B layer (scripts/gpu/int4_compare.py's
harness), 1 and 16 rows, after a check against the float product.

quant_gemv computes ggml's float32 weights exactly, one weight at a time: ~18 instructions a weight per thread
(sm_90 SASS, Triton 3.9), and streams ~0.5 TB/s of Q4_K. Here each 32-bit word of a sub-block pair's quant bytes
is cut into bf16 lanes by inline PTX (prmt the bytes apart, lop3 `& 0xF | 0x4300` makes 128 + q exactly, a
bf16x2 sub of 128, a bf16x2 fma with the sub-block's scale d * sc and min -dmin * m), and the scales come from a
bf16 table [n, K / 32, 2] made at load (0.5 bits a weight more: 5.0 against 4.5). ~8 instructions a weight per
thread in the same compile. The weights are not ggml's bit for bit (bf16 scale and min, one rounding of the
fma); the reduction is split over K with float32 atomics, whose order is not fixed: a timing probe, not yet
a kernel for the engine (which needs a fixed order, like quant_gemv's slices).

Usage: python3 scripts/gpu/q4k_bf16x2_probe.py [--cpu] (--cpu: the indexing checked in Triton's interpreter,
with the PTX replaced by the same arithmetic in float32). Ends with one JSON line."""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

if "--cpu" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from deepflash.kernels import quant_gemv  # noqa: E402
from deepflash.quant import gguf_blocks  # noqa: E402

FORMAT = gguf_blocks.block_format(quant_gemv.Q4_K)
# $0-$3: the word's 4 weights (bytes 0..3, the nibble SHIFT / 4 of each); $4: the word; $5, $6: scale, min
_PTX = """{
.reg .b32 a, b, k, s2, m2;
prmt.b32 a, $4, 0, 0x4140;
prmt.b32 b, $4, 0, 0x4342;
shr.b32 a, a, SHIFT;
shr.b32 b, b, SHIFT;
lop3.b32 a, a, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 b, b, 0x000F000F, 0x43004300, 0xEA;
mov.b32 k, 0x43004300;
sub.rn.bf16x2 a, a, k;
sub.rn.bf16x2 b, b, k;
mov.b32 s2, {$5, $5};
mov.b32 m2, {$6, $6};
fma.rn.bf16x2 a, a, s2, m2;
fma.rn.bf16x2 b, b, s2, m2;
mov.b32 {$0, $1}, a;
mov.b32 {$2, $3}, b;
}"""
PTX_LOW: tl.constexpr = tl.constexpr(_PTX.replace("SHIFT", "0"))
PTX_HIGH: tl.constexpr = tl.constexpr(_PTX.replace("SHIFT", "4"))


@triton.jit
def _four_weights(words, scale, least, SHIFT: tl.constexpr, EMULATE: tl.constexpr):
    """The 4 weights of each word (byte t's nibble SHIFT / 4): scale * q + least."""
    if EMULATE:
        s, m = scale.to(tl.float32), least.to(tl.float32)
        return (((words >> SHIFT) & 15).to(tl.float32) * s + m, ((words >> (8 + SHIFT)) & 15).to(tl.float32) * s + m,
                ((words >> (16 + SHIFT)) & 15).to(tl.float32) * s + m,
                ((words >> (24 + SHIFT)) & 15).to(tl.float32) * s + m)
    elif SHIFT == 0:
        return tl.inline_asm_elementwise(PTX_LOW, "=h,=h,=h,=h,r,h,h", [words, scale, least],
                                         dtype=(tl.bfloat16,) * 4, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(PTX_HIGH, "=h,=h,=h,=h,r,h,h", [words, scale, least],
                                         dtype=(tl.bfloat16,) * 4, is_pure=True, pack=1)


@triton.jit
def _q4k_bf16x2(x, words, table, out, rows, n, COLS: tl.constexpr, BLOCK_N: tl.constexpr, SPAN: tl.constexpr,
                EMULATE: tl.constexpr):
    block, piece = tl.program_id(0), tl.program_id(1)
    r = tl.arange(0, 16)
    outs = block * BLOCK_N + tl.arange(0, BLOCK_N)
    live = outs < n
    row_at = outs.to(tl.int64) * ((COLS // 256) * 36)  # in words: a superblock is 36
    c = tl.arange(0, 4)[None, :, None]  # sub-block pair: low nibbles sub-block 2c, high 2c + 1
    u = tl.arange(0, 8)[None, None, :]  # word of the pair's 32 quant bytes
    # the joins below order a step's weights c * 64 + u * 8 + a * 4 + b * 2 + h: column c * 64 + h * 32 + 4u + 2a + b
    flat = tl.arange(0, 256)
    columns = (flat // 64) * 64 + (flat % 2) * 32 + ((flat // 8) % 8) * 4 + ((flat // 4) % 2) * 2 + (flat // 2) % 2
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for step in range(piece * SPAN, piece * SPAN + SPAN):
        at = row_at[:, None, None] + step * 36
        qs = tl.load(words + at + 4 + c * 8 + u, mask=live[:, None, None], other=0)  # [BLOCK_N, 4, 8]
        sub = (outs.to(tl.int64) * (COLS // 32) + step * 8)[:, None, None] + 2 * c
        s_lo = tl.broadcast_to(tl.load(table + sub * 2, mask=live[:, None, None], other=0.0), [BLOCK_N, 4, 8])
        m_lo = tl.broadcast_to(tl.load(table + sub * 2 + 1, mask=live[:, None, None], other=0.0), [BLOCK_N, 4, 8])
        s_hi = tl.broadcast_to(tl.load(table + sub * 2 + 2, mask=live[:, None, None], other=0.0), [BLOCK_N, 4, 8])
        m_hi = tl.broadcast_to(tl.load(table + sub * 2 + 3, mask=live[:, None, None], other=0.0), [BLOCK_N, 4, 8])
        l0, l1, l2, l3 = _four_weights(qs, s_lo, m_lo, 0, EMULATE)
        h0, h1, h2, h3 = _four_weights(qs, s_hi, m_hi, 4, EMULATE)
        low = tl.join(tl.join(l0, l2), tl.join(l1, l3))  # [.., a, b]: byte 2a + b
        high = tl.join(tl.join(h0, h2), tl.join(h1, h3))
        w = tl.reshape(tl.join(low, high), [BLOCK_N, 256])
        xs = tl.load(x + r[:, None] * COLS + step * 256 + columns[None, :], mask=(r < rows)[:, None], other=0.0)
        if EMULATE:
            acc = tl.dot(w, tl.trans(xs), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(xs), acc)
    tl.atomic_add(out + r[:, None] * n + outs[None, :], tl.trans(acc), mask=(r < rows)[:, None] & live[None, :])


def scale_table(blocks: torch.Tensor, cols: int) -> torch.Tensor:
    """bf16 [n, cols // 32, 2]: each sub-block's (d * sc, -dmin * m), from ggml's float32 values."""
    n = blocks.shape[0]
    b = blocks.reshape(-1, FORMAT.nbytes)
    d, dmin = gguf_blocks._f16(b, 0), gguf_blocks._f16(b, 2)
    sc, mn = gguf_blocks._scale_min_k4(b[:, 4:16])
    table = torch.stack([(d * sc.float()).reshape(n, -1), -(dmin * mn.float()).reshape(n, -1)], dim=-1)
    return table.to(torch.bfloat16).contiguous()


def linear(x, blocks, cols, table, block_n=64, warps=4, slices=None):
    rows, n, steps = x.shape[0], blocks.shape[0], cols // 256
    if slices is None:  # about 3 programs an SM, whole steps a slice
        slices = max(1, min(steps, 3 * 132 // triton.cdiv(n, block_n)))
        while steps % slices:
            slices -= 1
    out = torch.zeros(rows, n, dtype=torch.float32, device=x.device)
    _q4k_bf16x2[(triton.cdiv(n, block_n), slices)](x, blocks.view(torch.int32), table, out, rows, n, COLS=cols,
                                                   BLOCK_N=block_n, SPAN=steps // slices,
                                                   EMULATE=x.device.type == "cpu", num_warps=warps)
    return out.to(x.dtype)


def check(device: str) -> dict:
    """Against the float product of the bf16-table weights (the probe's own, tight) and of ggml's (cosine)."""
    gen = torch.Generator(device=device).manual_seed(3)
    n, cols = (40, 512) if device == "cpu" else (1024, 4096)
    blocks = gguf_blocks.random_blocks(n, cols, FORMAT, gen)
    table = scale_table(blocks, cols)
    q = gguf_blocks._unpack(blocks.reshape(-1, FORMAT.nbytes)[:, 16:], 4, 32).reshape(n, cols).float()
    own = q * table[..., 0].float().repeat_interleave(32, 1) + table[..., 1].float().repeat_interleave(32, 1)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = torch.randn(16, cols, generator=gen, device=device).to(dtype)
    got = linear(x, blocks, cols, table, block_n=16 if device == "cpu" else 64, slices=2 if device == "cpu" else None)
    want = x.float() @ own.T
    ggml = x.float() @ gguf_blocks.dequantize(blocks, FORMAT, torch.float32).T
    return dict(max_error_own=((got.float() - want).abs().max() / want.abs().max()).item(),
                cosine_ggml=F.cosine_similarity(got.float().flatten(), ggml.flatten(), dim=0).item())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    if args.cpu:
        print(json.dumps(dict(check=check("cpu"))))
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from int4_compare import DEVICE, layer_seconds

    from deepflash.bench.common import finish

    record = dict(bench="q4k-bf16x2-probe", device=torch.cuda.get_device_name(), check=check(DEVICE), rows={})
    print(record["check"], flush=True)
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def weight(n, k):
        blocks = gguf_blocks.random_blocks(n, k, FORMAT, gen)
        return blocks, scale_table(blocks, k)
    for rows in (1, 16):
        us = record["rows"][rows] = {}
        us["bf16"] = layer_seconds(lambda n, k: torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16), F.linear, rows) * 1e6
        us["quant_gemv Q4_K"] = layer_seconds(weight, lambda x, w: quant_gemv.linear(x, w[0], quant_gemv.Q4_K, x.shape[-1]),
                                              rows) * 1e6
        for block_n in (64, 32):
            us[f"bf16x2 probe, {block_n} rows a program"] = layer_seconds(
                weight, lambda x, w: linear(x, w[0], x.shape[-1], w[1], block_n=block_n), rows) * 1e6
        for name, t in us.items():
            print(f"rows {rows:2d}  {name:34s} {t:8.1f} us  {us['bf16'] / t:.2f}x bf16", flush=True)
    finish(record, args.out)


if __name__ == "__main__":
    main()
