"""CPU: the embedded target's tap features over a 1K-token prompt (per-channel RMS), and the relative
error of the shipped drafter's fc output when the features are stored in q4_0 / q8_0, unscaled, scaled
by 1 / RMS, or by features.storage_scale (powers of two from fc's column norms). Ends with one JSON line."""
import json

import torch

from deepflash.bench.prompts import depth_prompts
from deepflash.config import EngineConfig
from deepflash.features import storage_scale
from deepflash.quant import row_format
from deepflash.runtime import load_runtime

rt = load_runtime(EngineConfig(device="cpu", max_ctx=2048, spec="on"))
target, drafter = rt.engine.target, rt.engine.drafter
ids = depth_prompts(rt.tokenizer, 1024, 1)[0]
with torch.no_grad():
    _, feats = target(torch.tensor([ids]), torch.arange(len(ids)), target.new_cache(1, 2048), len(ids),
                      capture=drafter.cfg.target_layer_ids, logits="last")
x = feats[0].float()
rms = x.pow(2).mean(0).sqrt()
weight = drafter.fc.weight.float()
norms = weight.norm(dim=0)


def fc_error(fmt: str, scale: torch.Tensor) -> float:
    f = row_format(fmt)
    y = f.decode(f.encode(x * scale)) / scale
    return round(float(((y - x) @ weight.T).norm() / (x @ weight.T).norm()), 4)


one = torch.ones_like(rms)
record = {"prompt_tokens": len(ids), "rms_median": round(float(rms.median()), 2),
          "rms_top": [round(v, 1) for v in rms.topk(6).values.tolist()],
          "corr_log_norm_vs_minus_log_rms": round(float(torch.corrcoef(torch.stack([norms.log(), -rms.log()]))[0, 1]), 3)}
for fmt in ("q4_0", "q8_0"):
    record[fmt] = {"unscaled": fc_error(fmt, one), "1/rms": fc_error(fmt, 1 / rms),
                   "storage_scale": fc_error(fmt, storage_scale(drafter.fc.weight))}
print(json.dumps(record))
