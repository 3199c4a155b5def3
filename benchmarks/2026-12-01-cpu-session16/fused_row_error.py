"""CPU: what the drafter's context rows lose when stored compactly, tap features (what the mirror holds
now, with features.storage_scale) against the fused rows the drafter computes from them (fc, before
hidden_norm: what context_kv needs once normed). Error of the fused rows relative to their norm, and
bytes per position, for the embedded target's taps over a depth prompt (argv[1] tokens, bench accept's
depth_prompts). Ends with one JSON line.
Usage (from the repository root): python3 benchmarks/2026-12-01-cpu-session16/fused_row_error.py 1024"""
import json
import sys

import torch

from deepflash.bench.prompts import depth_prompts
from deepflash.config import EngineConfig
from deepflash.features import storage_scale
from deepflash.quant import row_format
from deepflash.runtime import load_runtime

depth = int(sys.argv[1])
rt = load_runtime(EngineConfig(device="cpu", max_ctx=8192, spec="on"))
target, drafter = rt.engine.target, rt.engine.drafter
ids = depth_prompts(rt.tokenizer, depth, 1)[0]
with torch.no_grad():
    _, feats = target(torch.tensor([ids]), torch.arange(len(ids)), target.new_cache(1, 8192), len(ids),
                      capture=drafter.cfg.target_layer_ids, logits="last")
    taps = feats[0].float()
    weight = drafter.fc.weight.float()
    fused = taps @ weight.T
    scale = storage_scale(drafter.fc.weight)


def stored(fmt: str, rows: torch.Tensor, channel_scale: torch.Tensor | None = None) -> torch.Tensor:
    f = row_format(fmt)
    s = torch.ones(rows.shape[1]) if channel_scale is None else channel_scale
    return f.decode(f.encode(rows * s)) / s


def relative(error: torch.Tensor) -> float:
    return round(float(error.norm() / fused.norm()), 4)


record = {"tokens": len(ids), "tap_width": taps.shape[1], "fused_width": fused.shape[1]}
for fmt in ("bf16", "q8_0", "q4_0"):
    f = row_format(fmt)
    record[fmt] = {"taps": relative(stored(fmt, taps, scale) @ weight.T - fused),
                   "fused": relative(stored(fmt, fused) - fused),
                   "bytes_taps": f.row_bytes(taps.shape[1]), "bytes_fused": f.row_bytes(fused.shape[1])}
print(json.dumps(record))
