"""How fast torch's GEMM streams Qwen3-8B's decode projections, by weight layout and BLAS library: the
measurement behind models/layers.gemm_layout (the stored layout of weights that take torch's GEMM).
Per projection and row count: F.linear on the engine's [N, K] weight, x @ W with the weight stored [K, N],
torch.mv (one row), and F.linear with cuBLASLt preferred; device time per call (CUDA graphs, cycling over
weight copies so each call reads its weight from memory) and its fraction of the copy bandwidth.
Usage: python3 scripts/gpu/blas_layouts.py [--rows 1,16] [--out F]
Ends with one JSON line."""

import argparse

import torch
import torch.nn.functional as F
from gemv_bench import L2_BYTES, MODELS, cycled

from deepflash.bench.common import copy_bandwidth, finish, graph_seconds

DEVICE = "cuda"


def shapes():
    """(name, [N, K]) of Qwen3-8B's projections and its lm_head."""
    hidden, qkv, inner, heads_dims = MODELS["qwen3-8b"]
    return {"qkv": (qkv, hidden), "gate_up": (2 * inner, hidden), "down": (hidden, inner),
            "o": (hidden, heads_dims), "lm_head": (151936, hidden)}


def lt_linear(x, w):
    """F.linear with cuBLASLt preferred (restored after, so the other variants keep torch's default)."""
    kept = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return F.linear(x, w)
    finally:
        torch.backends.cuda.preferred_blas_library(kept)


def variants(x: torch.Tensor):
    """name -> (call on a weight, whether it takes the [K, N] copy)."""
    out = {"F.linear [N, K]": (lambda w: F.linear(x, w), False),
           "x @ W [K, N]": (lambda w: x @ w, True),
           "F.linear cuBLASLt": (lambda w: lt_linear(x, w), False)}
    if x.shape[0] == 1:
        out["torch.mv [N, K]"] = (lambda w: torch.mv(w, x[0]), False)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--out")
    args = ap.parse_args()
    bandwidth = copy_bandwidth(torch.device(DEVICE))
    results = []
    for name, (n, k) in shapes().items():
        nbytes = n * k * 2
        copies = max(2, -(-2 * L2_BYTES // nbytes))
        weights = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        transposed = [w.t().contiguous() for w in weights]
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
            row = {"case": name, "rows": rows, "weight_mb": nbytes / 2**20, "us": {}, "of_copy": {}}
            for variant, (call, kn) in variants(x).items():
                us = 1e6 * graph_seconds(cycled(call, transposed if kn else weights), calls=1) / copies
                row["us"][variant], row["of_copy"][variant] = us, nbytes / (us * 1e-6) / 1e9 / bandwidth
            results.append(row)
            print(f"{name:8s} rows {rows:2d}: " + ", ".join(f"{v} {row['us'][v]:6.1f} us ({row['of_copy'][v]:.2f})"
                                                           for v in row["us"]), flush=True)
        del weights, transposed
    finish({"bench": "blas_layouts", "device": torch.cuda.get_device_name(), "copy_bandwidth_gb_s": bandwidth,
            "results": results}, args.out)


if __name__ == "__main__":
    main()
