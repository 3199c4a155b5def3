"""Where the drafter's steps stop on the target's answers: AL of the spec steps (the shipped drafter,
greedy, 128 tokens, CPU float32) by where each step starts in the answer: before its first code fence,
inside the first code block, or after it (prose, further blocks). Three request sets of N each:
HumanEval's first N, "complete" requests for library functions with doctest examples (doctest_tasks)
and "write" requests (write_tasks), the library ones from site-packages in a seeded order.
Usage: python3 regions_al.py [N]. Ends with one JSON line."""
import json
import random
import sys

from deepflash.bench.common import embedded_pair
from deepflash.bench.prompts import humaneval_messages
from deepflash.drafter import load_drafter
from deepflash.engine import Engine
from deepflash.runtime import DEFAULT_DRAFTER
from deepflash.sampling import SamplingParams
from deepflash.train.prompts import doctest_tasks, site_package_files, write_tasks

N = int(sys.argv[1]) if len(sys.argv) > 1 else 24


def library(make, n: int) -> list[list[dict]]:
    files = site_package_files()
    random.Random(0).shuffle(files)
    out = []
    for path in files:
        out += [t.messages for t in make(path, path.read_text(errors="replace"))][:1]  # one per file
        if len(out) == n:
            break
    return out


def regions(engine, tok, requests) -> dict:
    steps: dict[str, list[int]] = {}
    for messages in requests:
        r = engine.complete(tok.chat(messages), SamplingParams(max_new_tokens=128))
        at = 1  # the prefill commits the first token
        for committed in r.spec.trace:
            fences = tok.decode(r.token_ids[:at]).count("```")
            where = "before" if fences == 0 else "code" if fences == 1 else "after"
            steps.setdefault(where, []).append(committed)
            at += committed
    return {where: {"steps": len(c), "al": round(sum(c) / len(c), 3)} for where, c in steps.items()}


target, tok = embedded_pair("cpu")
engine = Engine(target, tok, load_drafter(str(DEFAULT_DRAFTER), target.device, target.dtype), spec="on")
sets = {"humaneval": humaneval_messages(N), "complete with doctests": library(doctest_tasks, N),
        "write": library(write_tasks, N)}
record = {}
for name, requests in sets.items():
    record[name] = regions(engine, tok, requests)
    print(name, record[name], flush=True)
print(json.dumps(record))
