"""Decode attention alone, kernel file against kernel file: device time per call (CUDA graphs of 20
calls, so no launch overhead), the error against SDPA, and whether each query of a multi-token step
equals a one-token step at its position bit for bit (what keeps greedy speculative decoding equal to
plain decoding). Shapes: SmolLM2-135M's attention (9 query heads over 3 kv heads, dim 64) and Qwen3-8B's
(32 over 8, dim 128), bf16; 1, 8 and 16 query tokens; prompts of 256 to 8K tokens (the CUDA-graph
bucket is the next power of two, as the engine's).
Usage: python3 scripts/gpu/attention_bench.py deepflash/models/decode_kernel.py OTHER_KERNEL.py [--out F]
Ends with one JSON line."""

import argparse
import importlib.util
import json
import math

import torch

from deepflash.bench.common import graph_seconds

SHAPES = {"smollm2": (9, 3, 64), "qwen3-8b": (32, 8, 128)}
TOKENS = (1, 8, 16)
DEPTHS = (256, 1024, 5849, 8000)
CAPACITY = 8192
DEVICE = "cuda"


def load(path: str):
    spec = importlib.util.spec_from_file_location(f"kernel_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sdpa(q, k, v, positions):
    """The reference: each query sees keys 0..its position."""
    end = int(positions[-1]) + 1
    groups = q.shape[1] // k.shape[1]
    keys, values = (c[:, :, :end].float().repeat_interleave(groups, dim=1) for c in (k, v))
    visible = torch.arange(end, device=q.device)[None, :] <= positions[:, None]
    return torch.nn.functional.scaled_dot_product_attention(q.float(), keys, values, attn_mask=visible)


def measure(kernel, heads: int, kv_heads: int, dim: int, tokens: int, depth: int) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(depth + tokens)
    k, v = (torch.randn(1, kv_heads, CAPACITY, dim, device=DEVICE, generator=gen, dtype=torch.bfloat16)
            for _ in range(2))
    q = torch.randn(1, heads, tokens, dim, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    positions = torch.arange(depth, depth + tokens, device=DEVICE)
    bucket = min(CAPACITY, 2 ** math.ceil(math.log2(depth + tokens)))
    out = kernel.decode_attention(q, k, v, positions, bucket)
    error = float((out.float() - sdpa(q, k, v, positions)).abs().max())
    alone = [kernel.decode_attention(q[:, :, i : i + 1].contiguous(), k, v, positions[i : i + 1], bucket)
             for i in range(tokens)]
    exact = all(torch.equal(out[:, :, i : i + 1], a) for i, a in enumerate(alone))
    us = 1e6 * graph_seconds(lambda: kernel.decode_attention(q, k, v, positions, bucket))
    return {"us": round(us, 2), "max_error": error, "verify_equals_decode": exact}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kernels", nargs="+", help="decode_kernel.py files to compare")
    ap.add_argument("--out")
    args = ap.parse_args()
    record = {}
    for path in args.kernels:
        kernel = load(path)
        for shape, (heads, kv_heads, dim) in SHAPES.items():
            for tokens in TOKENS:
                for depth in DEPTHS:
                    row = measure(kernel, heads, kv_heads, dim, tokens, depth)
                    record.setdefault(path, {})[f"{shape} T={tokens} depth={depth}"] = row
                    print(f"{path}  {shape} T={tokens:2d} depth={depth:5d}: {row['us']:8.2f} us, "
                          f"max error {row['max_error']:.2e}, verify == decode {row['verify_equals_decode']}",
                          flush=True)
    if args.out:
        open(args.out, "w").write(json.dumps(record, indent=2))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
