"""A/B of the feature-ring Triton kernels: this tree's ring_kernels.py against another version of the file
(e.g. main's: `git show main:deepflash/ring_kernels.py > .stage/ring_kernels_main.py`, carried), in turn,
twice, in one process. Per block format, scaled as the engine's mirror runs it (bench rings' measure):
write and dequantize GB/s and their fraction of the copy bandwidth. Prints and writes one JSON.
Usage: python3 scripts/gpu/rings_ab.py --other .stage/ring_kernels_main.py [--rows 8192] [--repeats 50]
[--graphs] [--out F]"""

import argparse
import importlib.util
import json
import sys

import deepflash
from deepflash.bench.common import copy_bandwidth, finish
from deepflash.bench.rings import measure
from deepflash.engine.runtime import resolve_device
from deepflash.kernels import rings as ring_kernels
from deepflash.kernels.row_formats import FORMATS


def load(path: str):
    """The other ring_kernels.py as a module of the package (its relative imports resolve)."""
    spec = importlib.util.spec_from_file_location("deepflash.ring_kernels_other", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--other", required=True, help="another version of deepflash/ring_kernels.py")
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--graphs", action="store_true", help="time CUDA graphs of the calls (bench rings --graphs)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out")
    args = ap.parse_args()
    device = resolve_device(args.device)
    bandwidth = copy_bandwidth(device)
    arms = {"this tree": ring_kernels, "other": load(args.other)}
    rows: dict = {arm: {} for arm in arms}
    for arm in [*arms, *arms]:
        deepflash.ring_kernels = arms[arm]  # what features.store_and_decode imports when a ring is made
        for fmt in (name for name, f in FORMATS.items() if f.dtype is None):
            r = measure(device, bandwidth, fmt, args, "triton", scaled=True)
            rows[arm].setdefault(fmt, []).append(
                {"write": round(r["write_fraction_of_copy"], 3), "dequantize": round(r["dequant_fraction_of_copy"], 3)})
            print(arm, fmt, json.dumps(rows[arm][fmt][-1]), flush=True)
    deepflash.ring_kernels = ring_kernels
    finish({"bench": "rings_ab", "copy_bandwidth_gb_s": bandwidth, "rows": args.rows, "graphs": args.graphs,
            "fraction_of_copy": rows},
           args.out)


if __name__ == "__main__":
    main()
