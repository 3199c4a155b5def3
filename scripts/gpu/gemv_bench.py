"""A decode step's projections with their prologue fused in (deepflash/kernels/gemv.py) against the separate
kernels they replace (layer_ops' add + norm or silu * up, then torch's GEMM) and torch's GEMM alone:
device time per call (CUDA graphs; the calls cycle over enough copies of the weight that it is read from
memory, as in a model, not from L2) and the weight bytes per second as a fraction of the device copy
bandwidth. Without --configs the shipped tiling (kernels.config.ProjectionTiling) is timed; with it, each
(BLOCK_N, BLOCK_K, warps, stages, weight first, TMA) of --configs with each programs-per-SM target of
--waves (how far the reduction is split), passed to the kernels as a ProjectionTiling; the best is
reported, with its largest difference from the separate kernels' output relative to that output's largest
magnitude. Shapes: SmolLM2-135M's and Qwen3-8B's q/k/v (add + norm), gate/up (add + norm), down (silu)
and o (none) in bf16.
Usage: python3 scripts/gpu/gemv_bench.py [--configs 16x128x4x3,64x128x4x4w,64x128x4x3wt,...] [--waves 4,8]
[--rows 1,16] [--models smollm2] [--unroll-from N|none] [--plain] [--out F]
Ends with one JSON line."""

import argparse
from functools import partial

import torch
import torch.nn.functional as F

from deepflash.bench.common import copy_bandwidth, finish, graph_seconds
from deepflash.kernels import gemv as gemv_kernel
from deepflash.kernels.config import ProjectionTiling
from deepflash.kernels.layer_ops import add_rms_norm, silu_mul

# name: (hidden, q/k/v rows, intermediate, query heads x head dim)
MODELS = {"smollm2": (576, (9 + 2 * 3) * 64, 1536, 9 * 64), "qwen3-8b": (4096, (32 + 2 * 8) * 128, 12288, 32 * 128)}
L2_BYTES = 60 * 2**20
DEVICE = "cuda"


def norm_then_gemm(x, delta, gain, weight):
    return F.linear(add_rms_norm(x, delta, gain, 1e-6)[1], weight)


def fused_output(call, weight):
    out = call(weight)
    return out[1] if isinstance(out, tuple) else out  # norm_linear returns (sum, projection)


def silu_then_gemm(gate_up, weight):
    return F.linear(silu_mul(gate_up), weight)


def plain_case(name: str, shape: tuple[int, int], x: torch.Tensor):
    """A projection with no prologue (gemv_kernel.linear): its separate form is the GEMM alone."""
    return name, shape, partial(tiled, gemv_kernel.linear, x), partial(F.linear, x), partial(F.linear, x)


def tiled(kernel, *args):
    """kernel(*args[:-2], weight, tiling=tiling) from (..., tiling, weight): the fused call of a tiling."""
    *inputs, tiling, weight = args
    return kernel(*inputs, weight, tiling=tiling)


def cases(rows: int, models: list[str], plain: bool):
    """(name, weight shape, fused call taking (tiling, weight), separate and GEMM-only calls taking the
    weight), per projection of each model; with `plain` also q/k/v, gate/up and down with no prologue, which tells what
    the add + norm or silu * up costs a tiling."""
    for model in models:
        hidden, qkv, inner, heads_dims = MODELS[model]
        x, delta = (torch.randn(rows, hidden, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
        gain = torch.ones(hidden, device=DEVICE, dtype=torch.bfloat16)
        gate_up = torch.randn(rows, 2 * inner, device=DEVICE, dtype=torch.bfloat16)
        for proj, shape in (("qkv", (qkv, hidden)), ("gate_up", (2 * inner, hidden))):
            yield (f"{model} {proj}", shape, partial(tiled, gemv_kernel.norm_linear, x, delta, gain, 1e-6),
                   partial(norm_then_gemm, x, delta, gain), partial(F.linear, x))
            if plain:
                yield plain_case(f"{model} {proj} plain", shape, x)
        yield (f"{model} down", (hidden, inner), partial(tiled, gemv_kernel.silu_linear, gate_up),
               partial(silu_then_gemm, gate_up), partial(F.linear, silu_mul(gate_up)))
        if plain:
            yield plain_case(f"{model} down plain", (hidden, inner), silu_mul(gate_up))
        # the attention output projection: no prologue
        yield plain_case(f"{model} o", (hidden, heads_dims),
                         torch.randn(rows, heads_dims, device=DEVICE, dtype=torch.bfloat16))


def parse_config(text: str) -> tuple:
    """BLOCK_NxBLOCK_KxWARPSxSTAGES and its flags, "w": the weight as the product's first operand, "t": its tiles
    through TMA (kernels.config.ProjectionTiling): (BLOCK_N, BLOCK_K, warps, stages, weight first, TMA)."""
    bare = text.rstrip("wt")
    return (*map(int, bare.split("x")), "w" in text[len(bare):], "t" in text[len(bare):])


def cycled(call, weights):
    """One call per weight copy: each reads its weight from memory."""
    def run():
        for w in weights:
            call(w)
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", help="BLOCK_NxBLOCK_KxWARPSxSTAGES[w][t],... (default: the shipped tiling)")
    ap.add_argument("--waves", default="4,8", help="programs per SM of the reduction's split (with --configs)")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--models", default=",".join(MODELS), help="of " + ", ".join(MODELS))
    ap.add_argument("--unroll-from", default=str(ProjectionTiling.unroll_from),
                    help="reductions of at least this many slices add them unrolled (none: never)")
    ap.add_argument("--plain", action="store_true", help="also q/k/v, gate/up and down with no prologue")
    ap.add_argument("--out")
    args = ap.parse_args()
    unroll = None if args.unroll_from.lower() == "none" else int(args.unroll_from)
    bandwidth = copy_bandwidth(torch.device(DEVICE))
    variants = {"shipped": ProjectionTiling(unroll_from=unroll)}
    for config in [parse_config(c) for c in args.configs.split(",")] if args.configs else []:
        for waves in map(float, args.waves.split(",")):
            table = ((None, None, (*config[:5], waves, config[5])),)
            flags = ("w" if config[4] else "") + ("t" if config[5] else "")
            variants[f"{'x'.join(map(str, config[:4]))}{flags} waves {waves}"] = ProjectionTiling(
                small=table, large=table, unroll_from=unroll)
    if args.configs:
        del variants["shipped"]
    results = []
    for rows in map(int, args.rows.split(",")):
        for name, shape, fused, separate, gemm in cases(rows, args.models.split(","), args.plain):
            nbytes = shape[0] * shape[1] * 2
            copies = max(2, -(-2 * L2_BYTES // nbytes))
            weights = [torch.randn(shape, device=DEVICE, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            row = {"case": name, "rows": rows, "weight_mb": nbytes / 2**20,
                   "separate_us": 1e6 * graph_seconds(cycled(separate, weights), calls=1) / copies,
                   "gemm_only_us": 1e6 * graph_seconds(cycled(gemm, weights), calls=1) / copies, "fused_us": {}}
            errors, want = {}, separate(weights[0]).float()
            for variant, tiling in variants.items():
                call = partial(fused, tiling)
                row["fused_us"][variant] = 1e6 * graph_seconds(cycled(call, weights), calls=1) / copies
                got = fused_output(call, weights[0]).float()
                errors[variant] = ((got - want).abs().max() / want.abs().max()).item()
            best = min(row["fused_us"], key=row["fused_us"].get)
            row["best_config"], row["best_us"], row["best_error"] = best, row["fused_us"][best], errors[best]
            row["largest_error"] = max(errors.values())
            for key in ("separate_us", "gemm_only_us", "best_us"):
                row[key.replace("_us", "_of_copy")] = nbytes / (row[key] * 1e-6) / 1e9 / bandwidth
            results.append(row)
            print(f"{name:18s} rows {rows:2d}: separate {row['separate_us']:7.1f} us, GEMM alone "
                  f"{row['gemm_only_us']:7.1f} us ({row['gemm_only_of_copy']:.2f} of copy), fused "
                  f"{row['best_us']:7.1f} us ({row['best_of_copy']:.2f}) with {best}, error {row['best_error']:.1e} "
                  f"(largest {row['largest_error']:.1e})", flush=True)
    finish({"bench": "gemv", "device": torch.cuda.get_device_name(), "copy_bandwidth_gb_s": bandwidth,
            "results": results}, args.out)


if __name__ == "__main__":
    main()
