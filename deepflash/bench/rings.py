"""deepflash bench rings: feature-ring write and bulk dequantize throughput per storage dtype, and bytes
per position for the embedded pair and a Qwen3-8B-shaped pair (5 taps x 4096)."""

from __future__ import annotations

import torch

from ..drafter.features import FeatureRing, pick_ring_kernels
from ..engine.runtime import resolve_device
from ..errors import UserError
from ..kernels.config import Shape
from ..kernels.row_formats import FORMATS
from .common import copy_bandwidth, environment, finish, graph_seconds, sync, table

PAIRS = {"SmolLM2-135M (5 taps x 576)": 5 * 576, "Qwen3-8B-shaped (5 taps x 4096)": 5 * 4096}


def _time(device, fn, repeats: int, graphs: bool = False) -> float:
    """Seconds per call: `repeats` calls launched from Python, or (graphs, CUDA only) captured as one CUDA
    graph, the kernels' time without the launches between them (a call on 8192 rows takes ~40 us, so
    eager timing may count Python's launches too)."""
    if graphs:
        return graph_seconds(fn, calls=repeats, replays=3)
    fn()
    sync(device)
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1000 / repeats
    import time

    began = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - began) / repeats


def throughput(device, fmt_name: str, width: int, rows: int, repeats: int, kernels: str, scaled: bool = False,
               graphs: bool = False, shape: Shape | None = None) -> dict:
    """GB/s of one bulk write (f32 rows in, encoded rows out) and one bulk read (encoded in, f32 out),
    counting bytes read plus bytes written, like the copy bandwidth it is compared with. scaled: with a
    per-channel storage scale, as the engine's mirror runs the block formats (features.storage_scale)."""
    fmt = FORMATS[fmt_name]
    scale = torch.exp2(torch.arange(width, device=device) % 7 - 3.0) if scaled else None
    ring = FeatureRing(rows, width, fmt, device, kernels=kernels, channel_scale=scale, shape=shape)
    data = torch.randn(rows, width, device=device)
    positions = torch.arange(rows, device=device)
    stored = rows * fmt.row_bytes(width)
    write_s = _time(device, lambda: ring.write(positions, data), repeats, graphs)
    moved = data.nbytes + stored
    # f32 rows decode to themselves (no kernel runs): no throughput to report
    read_s = None if fmt.dtype == torch.float32 else _time(device, lambda: ring.decode(ring.data), repeats, graphs)
    return {"write_gb_s": moved / write_s / 1e9, "dequant_gb_s": moved / read_s / 1e9 if read_s else None,
            "row_bytes": fmt.row_bytes(width)}


def parse_shape(text: str) -> Shape:
    parts = text.split("x")
    if len(parts) not in (2, 4) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise UserError(f"--triton-shapes: {text!r} is not GROUPSxWARPS or GROUPSxWARPSxITEMSxSTAGES, e.g. 32x4 "
                        "or 16x1x8x3")
    return Shape(*map(int, parts))


def measure(device, bandwidth: float, fmt: str, args, kernels: str, scaled: bool = False,
            shape: Shape | None = None) -> dict:
    r = throughput(device, fmt, PAIRS["SmolLM2-135M (5 taps x 576)"], args.rows, args.repeats, kernels, scaled,
                   args.graphs, shape)
    r["write_fraction_of_copy"] = r["write_gb_s"] / bandwidth
    r["dequant_fraction_of_copy"] = r["dequant_gb_s"] / bandwidth if r["dequant_gb_s"] else None
    return r


def run(args) -> dict:
    shapes = [parse_shape(text) for text in args.triton_shapes.split(",")] if args.triton_shapes else []
    device = resolve_device(args.device)
    if args.graphs and device.type != "cuda":
        raise UserError(f"--graphs times CUDA graphs; the device is {device}")
    bandwidth = copy_bandwidth(device)
    results = {}
    for kernels in (pick_ring_kernels(kind, device) for kind in args.kernels.split(",")):
        for fmt in FORMATS:
            results[f"{fmt} {kernels}"] = measure(device, bandwidth, fmt, args, kernels)
            if FORMATS[fmt].dtype is None:  # what the engine's mirror runs for the block formats
                results[f"{fmt} {kernels} scaled"] = measure(device, bandwidth, fmt, args, kernels, scaled=True)
    for shape in shapes:
        for fmt in FORMATS:
            results[f"{fmt} triton {shape}"] = measure(device, bandwidth, fmt, args, "triton", shape=shape)
            if FORMATS[fmt].dtype is None:  # a program loads the scale once for its ITEMS rows
                results[f"{fmt} triton {shape} scaled"] = measure(device, bandwidth, fmt, args, "triton",
                                                                  scaled=True, shape=shape)
    sizes = {pair: {fmt: FORMATS[fmt].row_bytes(width) + 8 for fmt in FORMATS} for pair, width in PAIRS.items()}
    timed = ", CUDA graphs" if args.graphs else ""
    table(f"ring throughput ({args.rows} rows x {PAIRS['SmolLM2-135M (5 taps x 576)']} features{timed}; copy "
          f"{bandwidth:.0f} GB/s)", ["dtype, kernels", "write GB/s", "of copy", "dequant GB/s", "of copy"],
          [[f, r["write_gb_s"], r["write_fraction_of_copy"], r["dequant_gb_s"] or "-", r["dequant_fraction_of_copy"] or "-"]
           for f, r in results.items()])
    table("bytes per position (row + 8-byte position tag)", ["pair"] + list(FORMATS),
          [[pair] + list(v.values()) for pair, v in sizes.items()])
    record = {"bench": "rings", **environment(device), "copy_bandwidth_gb_s": bandwidth, "rows": args.rows,
              "graphs": args.graphs, "throughput": results, "bytes_per_position": sizes}
    return finish(record, args.out)


def register(sub) -> None:
    p = sub.add_parser("rings", help="feature ring write / dequantize throughput and bytes per position")
    p.add_argument("--device", default="auto")
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--graphs", action="store_true",
                   help="time the calls as one CUDA graph: the kernels' own time, without Python's launches "
                        "between them (CUDA only)")
    p.add_argument("--kernels", default="auto",
                   help="comma list of ring kernels to time: auto (what the engine runs: triton on CUDA, else "
                        "torch), torch (eager), triton (hand-written, one pass each way)")
    p.add_argument("--triton-shapes",
                   help="comma list of GROUPSxWARPS[xITEMSxSTAGES] (e.g. 16x1,32x4,16x1x8x3) to time the Triton "
                        "kernels with, every format, besides their defaults (kernels/rings.py SHAPES): blocks per work "
                        "item, warps per program, work items per program, pipeline stages")
    p.add_argument("--out")
    p.set_defaults(func=run)
