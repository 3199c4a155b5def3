"""What the speculation controller sees: per step kind, the host time of its launch and the time the
engine records for it (collect to collect; None when untimed), on the embedded pair and a few HumanEval
prompts, for spec off (plain steps), on and auto. Ends with one JSON line."""

import argparse
import json
from collections import defaultdict
from statistics import mean

from deepflash.bench.prompts import humaneval_messages
from deepflash.engine.config import EngineConfig
from deepflash.engine.engine import Engine
from deepflash.engine.runtime import load_runtime
from deepflash.engine.sampling import SamplingParams


def step_times(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    launches, recorded = defaultdict(list), defaultdict(list)
    launch = engine._launch

    def timed_launch(*args):
        launched = launch(*args)
        launches[launched.kind].append(launched.launch_s)
        return launched

    engine._launch = timed_launch
    for kind in ("spec", "plain"):
        record = getattr(engine.controller, f"record_{kind}")

        def spy(*args, kind=kind, record=record):
            recorded[kind].append(args[-2])  # (..., seconds, region)
            record(*args)
        setattr(engine.controller, f"record_{kind}", spy)
    for ids in prompts:  # the first pass captures the graphs
        engine.complete(ids, params)
    launches.clear(), recorded.clear()
    for ids in prompts:
        engine.complete(ids, params)
    out = {}
    for kind, seconds in launches.items():
        timed = [s for s in recorded[kind] if s is not None]
        out[kind] = {"steps": len(seconds), "launch_us": 1e6 * mean(seconds),
                     "recorded_us": 1e6 * mean(timed) if timed else None, "untimed": len(recorded[kind]) - len(timed)}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    rt = load_runtime(EngineConfig(device=args.device))
    prompts = [rt.tokenizer.chat(m) for m in humaneval_messages(args.prompts)]
    params = SamplingParams(max_new_tokens=128)
    ctx = rt.engine.max_ctx
    record = {}
    for spec in ("off", "on", "auto"):  # off: plain steps (capturing features), timed as the others
        engine = Engine(rt.target, rt.tokenizer, rt.drafter, max_ctx=ctx, spec=spec)
        record[f"spec {spec}"] = step_times(engine, prompts, params)
        print(f"spec {spec}", json.dumps(record[f"spec {spec}"]))
    if args.out:
        open(args.out, "w").write(json.dumps(record, indent=2))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
