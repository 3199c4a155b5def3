"""A/B of the decode step's projections with their prologue fused in (models/gemv_kernel.py) against the
separate kernels (gemv_kernel.MAX_ROWS = 0: every input takes the add + norm or silu * up kernel, then
torch's GEMM), and of the fused ones with every decode-step Triton kernel launched as a dependent
(models/pdl.py). On the embedded pair
(HumanEval prompts, greedy, 128 tokens): plain tok/s, spec-on tok/s, AL, outputs equal to the arm's plain
outputs and to the first arm's; then the Qwen3-8B-shaped plain decode MBU. The arms run in turn, twice,
so that run-to-run drift shows; each runs its prompts once untimed first. Prints and writes one JSON."""

import json

import torch
from ab_setup import embedded_ab, report

from deepflash.bench.accept import measure
from deepflash.bench.common import copy_bandwidth
from deepflash.bench.speed import qwen3_8b_mbu
from deepflash.engine import Engine
from deepflash.models import gemv_kernel, pdl
from deepflash.sampling import SamplingParams

ARMS = {"separate": (0, False), "fused": (gemv_kernel.TILE, False), "fused + PDL": (gemv_kernel.TILE, True)}


def main():
    args, target, tok, prompts, drafter = embedded_ab(__doc__)
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device)
    params = SamplingParams(max_new_tokens=128)
    rows: dict = {arm: [] for arm in ARMS}
    first_outputs = None
    shipped = gemv_kernel.MAX_ROWS, pdl.ENABLED
    for arm in [*ARMS, *ARMS]:
        gemv_kernel.MAX_ROWS, pdl.ENABLED = ARMS[arm]
        plain, plain_outputs = measure(Engine(target, tok), prompts, params)
        spec, spec_outputs = measure(Engine(target, tok, drafter, spec="on"), prompts, params)
        first_outputs = first_outputs or plain_outputs
        rows[arm].append({"plain_tok_per_s": plain["tok_per_s"], "spec_tok_per_s": spec["tok_per_s"],
                          "acceptance_length": spec["acceptance_length"], "draft_s": spec["draft_s"],
                          "verify_s": spec["verify_s"],
                          "spec_same_as_plain": sum(a == b for a, b in zip(spec_outputs, plain_outputs)),
                          "plain_same_as_first_arm": sum(a == b for a, b in zip(plain_outputs, first_outputs)),
                          "qwen3_8b_mbu": qwen3_8b_mbu(device, bandwidth)})
        print(arm, json.dumps(rows[arm][-1]), flush=True)
    gemv_kernel.MAX_ROWS, pdl.ENABLED = shipped
    report(rows, args.out)


if __name__ == "__main__":
    main()
