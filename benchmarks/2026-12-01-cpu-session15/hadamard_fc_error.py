"""CPU: the relative error of the shipped drafter's fc output when the embedded target's tap features
over a depth prompt (argv[1] tokens, bench accept's depth_prompts) are stored in q4_0 / q8_0 with
features.storage_scale, without and with an orthonormal Hadamard rotation of each 32- or 64-value block
before quantizing (undone after decoding). Ends with one JSON line.
Usage: python3 hadamard_fc_error.py 1024 (and 7500)"""
import json, sys
import torch
from deepflash.bench.prompts import depth_prompts
from deepflash.config import EngineConfig
from deepflash.features import storage_scale
from deepflash.quant import row_format
from deepflash.runtime import load_runtime

def depth_taps(depth):
    """The embedded target's tap features over one depth prompt, and the shipped drafter (also used by
    the sixteenth session's fused_row_error.py)."""
    rt = load_runtime(EngineConfig(device="cpu", max_ctx=8192, spec="on"))
    target, drafter = rt.engine.target, rt.engine.drafter
    ids = depth_prompts(rt.tokenizer, depth, 1)[0]
    with torch.no_grad():
        _, feats = target(torch.tensor([ids]), torch.arange(len(ids)), target.new_cache(1, 8192), len(ids),
                          capture=drafter.cfg.target_layer_ids, logits="last")
    return feats[0].float(), drafter


def hadamard(n):
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5

def rot(v, n):
    H = hadamard(n)
    return (v.reshape(-1, n) @ H).reshape(v.shape)

def err(fmt, scale, n=0):
    f = row_format(fmt)
    v = x * scale
    if n: v = rot(v, n)
    y = f.decode(f.encode(v))
    if n: y = rot(y, n)
    y = y / scale
    return round(float(((y - x) @ weight.T).norm() / (x @ weight.T).norm()), 4)

if __name__ == "__main__":
    x, drafter = depth_taps(int(sys.argv[1]))
    weight = drafter.fc.weight.float()
    s = storage_scale(drafter.fc.weight)
    one = torch.ones_like(s)
    rec = {"tokens": x.shape[0]}
    for fmt in ("q4_0", "q8_0"):
        rec[fmt] = {"scaled": err(fmt, s), **{f"scaled+H{n}": err(fmt, s, n) for n in (32, 64)}, "unscaled+H32": err(fmt, one, 32)}
    print(json.dumps(rec))
