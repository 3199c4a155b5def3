"""A/B of the drafter's kernels on the embedded pair: the shipped drafter drafting on torch's kernels (SDPA
over [context, block]) against the target's Triton kernels (drafter.RingBlock), HumanEval prompts, greedy,
128 tokens, spec on, the target on its default kernels. Arms alternate (torch, triton, torch, triton) so
that run-to-run drift shows; each arm runs its prompts once untimed first. Prints and writes one JSON."""

import json

from ab_setup import embedded_ab, engine, report, spec_row

import deepflash.engine.engine as engine_module
from deepflash.bench.accept import measure
from deepflash.engine.sampling import SamplingParams


def main():
    args, target, tok, prompts, drafter = embedded_ab(__doc__)
    plain, plain_outputs = measure(engine(args, target, tok), prompts, SamplingParams(max_new_tokens=128))
    rows = {"plain": [plain["tok_per_s"]], "torch": [], "triton": []}
    for kernels in ("torch", "triton", "torch", "triton"):
        engine_module.drafter_kernels = lambda target_kernels, drafter, kernels=kernels: kernels
        r, outputs = measure(engine(args, target, tok, drafter, spec="on"), prompts, SamplingParams(max_new_tokens=128))
        rows[kernels].append(spec_row(r, outputs, plain_outputs))
        print(kernels, json.dumps(rows[kernels][-1]), flush=True)
    report(rows, args.out)


if __name__ == "__main__":
    main()
