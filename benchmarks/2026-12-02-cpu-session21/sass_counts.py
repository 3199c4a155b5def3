"""Static sm_90 SASS instruction counts of the feature-ring kernels (write and decode, q8_0, q4_0, f16), per
program, as Triton's JIT would compile them for an H200 (tests/compile_kernels.py's compile, then the
nvdisasm Triton ships). Run from a checkout's root, on a machine without a GPU:
`PYTHONPATH=$PWD python3 benchmarks/2026-12-02-cpu-session21/sass_counts.py`. A proxy for the
instruction-bound block formats' ring throughput (BENCHMARKS.md), not a timing."""

import inspect
import os
import subprocess
import sys
import tempfile
from collections import Counter

sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
os.environ.pop("TRITON_INTERPRET", None)

import compile_kernels as ck  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")


def count(self, *args, grid, warmup, **kwargs):
    """JITFunction.run's stand-in: compile as compile_kernels does, disassemble, count instructions."""
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in ck.OPTIONS}
    bound = inspect.signature(self.fn).bind(*args, **kwargs).arguments
    constexprs = {p.name: bound[p.name] for p in self.params if p.is_constexpr}
    signature = {name: "constexpr" if name in constexprs else ck.type_of(value) for name, value in bound.items()}
    attrs = {(p.num,): [["tt.divisibility", 16]] for p in self.params if ck.aligned(p, bound.get(p.name))}
    kernel = triton.compile(ASTSource(self, signature, constexprs=constexprs, attrs=attrs), target=ck.TARGET,
                            options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([NVDISASM, "-c", f.name], capture_output=True, text=True, check=True).stdout
    lines = [line.split("*/", 1)[1].strip() for line in sass.splitlines() if "/*" in line and ";" in line]
    ops = Counter(word.split(".")[0] for word in (t.split()[1] if t.startswith("@") else t.split()[0]
                                                   for t in lines if t))
    print(f"{self.fn.__name__} FMT={constexprs['FMT']} GROUPS={constexprs['GROUPS']} "
          f"warps={options.get('num_warps')}: {len(lines)} instructions; {dict(ops.most_common(8))}")


JITFunction.run = count
from deepflash import ring_kernels  # noqa: E402
from deepflash.quant import FORMATS  # noqa: E402

width, n = 5 * 576, 5
for name in ("q8_0", "q4_0", "f16"):
    fmt = FORMATS[name]
    data = torch.zeros((8, *fmt.row_shape(width)), dtype=fmt.storage_dtype())
    ring_kernels.write(fmt, data, torch.zeros(8, dtype=torch.int64), torch.arange(n),
                       torch.zeros(n, width, dtype=torch.float32), torch.ones(width))
    ring_kernels.decode(fmt, data, torch.float32, torch.ones(width))
