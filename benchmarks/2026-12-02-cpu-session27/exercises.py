"""Exercises the target writes itself, as "complete" requests: are they drafted like HumanEval?

The target (the embedded SmolLM2-135M-Instruct) is asked, sampled, for a new Python exercise on a topic:
a function signature and a docstring with examples. Each answer's first function that parses with a
docstring gives its header (signature + docstring), which becomes a "complete" request worded like
bench accept's HumanEval ones. The shipped drafter's AL (greedy, 128 new tokens, CPU) is then measured
on those, on HumanEval's first prompts, and on the data's write and doctest requests (train-drafter
generate's, --seed 19 --function-offset 2).
The logged run had its own copies of TOPICS, REQUEST and first_header, which train/exercises.py now
holds (the same text and parse).
Usage: python3 exercises.py [COUNT] (CPU; prints lines of JSON, the last one the summary)"""

import json
import sys
import time

from deepflash.bench.accept import measure
from deepflash.bench.prompts import humaneval_messages
from deepflash.engine import Engine
from deepflash.runtime import EngineConfig, load_runtime
from deepflash.sampling import SamplingParams
from deepflash.train.datagen import generate_batch
from deepflash.train.exercises import REQUEST, TOPICS, first_header
from deepflash.train.prompts import SHORT_TASKS, training_tasks


def main():
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    rt = load_runtime(EngineConfig(device="cpu"))
    tok, target = rt.tokenizer, rt.target
    asks = [tok.chat([{"role": "user", "content": REQUEST.format(topic=TOPICS[i % len(TOPICS)])}])
            for i in range(3 * count)]
    began = time.perf_counter()
    replies = generate_batch(target, asks, 220, tok.stop_ids(target.cfg.eos_token_ids),
                             SamplingParams(temperature=0.8, seed=0).validated(), list(range(len(asks))),
                             cuda_graphs=False)
    headers = list(dict.fromkeys(h for h in (first_header(tok.hf.decode(r)) for r in replies) if h))
    print(json.dumps({"asked": len(asks), "headers": len(headers), "seconds": round(time.perf_counter() - began, 1),
                      "examples": headers[:3]}))
    tasks = training_tasks(4 * count, 0.0, 19, doctest_fraction=0.25, write_fraction=0.25, function_offset=2,
                           workers=2)
    sets = {
        "exercises": [tok.chat([{"role": "user", "content": SHORT_TASKS["complete"].format(header=h)}])
                      for h in headers[:count]],
        "humaneval": [tok.chat(m) for m in humaneval_messages(count)],
        "write": [tok.chat(t.messages) for t in tasks if t.kind == "write"][:count],
        "doctest": [tok.chat(t.messages) for t in tasks if t.kind == "complete_doctest"][:count],
    }
    engine = Engine(target, tok, rt.drafter, spec="on")
    summary = {}
    for name, prompts in sets.items():
        stats, _ = measure(engine, prompts, SamplingParams(max_new_tokens=128), warm_up=False)
        summary[name] = {"prompts": len(prompts), "al": round(stats["acceptance_length"], 3)}
        print(json.dumps({name: summary[name]}), flush=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
