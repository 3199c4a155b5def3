"""Torch's own int4 weight-only kernel (tinygemm: torch._weight_int4pack_mm, the kernel torchao's int4
weight-only layout runs on CUDA) against the GGUF block kernel (kernels/quant_gemv.py) and bf16 F.linear, on
one Qwen3-8B layer's projections (q, k, v, o, gate, up, down), for the 1-row decode step and the 16-row verify
step: device time a layer (CUDA graphs over 6 copies of the layer, so that weights come from memory, not
L2), bytes a second (int4: the packed weights plus a bf16 scale and zero a group), and the ratio to bf16.
Also, per tinygemm group size: whether a row's result is the same bits at 1, 4 and 16 rows (a verify step
must project a token as the decode step does) and the cosine against the float product of its weights.
Usage: python3 scripts/gpu/int4_compare.py [--out F]. Ends with one JSON line."""

import argparse

import torch
import torch.nn.functional as F

from deepflash.bench.common import copy_bandwidth, finish, graph_seconds
from deepflash.kernels import quant_gemv
from deepflash.quant import gguf_blocks

DEVICE = "cuda"
SHAPES = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (12288, 4096), (12288, 4096), (4096, 12288)]
COPIES = 6  # 6 layers: more bytes than L2 holds in every format
TINYGEMM = [(32, 2), (32, 8), (128, 8)]  # (group, inner k tiles)
BLOCK_FORMATS = [quant_gemv.Q4_1, quant_gemv.Q4_K, quant_gemv.Q6_K, quant_gemv.Q8_0]


def tinygemm_weight(n: int, k: int, group: int, inner: int, gen: torch.Generator):
    """(packed int4, scales and zeros [k / group, n, 2] bf16, the float weights they stand for)."""
    q = torch.randint(0, 16, (n, k), generator=gen, device=DEVICE, dtype=torch.int32)
    scale = (torch.rand(n, k // group, generator=gen, device=DEVICE) * 0.01 + 0.001).to(torch.bfloat16)
    zero = (torch.randn(n, k // group, generator=gen, device=DEVICE) * 0.01).to(torch.bfloat16)
    packed = torch._convert_weight_to_int4pack(((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8), inner)
    scales_zeros = torch.stack([scale.t(), zero.t()], dim=2).contiguous()
    weight = (q.float() - 8) * scale.float().repeat_interleave(group, 1) + zero.float().repeat_interleave(group, 1)
    return packed, scales_zeros, weight


def layer_seconds(make, call, rows: int) -> float:
    layers = [[make(n, k) for n, k in SHAPES] for _ in range(COPIES)]
    xs = {k: torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16) for k in {k for _, k in SHAPES}}

    def step():
        for layer in layers:
            for (_, k), weight in zip(SHAPES, layer):
                call(xs[k], weight)
    return graph_seconds(step, calls=3, replays=10) / COPIES


def row_checks(gen: torch.Generator) -> dict:
    out = {}
    for group, inner in TINYGEMM:
        packed, scales_zeros, weight = tinygemm_weight(1024, 4096, group, inner, gen)
        x = torch.randn(16, 4096, device=DEVICE, dtype=torch.bfloat16)
        many = torch._weight_int4pack_mm(x, packed, group, scales_zeros)
        one = torch.cat([torch._weight_int4pack_mm(x[i : i + 1], packed, group, scales_zeros) for i in range(16)])
        four = torch._weight_int4pack_mm(x[:4], packed, group, scales_zeros)
        cosine = F.cosine_similarity(many.float().flatten(), (x.float() @ weight.T).flatten(), dim=0).item()
        out[f"G{group}"] = dict(same_bits_1_4_16=bool(torch.equal(many, one) and torch.equal(many[:4], four)),
                                cosine=cosine)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out")
    args = p.parse_args()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    record = dict(bench="int4-compare", device=torch.cuda.get_device_name(), torch=torch.__version__,
                  copy_bandwidth_gb_s=copy_bandwidth(torch.device(DEVICE)), rows={}, checks=row_checks(gen))
    print(f"row checks {record['checks']}", flush=True)
    for rows in (1, 16):
        timings = record["rows"][rows] = {}
        seconds = layer_seconds(lambda n, k: torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16), F.linear, rows)
        timings["bf16"] = dict(us=seconds * 1e6, gb_s=sum(n * k * 2 for n, k in SHAPES) / seconds / 1e9)
        for group, inner in TINYGEMM:
            seconds = layer_seconds(lambda n, k: tinygemm_weight(n, k, group, inner, gen)[:2],
                                    lambda x, w: torch._weight_int4pack_mm(x, w[0], group, w[1]), rows)
            nbytes = sum(n * k // 2 + n * k // group * 4 for n, k in SHAPES)
            timings[f"tinygemm G{group} inner {inner}"] = dict(us=seconds * 1e6, gb_s=nbytes / seconds / 1e9)
        for fmt in BLOCK_FORMATS:
            block_format = gguf_blocks.block_format(fmt)
            seconds = layer_seconds(lambda n, k: gguf_blocks.random_blocks(n, k, block_format, gen),
                                    lambda x, w: quant_gemv.linear(x, w, fmt, x.shape[-1]), rows)
            nbytes = sum(quant_gemv.row_bytes(fmt, k) * n for n, k in SHAPES)
            timings[f"ours {block_format.name}"] = dict(us=seconds * 1e6, gb_s=nbytes / seconds / 1e9)
        for name, t in timings.items():
            t["x_bf16"] = timings["bf16"]["us"] / t["us"]
            print(f"rows {rows:2d}  {name:22s} {t['us']:8.1f} us  {t['gb_s']:7.0f} GB/s  {t['x_bf16']:.2f}x bf16",
                  flush=True)
    finish(record, args.out)


if __name__ == "__main__":
    main()
