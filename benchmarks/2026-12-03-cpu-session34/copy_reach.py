"""How far back the drafter follows the target's copying: for bench accept's recall and depth prompts (this
Python's modules, rebuilt as bench accept builds them), the target's greedy outputs (plain decode: the same
tokens the speculative runs committed), and the full-window traces an accept JSON holds, the speculative steps
binned by how far back the text they begin in last occurs (reach.far_steps at several windows: a bin is the
difference of two), with their count and AL. Usage: copy_reach.py ACCEPT_JSON... (depth 1024 and recall 7500:4500,
--per-depth as they ran, 128 new tokens)."""
import json, sys
from deepflash.bench.prompts import depth_prompts, recall_prompts
from deepflash.config import EngineConfig
from deepflash.engine import Engine
from deepflash.reach import far_steps
from deepflash.runtime import load_runtime
from deepflash.sampling import SamplingParams

EDGES = [0, 64, 256, 1024, 2048, 4096]

records = [json.load(open(path)) for path in sys.argv[1:]]
count = records[0]["depth"]["full"]["1024"]["prompts"]
rt = load_runtime(EngineConfig(device="cpu", no_draft=True))
engine, params = Engine(rt.target, rt.tokenizer), SamplingParams(max_new_tokens=128)
sets = {"depth 1024": ("depth", "1024", depth_prompts(rt.tokenizer, 1024, count)),
        "recall 7500:4500": ("recall", "7500", recall_prompts(rt.tokenizer, 7500, 4500, count))}
for label, (part, key, prompts) in sets.items():
    outputs = [engine.complete(ids, params).token_ids for ids in prompts]
    for path, record in zip(sys.argv[1:], records):
        traces = record[part]["full"][key]["per_prompt_trace"]
        total_steps = sum(len(t) for t in traces)
        total = sum(sum(t) for t in traces)
        beyond = {}  # window -> (steps, committed) that begin in text last seen at least that far back
        for window in EDGES:
            commits = [c for ids, out, t in zip(prompts, outputs, traces) for c in far_steps(ids, out, t, window)]
            beyond[window] = (len(commits), sum(commits))
        rows = [("not in the context", total_steps - beyond[0][0], total - beyond[0][1])]
        for low, high in zip(EDGES, EDGES[1:] + [None]):
            steps, committed = beyond[low]
            if high is not None:
                steps, committed = steps - beyond[high][0], committed - beyond[high][1]
            rows.append((f"{low}-{high or 'end'} back", steps, committed))
        print(f"{label}, {record['draft']} ({path}): {total_steps} steps, AL {total / total_steps:.3f}")
        for name, steps, committed in rows:
            print(f"  {name:>20}: {steps:4d} steps, AL {committed / steps if steps else float('nan'):.2f}")
