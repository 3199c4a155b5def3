"""The embedded target's greedy continuations of bench accept's recall prompts (7500 tokens, source 4500 back)
in float32 and in bfloat16 on the CPU: the share of their 6-grams found only beyond 4096 tokens back."""
import json, sys
from deepflash.bench.accept import copied_from_beyond, measure
from deepflash.bench.prompts import recall_prompts
from deepflash.config import EngineConfig
from deepflash.engine import Engine
from deepflash.runtime import load_runtime
from deepflash.sampling import SamplingParams

count, new = int(sys.argv[1]), int(sys.argv[2])
rows = {}
for dtype in ("float32", "bfloat16"):
    rt = load_runtime(EngineConfig(device="cpu", dtype=dtype, no_draft=True))
    prompts = recall_prompts(rt.tokenizer, 7500, 4500, count)
    _, outs = measure(Engine(rt.target, rt.tokenizer), prompts, SamplingParams(max_new_tokens=new), warm_up=False)
    rows[dtype] = {"beyond_4096": copied_from_beyond(prompts, outs, 4096),
                   "per_prompt": [copied_from_beyond([p], [o], 4096) for p, o in zip(prompts, outs)],
                   "outputs": outs}
    print(dtype, rows[dtype]["beyond_4096"], rows[dtype]["per_prompt"], flush=True)
same = [sum(a == b for a, b in zip(x, y)) for x, y in zip(rows["float32"]["outputs"], rows["bfloat16"]["outputs"])]
first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(rows["float32"]["outputs"], rows["bfloat16"]["outputs"])]
print(json.dumps({d: {k: v for k, v in r.items() if k != "outputs"} for d, r in rows.items()} | {"first_difference": first_diff}))
