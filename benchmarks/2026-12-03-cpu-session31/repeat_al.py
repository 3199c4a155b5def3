"""AL with the full feature window vs a 4096 cap on repeated-document prompts: module tokens A[:first]
then A[:again] again (raw, no chat), so the continuation's source lies `first` tokens back."""
import random, sys, json
from deepflash.bench.accept import copied_from_beyond, measure, paired_change
from deepflash.config import EngineConfig
from deepflash.engine import Engine
from deepflash.runtime import load_runtime
from deepflash.sampling import SamplingParams
from deepflash.train.prompts import stdlib_files

first, again, count = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rt = load_runtime(EngineConfig(device="cpu"))
files = stdlib_files(); random.Random(0).shuffle(files)
prompts = []
for f in files:
    ids = rt.tokenizer.encode(f.read_text(errors="replace"))
    if len(ids) >= first + 100:
        prompts.append(ids[:first] + ids[:again])
    if len(prompts) == count:
        break
params = SamplingParams(max_new_tokens=96)
rec = {}
for name, cap in ((("full", None), ("4096", 4096)) if len(sys.argv) < 5 else (("full", None),)):
    stats, outs = measure(Engine(rt.target, rt.tokenizer, rt.drafter, spec="on", feat_ring_cap=cap), prompts, params, warm_up=False)
    rec[name] = stats
    print(name, stats["acceptance_length"], stats["per_prompt_steps_committed"], stats["per_position_acceptance"][:6], flush=True)
if "4096" not in rec: sys.exit()
rec["4096"]["vs"] = paired_change(rec["full"], rec["4096"])
rec["copied_from_beyond_4096"] = copied_from_beyond(prompts, outs, 4096)
print(json.dumps({"first": first, "again": again, "full": rec["full"]["acceptance_length"], "4096": rec["4096"]["acceptance_length"],
                  "vs": rec["4096"]["vs"], "copied_from_beyond_4096": rec["copied_from_beyond_4096"]}))
