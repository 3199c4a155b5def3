"""Does the embedded target continue a repeated document from far back? Raw prompt: module tokens A[:n]
then A[:k] again; greedy 96 tokens; share matching A[k:k+96] token by token (prefix) and 6-gram reach."""
import random, sys, time, json
from deepflash.bench.accept import copied_from_beyond
from deepflash.bench.prompts import depth_prompts
from deepflash.config import EngineConfig
from deepflash.engine import Engine
from deepflash.runtime import load_runtime
from deepflash.sampling import SamplingParams
from deepflash.train.prompts import stdlib_files

first, again, count = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rt = load_runtime(EngineConfig(device="cpu", draft=None))
engine = Engine(rt.target, rt.tokenizer)
files = stdlib_files(); random.Random(0).shuffle(files)
done = 0
for f in files:
    ids = rt.tokenizer.encode(f.read_text(errors="replace"))
    if len(ids) < first + 100:
        continue
    a = ids[:first]
    prompt = a + a[:again]
    t = time.time()
    out = engine.complete(prompt, SamplingParams(max_new_tokens=96)).token_ids
    ref = a[again:again + 96]
    prefix = next((i for i, (x, y) in enumerate(zip(out, ref)) if x != y), min(len(out), len(ref)))
    same = sum(x == y for x, y in zip(out, ref))
    print(json.dumps({"file": f.name, "prompt": len(prompt), "distance": first, "matching_prefix": prefix, "same_pos": same,
                      "beyond4096": copied_from_beyond([prompt], [out], 4096), "s": round(time.time() - t, 1)}), flush=True)
    done += 1
    if done == count:
        break
