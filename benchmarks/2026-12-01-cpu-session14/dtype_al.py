"""CPU: AL per feature dtype with and without the storage scale, on depth prompts (greedy)."""
import json, sys, time
import torch
import deepflash.engine as eng
from deepflash.config import EngineConfig
from deepflash.runtime import load_runtime
from deepflash.bench.prompts import depth_prompts
from deepflash.sampling import SamplingParams
from deepflash.features import storage_scale

torch.set_num_threads(2)
depth, count, new = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rt = load_runtime(EngineConfig(device="cpu", spec="on"))
prompts = depth_prompts(rt.tokenizer, depth, count)
out = {}
for name, fmt, scaled in [("f32", "f32", True), ("q4_0", "q4_0", False), ("q4_0 scaled", "q4_0", True),
                          ("q8_0", "q8_0", False), ("q8_0 scaled", "q8_0", True)]:
    eng.storage_scale = storage_scale if scaled else (lambda w: torch.ones(w.shape[1]))
    engine = eng.Engine(rt.engine.target, rt.tokenizer, rt.engine.drafter, spec="on", feature_dtype=fmt)
    steps = committed = 0
    t = time.time()
    for p in prompts:
        r = engine.complete(p, SamplingParams(max_new_tokens=new))
        steps += r.spec.steps
        committed += r.spec.committed
    out[name] = round(committed / steps, 4)
    print(name, out[name], f"{time.time() - t:.0f}s", flush=True)
print(json.dumps({"depth": depth, "prompts": count, "max_new_tokens": new, "al": out}))
