"""AL by feature storage dtype, or feature window cap, on more deep prompts than bench accept's five (the
twenty-ninth GPU session measured q8_0 -3.4% and q4_0 -3.6% against f32 at 7.5K on five prompts, the session
before -1.9% for q4_0).
The embedded pair on the CPU (float32), the shipped drafter, greedy, 128 new tokens, bench accept's depth
prompts (this machine's standard library) and its paired interval.
Usage: python3 dtype_depth.py DEPTH COUNT [CONFIGS] (CONFIGS: a comma list of f32, q8_0, q4_0 and capN, a
feature window of N with f32 storage; default f32,q8_0,q4_0; the first is the baseline; prints a line per
config, then one JSON line)."""

import json
import sys
import time

from deepflash.bench.accept import measure, paired_change
from deepflash.bench.prompts import depth_prompts
from deepflash.engine import Engine
from deepflash.runtime import EngineConfig, load_runtime
from deepflash.sampling import SamplingParams


if __name__ == "__main__":
    depth, count = int(sys.argv[1]), int(sys.argv[2])
    configs = (sys.argv[3] if len(sys.argv) > 3 else "f32,q8_0,q4_0").split(",")
    rt = load_runtime(EngineConfig(device="cpu"))
    prompts = depth_prompts(rt.tokenizer, depth, count)
    params = SamplingParams(max_new_tokens=128)
    rows, began = {}, time.perf_counter()
    for config in configs:
        cap = int(config[3:]) if config.startswith("cap") else None
        engine = Engine(rt.target, rt.tokenizer, rt.drafter, spec="on", feature_dtype="f32" if cap else config,
                        feat_ring_cap=cap)
        rows[config] = measure(engine, prompts, params, warm_up=False)[0]
        if config != configs[0]:
            rows[config]["vs"] = paired_change(rows[configs[0]], rows[config])
        print(config, rows[config]["acceptance_length"], rows[config].get("vs"),
              rows[config]["per_prompt_steps_committed"], flush=True)
    print(json.dumps({"depth": depth, "prompts": [len(p) for p in prompts],
                      "seconds": round(time.perf_counter() - began),
                      **{f: {"al": r["acceptance_length"], "vs": r.get("vs"),
                             "per_prompt_steps_committed": r["per_prompt_steps_committed"]} for f, r in rows.items()}}))
