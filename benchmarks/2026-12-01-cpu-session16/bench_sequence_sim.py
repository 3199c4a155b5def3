"""Simulated --spec auto on bench speed's sequence of requests: one engine (one controller) serves five
HumanEval requests (91, 128, 52, 83 and 102 tokens; context region 256) and then the 5849-token prompt
(128 tokens; region 8192), as the sixteenth session's bench speed did. Spec steps commit tokens drawn
from the fifteenth session's bench accept histograms (HumanEval T=0; depth 7.5K for the long prompt)
and cost `ratio` plain steps: 1.58 on the short prompts (step_times.py, sixteenth session) and 2.7 on
the long one (its measured on / plain tok/s at the measured AL). Driven as the engine drives it
(controller_sim.run of the fourteenth session: two steps queued, catch-up steps untimed). Prints auto's
tok/s over on's for the short requests and for the long one, averaged over 400 engine lives, a
never-matching drafter's against plain, and losing drafters' (controller_sim.run), for the default
bursts and for shorter first ones. Ends with one JSON line.
Usage (from the repository root): python3 benchmarks/2026-12-01-cpu-session16/bench_sequence_sim.py"""
import json
import random
import sys
from collections import deque

from deepflash.controller import SpecController

CATCH_UP = 0.4
accept = json.load(open("benchmarks/2026-12-01-h200-session15/accept.json"))
HUMANEVAL = accept["humaneval"]["T=0"]["acceptance_histogram"]
DEPTH = accept["depth"]["full"]["7500"]["acceptance_histogram"]
NEVER = [1] + [0] * 15


def requests(short: list[int], long: list[int]) -> list[tuple]:
    """(histogram, cost ratio, region, tokens) per request, in bench speed's order."""
    return [(short, 1.58, 256, n) for n in (91, 128, 52, 83, 102)] + [(long, 2.7, 8192, 128)]


def serve(controller: SpecController, sequence: list[tuple], rng: random.Random) -> list[tuple[float, float]]:
    """(tokens, time in plain steps) per request."""
    out = []
    after_plain = False
    for histogram, ratio, region, tokens in sequence:
        population = [a + 1 for a, n in enumerate(histogram) for _ in range(n)]
        controller.new_request()
        done, time, pending = 0, 0.0, deque()
        while done < tokens:
            while len(pending) < 2:
                pending.append(controller.use_spec(region))
            if pending.popleft():
                got = min(rng.choice(population), tokens - done)
                seconds = ratio + CATCH_UP * after_plain
                controller.record_spec(got, None if after_plain else seconds, region)
                after_plain = False
            else:
                got, seconds = 1, 1.0
                controller.record_plain(1.0, region)
                after_plain = True
            done += got
            time += seconds
        out.append((done, time))
    return out


def rates(make, sequence: list[tuple], lives: int) -> tuple[float, float]:
    """tok/s (plain = 1) of the five short requests together and of the long one, over `lives` engines
    (controllers from make())."""
    short = [0.0, 0.0]
    long = [0.0, 0.0]
    for life in range(lives):
        served = serve(make(), sequence, random.Random(life))
        for tokens, time in served[:-1]:
            short[0] += tokens
            short[1] += time
        long[0] += served[-1][0]
        long[1] += served[-1][1]
    return short[0] / short[1], long[0] / long[1]


if __name__ == "__main__":
    sys.path.insert(0, "benchmarks/2026-12-01-cpu-session14")
    from controller_sim import run

    paying, never = requests(HUMANEVAL, DEPTH), requests(NEVER, NEVER)
    short_on, long_on = rates(lambda: SpecController("on"), paying, 400)
    record = {}
    # the default bursts (40 plain tokens, doubled per failed probe up to 8x) and shorter first bursts
    for label, settings in [("burst 40, up to 8x", {}), ("burst 8, up to 40x", dict(burst=8, max_backoff=40))]:
        make = lambda: SpecController("auto", **settings)  # noqa: E731
        short_auto, long_auto = rates(make, paying, 400)
        never_short, never_long = rates(make, never, 50)
        row = {"auto/on short": short_auto / short_on, "auto/on long": long_auto / long_on,
               "never matching auto/plain short": never_short, "never matching auto/plain long": never_long}
        # losing drafters alone (controller_sim.run, 6 requests): auto against plain
        for name, histogram, ratio in [("HumanEval", HUMANEVAL, 3.0), ("depth", DEPTH, 3.6), ("depth", DEPTH, 4.0)]:
            row[f"losing {name}, ratio {ratio}: auto/plain"] = run(make(), histogram, ratio, 6, 128, True)
        record[label] = {k: round(v, 3) for k, v in row.items()}
        for k, v in record[label].items():
            print(f"{label}  {k}: {v}")
    print(json.dumps(record))
