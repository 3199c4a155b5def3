"""Does the prompt's seam decide whether the embedded target copies? recall_task's prompts (a module's opening,
then a prefix of it again, both cut at a line end) tokenized as text, as datagen does, against the same cut
points joined as tokens, as bench accept's recall prompts are (the first copy's own tokens, ending mid-stream):
tokenized as text, the prompt's closing newline is a token of its own where the first copy has it merged with
the next line's indent, so the last token never occurred in the first copy. Greedy continuations on the CPU;
the share of their 6-grams found only in the first copy (mean over the prompts) (the source, not the repeat) and only beyond 4096.
Usage: recall_seam.py COUNT NEW_TOKENS [SEED] (27 by default)."""
import json, random, sys
from deepflash.bench.accept import measure
from deepflash.config import EngineConfig
from deepflash.engine import Engine
from deepflash.reach import copied_from_beyond
from deepflash.runtime import load_runtime
from deepflash.sampling import SamplingParams
from deepflash.train.prompts import recall_task, site_package_files

count, new = int(sys.argv[1]), int(sys.argv[2])
seed = int(sys.argv[3]) if len(sys.argv) > 3 else 27
rt = load_runtime(EngineConfig(device="cpu", no_draft=True))
rng, files = random.Random(seed), site_package_files()
random.Random(seed).shuffle(files)
as_text, as_tokens, repeats = [], [], []
for path in files:
    task = recall_task(rng, path, path.read_text(errors="replace"), 26_000)
    if task is None:
        continue
    first, again = task.text, task.text[: task.again]  # (the run split the joined text: the same cut)
    ids, first_ids = rt.tokenizer.encode(first + again), rt.tokenizer.encode(first)
    repeat = len(ids) - len(first_ids) - 1  # the repeat's tokens less its closing newline
    if len(ids) > 7680 or len(first_ids) <= 4096:  # prompts whose source lies beyond the cap, as datagen keeps them
        continue
    as_text.append(ids)
    as_tokens.append(first_ids + first_ids[:repeat])
    repeats.append(repeat)
    if len(as_text) == count:
        break
engine = Engine(rt.target, rt.tokenizer)
rows = {}
for name, prompts in (("text", as_text), ("tokens", as_tokens)):
    _, outs = measure(engine, prompts, SamplingParams(max_new_tokens=new), warm_up=False)
    per_prompt = [round(copied_from_beyond([p], [o], r), 3) for p, o, r in zip(prompts, outs, repeats)]
    rows[name] = {"first_copy_only": round(sum(per_prompt) / len(per_prompt), 3), "per_prompt_first_copy": per_prompt,
                  "beyond_4096": round(copied_from_beyond(prompts, outs, 4096), 3),
                  "in_prompt": round(copied_from_beyond(prompts, outs, 0), 3)}
    print(name, rows[name], flush=True)
print(json.dumps({"prompts": len(as_text), "openings": [len(p) - r for p, r in zip(as_tokens, repeats)],
                  "repeats": repeats, "new_tokens": new} | rows))
