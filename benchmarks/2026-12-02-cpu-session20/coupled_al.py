"""Sampled (T=1) acceptance with drafts chosen three ways, embedded pair on the CPU, 10 HumanEval prompts,
128 tokens, seed 1 (BENCHMARKS.md, "Drafts sampled with the target's noise"). Ran on a working tree
(not committed) where Steps.draft passed the request's params and seed buffer to drafter.propose, whose
drafts were sampling.choose(drafter logits, q_pos[1:], params, seed) in place of their argmax, and the
engine keyed the draft graph by the sampling settings too. This script compares those drafts with argmax drafts (propose called without the params)."""
import json, sys
import torch
from deepflash import spec as spec_module
from deepflash.bench.accept import measure
from deepflash.bench.common import embedded_pair
from deepflash.bench.prompts import humaneval_messages
from deepflash.drafter import load_drafter
from deepflash.engine import Engine
from deepflash.sampling import SamplingParams

n = int(sys.argv[1])
target, tok = embedded_pair("cpu")
prompts = [tok.chat(m) for m in humaneval_messages(n)]
drafter = load_drafter("deepflash/drafters/smollm2-135m", target.device, target.dtype)
out = {}
for temp in (1.0,):
    params = SamplingParams(max_new_tokens=128, temperature=temp, seed=1)
    plain, plain_outputs = measure(Engine(target, tok), prompts, params, warm_up=False)
    coupled = spec_module.propose
    for arm in ("coupled", "argmax drafts"):
        spec_module.propose = coupled if arm == "coupled" else (lambda *a, **k: coupled(*a[:6]))
        r, outputs = measure(Engine(target, tok, drafter, spec="on"), prompts, params, warm_up=False)
        out[f"T={temp} {arm}"] = {"acceptance_length": r["acceptance_length"],
                                  "per_position": r.get("per_position_acceptance", [])[:4],
                                  "same_as_plain": sum(a == b for a, b in zip(outputs, plain_outputs)), "prompts": n}
        print(f"T={temp} {arm}", json.dumps(out[f"T={temp} {arm}"]), flush=True)
    spec_module.propose = coupled
print(json.dumps(out))
