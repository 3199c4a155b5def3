"""Simulated --spec auto, before and after the fourteenth session's controller change, driven as the
engine drives it (two steps queued), on requests whose spec steps commit tokens drawn from a measured
histogram (bench accept's HumanEval T=0, all 164 prompts). A spec step costs `ratio` plain steps, and
one right after plain steps 0.4 more: the drafter's catch-up (439 us against a ~1 ms plain step on the
H200, BENCHMARKS.md ninth session).
- before (argv[1]: the controller of an older commit, e.g. `git show 87a823e:deepflash/controller.py`):
  costs per request; the engine timed the catch-up into that spec step.
- now: costs per context region, kept across requests and after a failed verdict; the catch-up step is
  recorded untimed.
Prints auto's tok/s relative to `on` for two cost ratios, and a never-matching drafter's relative to
plain over 6 requests (bench speed's count), for 128- and 52-token requests. Ends with one JSON line.
Usage: controller_sim.py OLD_CONTROLLER.py ACCEPT.json"""
import importlib.util
import json
import random
import sys
from collections import deque

from deepflash.controller import SpecController as New

CATCH_UP = 0.4
REGION = 256


def load_old(path: str):
    spec = importlib.util.spec_from_file_location("old_controller", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.SpecController


def run(controller, histogram: list[int], ratio: float, requests: int, tokens: int, now: bool) -> float:
    """Tokens per plain-step time (plain decode = 1.0)."""
    rng = random.Random(0)
    population = [a + 1 for a, n in enumerate(histogram) for _ in range(n)]
    total_tokens = total_time = 0.0
    after_plain = False
    region = (REGION,) if now else ()
    for _ in range(requests):
        controller.new_request()
        done, pending = 0, deque()
        while done < tokens:
            while len(pending) < 2:
                pending.append(controller.use_spec(*region))
            spec = pending.popleft()
            if spec:
                got = min(rng.choice(population), tokens - done)
                seconds = ratio + CATCH_UP * after_plain
                controller.record_spec(got, None if now and after_plain else seconds, *region)
                total_time += seconds
            else:
                got = 1
                controller.record_plain(1.0, *region)
                total_time += 1.0
            after_plain = not spec
            done += got
        total_tokens += done
    return total_tokens / total_time


if __name__ == "__main__":
    Old = load_old(sys.argv[1])
    hist = json.load(open(sys.argv[2]))["humaneval"]["T=0"]["acceptance_histogram"]
    never = [1] + [0] * 15
    out = {"histogram": hist}
    for tokens in (128, 52):
        row = {}
        for ratio in (2.05, 1.6):
            on = run(New("on"), hist, ratio, 300, tokens, True)
            row[f"auto/on, ratio {ratio}, before"] = run(Old("auto"), hist, ratio, 300, tokens, False) / on
            row[f"auto/on, ratio {ratio}, now"] = run(New("auto"), hist, ratio, 300, tokens, True) / on
        row["never matching/plain, before"] = run(Old("auto"), never, 2.05, 6, tokens, False)
        row["never matching/plain, now"] = run(New("auto"), never, 2.05, 6, tokens, True)
        out[f"{tokens} tokens"] = {k: round(v, 3) for k, v in row.items()}
        print(tokens, out[f"{tokens} tokens"])
    print(json.dumps(out))
