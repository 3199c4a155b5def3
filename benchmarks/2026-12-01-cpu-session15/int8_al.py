"""CPU: HumanEval AL (greedy) of the shipped drafter as shipped (bf16) and with its matrices stored as
int8 with one scale per output row (rounded back to the same dtype at load)."""
import copy, json, sys, time
import torch
from deepflash.bench.prompts import humaneval_messages
from deepflash.config import EngineConfig
from deepflash.engine import Engine
from deepflash.runtime import load_runtime
from deepflash.sampling import SamplingParams

torch.set_num_threads(2)
count, new = int(sys.argv[1]), int(sys.argv[2])
rt = load_runtime(EngineConfig(device="cpu", spec="on"))
prompts = [rt.tokenizer.chat(m) for m in humaneval_messages(count)]

def int8_rows(w):
    scale = w.abs().amax(1, keepdim=True).float() / 127
    return ((w.float() / scale).round().clamp(-127, 127) * scale).to(w.dtype)

quant = copy.deepcopy(rt.engine.drafter)
with torch.no_grad():
    err = []
    for name, p in quant.named_parameters():
        if p.dim() == 2:
            q = int8_rows(p)
            err.append(float((q - p).norm() / p.norm()))
            p.copy_(q)
print("rel err per matrix max", max(err), "mean", sum(err)/len(err))
out = {}
for name, d in (("bf16", rt.engine.drafter), ("int8 rows", quant)):
    engine = Engine(rt.engine.target, rt.tokenizer, d, spec="on")
    steps = committed = 0
    t = time.time()
    for p in prompts:
        r = engine.complete(p, SamplingParams(max_new_tokens=new))
        steps += r.spec.steps; committed += r.spec.committed
    out[name] = round(committed / steps, 4)
    print(name, out[name], f"{time.time() - t:.0f}s", flush=True)
print(json.dumps({"prompts": count, "max_new_tokens": new, "al": out}))
