"""Kernel launches per decoder layer of a decode step (1 token), per target family on its Triton kernels, counted on
the CPU under Triton's interpreter: Triton launches at the interpreter's JITFunction.run, torch ops that would launch
a kernel (non-view aten ops outside the Triton launches) with a dispatch mode. A decode step of the small-width
families is bound by how many kernels it runs, so the count says where fusion pays.

    TRITON_INTERPRET=1 python scripts/count_launches.py --families qwen3,qwen3-moe,qwen3.5,qwen3.5-moe --out F.json

--format Q4_K_M (or another of bench quant's formats) counts a target whose weights are random blocks of that
format (llama.cpp's Q4_K_M mix), at widths of whole 256-column superblocks.
"""

import argparse
import json
import os
from collections import Counter

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from deepflash.bench.families import family_shape  # noqa: E402
from deepflash.bench.quant import FORMAT_NAMES, format_of  # noqa: E402
from deepflash.models import random_model  # noqa: E402
from deepflash.models.config import ModelConfig  # noqa: E402
from deepflash.quant.random_weights import quantize_random_  # noqa: E402

# ops that launch no kernel (views, allocations, host scalars)
NO_KERNEL = {"empty", "empty_like", "empty_strided", "resolve_conj", "resolve_neg", "lift_fresh", "result_type",
             "item", "_local_scalar_dense", "is_nonzero", "contiguous", "_unsafe_view"}


class Launches(TorchDispatchMode):
    """Counts Triton launches (by kernel) and the torch ops outside them (by op)."""

    def __init__(self):
        super().__init__()
        self.triton, self.torch, self.inside = Counter(), Counter(), 0
        self.run = InterpretedFunction.run

    def __enter__(self):
        counter = self

        def run(fn, *args, **kwargs):
            counter.triton[fn.fn.__name__] += 1
            counter.inside += 1
            try:
                return counter.run(fn, *args, **kwargs)
            finally:
                counter.inside -= 1
        InterpretedFunction.run = run
        return super().__enter__()

    def __exit__(self, *exc):
        InterpretedFunction.run = self.run
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside and not func.is_view and name not in NO_KERNEL:
            self.torch[name] += 1
        return func(*args, **(kwargs or {}))

    def snapshot(self) -> tuple[Counter, Counter]:
        return Counter(self.triton), Counter(self.torch)


# every projection's input width a whole number of 256-column superblocks (the k-quants')
SUPERBLOCK_WIDTHS = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
                     "shared_expert_intermediate_size": 256, "head_dim": 64, "linear_key_head_dim": 64,
                     "linear_value_head_dim": 64}


def layer_counts(family: str, fmt: str = "bf16") -> list[dict]:
    """Each decoder layer's launches in a decode step after a 32-token prefill, on a 4-layer tiny bf16 model
    (fmt: its weights in blocks of a bench quant format)."""
    shape = family_shape(family, "tiny", 4)
    if fmt != "bf16":
        shape = {**shape, **{k: v for k, v in SUPERBLOCK_WIDTHS.items() if k in shape}}
    cfg = ModelConfig.from_hf(shape)
    types = shape.get("layer_types") or ["full_attention"] * 4
    target = random_model(cfg, device="cpu", dtype=torch.bfloat16, seed=0, std=0.02)
    if fmt != "bf16":
        target = quantize_random_(target, format_of(fmt, 4), seed=0)
    target = target.use_kernels("triton")
    cache = target.new_cache(1, 64)
    layers = [m for name, m in target.named_modules() if name.count(".") == 2 and ".layers." in name]
    marks: dict[int, list] = {i: [] for i in range(len(layers))}
    with torch.no_grad():
        target(torch.randint(2, cfg.vocab_size, (1, 32)), torch.arange(32), cache, 32)
        with Launches() as counter:
            hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: marks[i].append(counter.snapshot()))
                     for i, layer in enumerate(layers)]
            hooks += [layer.register_forward_hook(lambda m, a, o, i=i: marks[i].append(counter.snapshot()))
                      for i, layer in enumerate(layers)]
            target(torch.randint(2, cfg.vocab_size, (1, 1)), torch.arange(32, 33), cache, 33)
    for hook in hooks:
        hook.remove()
    rows = []
    for i, ((triton_in, torch_in), (triton_out, torch_out)) in marks.items():
        triton, ops = triton_out - triton_in, torch_out - torch_in
        rows.append({"layer": i, "type": types[i],
                     "triton": sum(triton.values()), "torch": sum(ops.values()),
                     "triton_kernels": dict(triton), "torch_ops": dict(ops)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", default="qwen3,qwen3-moe,qwen3.5,qwen3.5-moe")
    p.add_argument("--format", default="bf16", choices=FORMAT_NAMES)
    p.add_argument("--out")
    args = p.parse_args()
    record = {}
    for family in args.families.split(","):
        record[family] = rows = layer_counts(family, args.format)
        seen = set()
        for row in rows:
            if row["type"] not in seen:
                seen.add(row["type"])
                print(f"{family:12s} {row['type']:17s} {row['triton'] + row['torch']:3d} kernels: {row['triton']} "
                      f"Triton {row['triton_kernels']}, {row['torch']} torch {row['torch_ops']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
