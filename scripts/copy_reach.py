"""Does the target copy text from far back on bench accept's depth prompts? Greedy plain decoding of
the embedded target (or --model) on the depth prompts, then the share of each output's 6-grams found in
its prompt only beyond a window (reach.copied_from_beyond): if the target copies nothing from there, a
drafter capped at that window loses nothing there either. Runs on the CPU in minutes; ends with one
JSON line."""

import argparse
import json

from deepflash.bench.prompts import depth_prompts
from deepflash.drafter.reach import copied_from_beyond
from deepflash.engine.config import EngineConfig
from deepflash.engine.engine import Engine
from deepflash.engine.runtime import load_runtime
from deepflash.engine.sampling import SamplingParams


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--depth", type=int, default=7500)
    ap.add_argument("--per-depth", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--windows", default="4096,2048")
    args = ap.parse_args()
    rt = load_runtime(EngineConfig(model=args.model, device=args.device, draft=None))
    engine = Engine(rt.target, rt.tokenizer)
    prompts = depth_prompts(rt.tokenizer, args.depth, args.per_depth)
    outputs = [engine.complete(ids, SamplingParams(max_new_tokens=args.max_new_tokens)).token_ids for ids in prompts]
    record = {"depth": args.depth, "prompt_tokens": [len(ids) for ids in prompts],
              "copied_from_beyond": {w: [copied_from_beyond([ids], [out], int(w)) for ids, out in zip(prompts, outputs)]
                                     for w in args.windows.split(",")},
              "within_prompt": [copied_from_beyond([ids], [out], 0) for ids, out in zip(prompts, outputs)]}
    for ids, out in zip(prompts, outputs):
        print(f"{len(ids)}-token prompt -> {rt.tokenizer.decode(out)[:160]!r}")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
