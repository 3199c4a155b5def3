"""A/B of drafters on the embedded pair: HumanEval prompts, greedy, 128 tokens, spec on, the drafters in turn,
twice, so that run-to-run drift shows; each runs its prompts once untimed first. Per drafter and round: AL,
tok/s, the speculative steps' device seconds, and outputs equal to plain decoding's. pick_drafter.py picks by AL (its
tok/s include graph captures): this says what a drafter with more work per draft (wider MLPs, more layers)
costs in tok/s against what it accepts more.
Usage: python3 scripts/gpu/drafters_ab.py DRAFTER [DRAFTER ...] [--prompts 24] [--out F]
Prints and writes one JSON."""

import json

from ab_setup import embedded_ab, engine, report, spec_row

from deepflash.bench.accept import measure
from deepflash.drafter.checkpoint import load_drafter
from deepflash.engine.sampling import SamplingParams


def main():
    args, target, tok, prompts, _ = embedded_ab(
        __doc__, lambda ap: ap.add_argument("drafters", nargs="+", help="drafter folders (config.json + weights)"))
    params = SamplingParams(max_new_tokens=128)
    plain, plain_outputs = measure(engine(args, target, tok), prompts, params)
    drafters = {path: load_drafter(path, target.device, target.dtype) for path in args.drafters}
    rows: dict = {"plain tok/s": plain["tok_per_s"], **{path: [] for path in drafters}}
    for path in [*drafters, *drafters]:
        r, outputs = measure(engine(args, target, tok, drafters[path], spec="on"), prompts, params)
        rows[path].append({**spec_row(r, outputs, plain_outputs), "spec_steps": r["spec_steps"]})
        print(path, json.dumps(rows[path][-1]), flush=True)
    report(rows, args.out)


if __name__ == "__main__":
    main()
