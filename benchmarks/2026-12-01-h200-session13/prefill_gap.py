"""Why bench speed's prefill with a drafter costs more than plain's: the prefill after a decode, as the
bench runs it, with host time split into the target forward and the drafter's part (_commit), with and
without garbage collection and with a sync before each request."""
import gc, json, sys, time
import torch
sys.path.insert(0, "scripts/gpu")  # profile_step; run from the repository root
from profile_step import SMOLLM2, sibling
from deepflash.bench.speed import random_engine
from deepflash.drafter import load_drafter
from deepflash.runtime import DEFAULT_DRAFTER
from deepflash.sampling import SamplingParams
from deepflash import spec

host = {"commit": 0.0, "gc": 0.0}
orig_commit = spec.Steps._commit
began = [0.0]
def on_gc(phase, info):  # host time inside garbage collections
    if phase == "start":
        began[0] = time.perf_counter()
    else:
        host["gc"] += time.perf_counter() - began[0]
gc.callbacks.append(on_gc)
def commit(self, *a):
    t = time.perf_counter(); orig_commit(self, *a); host["commit"] += time.perf_counter() - t
spec.Steps._commit = commit

dev = "cuda" if torch.cuda.is_available() else "cpu"
lengths = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "170,5849").split(",")]
new = int(sys.argv[2]) if len(sys.argv) > 2 else 128
base = random_engine(SMOLLM2, dev)
drafter = load_drafter(DEFAULT_DRAFTER, base.device, base.target.dtype)
engines = {"plain": sibling(base, max_ctx=8192), "spec on": sibling(base, drafter, spec="on", max_ctx=8192)}
params = SamplingParams(max_new_tokens=new)
out = {}
for variant in ("as bench", "gc off", "sync first"):
    for length in lengths:
        prompt = [100 + i % 40000 for i in range(length)]
        for name, e in engines.items():
            e.complete(prompt, params)
            runs = []
            for _ in range(4):
                if variant == "sync first" and dev == "cuda": torch.cuda.synchronize()
                if variant == "gc off": gc.disable()
                host["commit"] = host["gc"] = 0.0
                r = e.complete(prompt, params)
                gc.enable()
                runs.append((round(1e3 * r.prefill_s, 2), round(1e3 * host["commit"], 2), round(1e3 * host["gc"], 2)))
            out[f"{variant} | {length} | {name}"] = runs
            print(f"{variant:10s} {length:5d} {name:8s} prefill ms, commit host ms, gc ms (whole request): {runs}", flush=True)
print(json.dumps(out))
