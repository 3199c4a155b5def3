"""A/B of the decode step's kernel choices on the embedded pair (HumanEval prompts, greedy, 128 tokens, the
shipped drafter): plain tok/s, spec-on tok/s, AL, the speculative steps' device seconds, outputs equal to the arm's
plain outputs and to the first arm's plain outputs, and with --mbu the Qwen3-8B-shaped plain decode MBU.
An arm sets module switches (ARMS) and runs with everything else as shipped: "shipped"; "torch argmax"
(argmax_kernel.py off); "separate projections" (models/gemv_kernel.py off: the add + norm or silu * up
kernel, then torch's GEMM); "torch output projections" (the attention output projections on torch's GEMM,
not gemv_kernel.linear); "no dependent launches" (models/pdl.py off). With --random the target is a
random-weight one of the same shape (no staging; every spec step commits one token). `--arm` adds arms
of any module switches (a sweep without a code change). The arms run in turn, twice, so that run-to-run
drift shows; each runs its prompts once untimed first. Prints and writes one JSON.
Formerly gemv_ab.py (its three arms: separate, fused, fused + PDL)."""

import json

import torch
from ab_setup import embedded_ab, engine, parse_arm, report, set_switches

from deepflash.bench.accept import measure
from deepflash.bench.common import copy_bandwidth
from deepflash.bench.speed import qwen3_8b_mbu
from deepflash.engine.sampling import SamplingParams
from deepflash.kernels import argmax as argmax_kernel
from deepflash.kernels import gemv as gemv_kernel
from deepflash.kernels import pdl

ARMS = {"shipped": {}, "torch argmax": {(argmax_kernel, "MAX_ROWS"): 0},
        "separate projections": {(gemv_kernel, "MAX_ROWS"): 0},
        "torch output projections": {(gemv_kernel, "OUTPUT_PROJECTIONS"): False},
        "no dependent launches": {(pdl, "ENABLED"): False}}


def add_arm(text: str) -> str:
    """Add an arm given as NAME=SWITCH;SWITCH... (ab_setup.parse_arm); returns its name."""
    name, switches = parse_arm(text)
    ARMS[name] = switches
    return name


def main():
    def arguments(ap):
        ap.add_argument("--arms", nargs="+", choices=ARMS, default=["shipped", "torch argmax"])
        ap.add_argument("--arm", action="append", default=[], metavar="NAME=SWITCH;...",
                        help="one more arm, after --arms: switches `module.path.NAME:VALUE` under deepflash, "
                             "e.g. 'waves 2=models.gemv_kernel.WAVES:2;models.gemv_kernel.CONFIGS:((None, "
                             "None, (32, 64, 4, 6, False, 4, False)),)'")
        ap.add_argument("--mbu", action="store_true", help="each arm also measures the Qwen3-8B-shaped MBU")

    def add_arms(args):
        args.arms = args.arms + [add_arm(text) for text in args.arm]

    args, target, tok, prompts, drafter = embedded_ab(__doc__, arguments, add_arms)
    arms = args.arms
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device)
    params = SamplingParams(max_new_tokens=128)
    rows: dict = {arm: [] for arm in arms}
    first_outputs = None
    for arm in [*arms, *arms]:
        before = set_switches(ARMS[arm])
        plain, plain_outputs = measure(engine(args, target, tok), prompts, params)
        spec, spec_outputs = measure(engine(args, target, tok, drafter, spec="on"), prompts, params)
        first_outputs = first_outputs or plain_outputs
        row = {"plain_tok_per_s": plain["tok_per_s"], "spec_tok_per_s": spec["tok_per_s"],
               "acceptance_length": spec["acceptance_length"], "spec_s": spec["spec_s"],
               "spec_same_as_plain": sum(a == b for a, b in zip(spec_outputs, plain_outputs)),
               "plain_same_as_first_arm": sum(a == b for a, b in zip(plain_outputs, first_outputs))}
        if args.mbu:
            row["qwen3_8b_mbu"] = qwen3_8b_mbu(device, bandwidth)
        rows[arm].append(row)
        set_switches(before)
        print(arm, json.dumps(row), flush=True)
    report(rows, args.out)


if __name__ == "__main__":
    main()
