"""Simulated --spec auto with the shortfall's tolerance fixed at 8 tokens (spread 0) and with at least 4
standard deviations of the tokens a spec step commits (spread 4, the default), driven as the engine
drives it (controller_sim.run of the fourteenth session: two steps queued, catch-up steps untimed).
Spec steps commit tokens drawn from the fifteenth session's bench accept histograms: HumanEval T=0 and
T=1 (164 prompts) and the 7.5K-token depth prompts (full window). A spec step costs `ratio` plain steps.
Paying drafters: auto's tok/s over `on`'s (200 requests of 128 tokens). Losing drafters and a
never-matching one: auto's over plain's (6 requests, bench speed's count).
Usage (from the repository root): python3 benchmarks/2026-12-01-cpu-session15/tolerance_sim.py
Ends with one JSON line."""
import json
import sys

sys.path.insert(0, "benchmarks/2026-12-01-cpu-session14")
from controller_sim import run  # noqa: E402

from deepflash.controller import SpecController  # noqa: E402

accept = json.load(open("benchmarks/2026-12-01-h200-session15/accept.json"))
HISTOGRAMS = {"HumanEval T=0": accept["humaneval"]["T=0"]["acceptance_histogram"],
              "HumanEval T=1": accept["humaneval"]["T=1"]["acceptance_histogram"],
              "depth 7.5K": accept["depth"]["full"]["7500"]["acceptance_histogram"],
              "never matching": [1] + [0] * 15}
PAYING = [("HumanEval T=0", 2.1), ("HumanEval T=0", 1.6), ("HumanEval T=1", 1.5), ("depth 7.5K", 2.7)]
LOSING = [("HumanEval T=0", 3.0), ("depth 7.5K", 3.6), ("depth 7.5K", 4.0), ("HumanEval T=1", 2.0),
          ("never matching", 2.05)]

out = {}
for spread in (0.0, 4.0):
    row = {}
    for name, ratio in PAYING:
        hist = HISTOGRAMS[name]
        on = run(SpecController("on"), hist, ratio, 200, 128, True)
        row[f"{name}, ratio {ratio}: auto / on"] = run(SpecController("auto", spread=spread), hist, ratio, 200, 128, True) / on
    for name, ratio in LOSING:
        hist = HISTOGRAMS[name]
        row[f"{name}, ratio {ratio}: auto / plain"] = run(SpecController("auto", spread=spread), hist, ratio, 6, 128, True)
        row[f"{name}, ratio {ratio}: on / plain"] = run(SpecController("on"), hist, ratio, 6, 128, True)
    out[f"spread {spread}"] = {k: round(v, 3) for k, v in row.items()}
    for k, v in out[f"spread {spread}"].items():
        print(f"spread {spread}  {k}: {v}")
print(json.dumps(out))
