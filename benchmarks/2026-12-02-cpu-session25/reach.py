"""How far back does the embedded target copy? Depth prompts (bench/prompts.py: a standard-library module,
then a request about a function defined near its start), answered by plain greedy decoding on the CPU
(128 tokens); for each phrasing, the share of the answer's 6-grams found in the prompt at all (window 0)
and only more than 2048 / 4096 tokens before its end (bench/accept.py's copied_from_beyond).

    python3 reach.py DEPTH COUNT VARIANTS    # VARIANTS: comma list of quote, rewrite, quote-prefill

quote-prefill is the quote request with the answer's first line given after the prompt ("```python\\ndef
NAME("), so that the target has only to go on copying."""
import json
import random
import re
import sys
import time

import torch

from deepflash.bench.accept import copied_from_beyond
from deepflash.bench.prompts import _fit
from deepflash.engine import Engine
from deepflash.runtime import EngineConfig, load_runtime
from deepflash.sampling import SamplingParams
from deepflash.train.prompts import stdlib_files

torch.set_num_threads(2)
depth, count, variants = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
rt = load_runtime(EngineConfig(device="cpu"))
tok, engine = rt.tokenizer, Engine(rt.target, rt.tokenizer)
files = stdlib_files()
random.Random(depth).shuffle(files)  # depth_prompts' order (seed 0 + depth)
results = {}
for variant in variants:
    kind = "rewrite" if variant == "rewrite" else "quote"
    prompts, outputs, began = [], [], time.time()
    for path in files:
        if len(prompts) == count:
            break
        ids = _fit(tok, path.read_text(errors="replace"), kind, depth)
        if ids is None:
            continue
        name = re.findall(r"`(\w+)`", tok.decode(ids[-80:]))[-1]
        if variant == "quote-prefill":
            ids = ids + tok.encode(f"```python\ndef {name}(")
        out = engine.complete(ids, SamplingParams(max_new_tokens=128)).token_ids
        prompts.append(ids)
        outputs.append(out)
        print(variant, path.name, len(ids), name, {w: round(copied_from_beyond([ids], [out], w), 3) for w in (0, 4096)},
              repr(tok.decode(out[:60])), flush=True)
    results[variant] = {str(w): round(copied_from_beyond(prompts, outputs, w), 4) for w in (0, 2048, 4096)}
    results[variant]["seconds"] = round(time.time() - began)
    print(variant, results[variant], flush=True)
print(json.dumps({"depth": depth, "prompts": count, "results": results}))
