"""Exercises the target writes itself, as "complete" requests: are they drafted like HumanEval?

train/exercises.py asks the target (the embedded SmolLM2-135M-Instruct), sampled, for new Python exercises
on topics; each answer's first function that parses with a docstring becomes a "complete" request worded
like bench accept's HumanEval ones. The shipped drafter's AL (greedy, 128 new tokens, CPU) is measured on
COUNT of those, on HumanEval's first COUNT prompts, and on the data's write and doctest requests (train-
drafter generate's, --seed 19 --function-offset 2), with a 95% bootstrap interval over prompts.
Usage: python3 exercises.py [COUNT] (CPU; prints lines of JSON, the last one the summary).
exercises-first.log is the first run (COUNT 32), by this script's earlier form in git history: topics
in turn instead of drawn, three asks per exercise wanted, no intervals."""

import json
import random
import sys
import time

from deepflash.bench.accept import measure
from deepflash.bench.prompts import humaneval_messages
from deepflash.engine import Engine
from deepflash.runtime import EngineConfig, load_runtime
from deepflash.sampling import SamplingParams
from deepflash.train.exercises import exercise_tasks
from deepflash.train.prompts import training_tasks


def interval(steps_committed: list[list[int]], resamples: int = 2000) -> list[float]:
    """95% bootstrap interval of committed / steps over the prompts."""
    rng = random.Random(0)
    values = []
    for _ in range(resamples):
        draw = [rng.choice(steps_committed) for _ in steps_committed]
        values.append(sum(c for _, c in draw) / sum(s for s, _ in draw))
    values.sort()
    return [round(values[int(0.025 * resamples)], 3), round(values[int(0.975 * resamples)], 3)]


def main():
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    rt = load_runtime(EngineConfig(device="cpu"))
    tok, target = rt.tokenizer, rt.target
    began = time.perf_counter()
    written = exercise_tasks(target, tok, count, seed=0)
    print(json.dumps({"exercises": len(written), "seconds": round(time.perf_counter() - began, 1),
                      "examples": [t.messages[0]["content"] for t in written[:3]]}), flush=True)
    tasks = training_tasks(4 * count, 0.0, 19, doctest_fraction=0.25, write_fraction=0.25, function_offset=2,
                           workers=2)
    sets = {
        "exercises": [tok.chat(t.messages) for t in written],
        "humaneval": [tok.chat(m) for m in humaneval_messages(count)],
        "write": [tok.chat(t.messages) for t in tasks if t.kind == "write"][:count],
        "doctest": [tok.chat(t.messages) for t in tasks if t.kind == "complete_doctest"][:count],
    }
    engine = Engine(target, tok, rt.drafter, spec="on")
    summary = {}
    for name, prompts in sets.items():
        stats, _ = measure(engine, prompts, SamplingParams(max_new_tokens=128), warm_up=False)
        summary[name] = {"prompts": len(prompts), "al": round(stats["acceptance_length"], 3),
                         "ci95": interval(stats["per_prompt_steps_committed"])}
        print(json.dumps({name: summary[name]}), flush=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
