"""CPU: what the drafter's context rows lose when stored compactly, tap features (what the mirror holds
now, with features.storage_scale) against the fused rows the drafter computes from them (fc, before
hidden_norm: what context_kv needs once normed). Error of the fused rows relative to their norm, and
bytes per position, for the embedded target's taps over a depth prompt (argv[1] tokens, bench accept's
depth_prompts). Ends with one JSON line.
Usage (from the repository root): python3 benchmarks/2026-12-01-cpu-session16/fused_row_error.py 1024"""
import json
import sys

import torch

sys.path.insert(0, "benchmarks/2026-12-01-cpu-session15")
from hadamard_fc_error import depth_taps  # noqa: E402

from deepflash.features import storage_scale  # noqa: E402
from deepflash.quant import row_format  # noqa: E402

taps, drafter = depth_taps(int(sys.argv[1]))
with torch.no_grad():
    weight = drafter.fc.weight.float()
    fused = taps @ weight.T
    scale = storage_scale(drafter.fc.weight)


def stored(fmt: str, rows: torch.Tensor, channel_scale: torch.Tensor | None = None) -> torch.Tensor:
    f = row_format(fmt)
    s = torch.ones(rows.shape[1]) if channel_scale is None else channel_scale
    return f.decode(f.encode(rows * s)) / s


def relative(error: torch.Tensor) -> float:
    return round(float(error.norm() / fused.norm()), 4)


record = {"tokens": taps.shape[0], "tap_width": taps.shape[1], "fused_width": fused.shape[1]}
for fmt in ("bf16", "q8_0", "q4_0"):
    f = row_format(fmt)
    record[fmt] = {"taps": relative(stored(fmt, taps, scale) @ weight.T - fused),
                   "fused": relative(stored(fmt, fused) - fused),
                   "bytes_taps": f.row_bytes(taps.shape[1]), "bytes_fused": f.row_bytes(fused.shape[1])}
print(json.dumps(record))
