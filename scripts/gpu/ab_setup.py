"""What the A/B scripts on the embedded pair share: arguments, the pair (or with --random a random-weight
SmolLM2-135M-shaped target, which needs no staged model), HumanEval chat prompts, the shipped drafter,
the record's printing and writing, and module switches given on the command line (parse_switches)."""

import argparse
import ast
import importlib
import json
from pathlib import Path

import torch

from deepflash.bench.common import embedded_pair
from deepflash.bench.prompts import humaneval_messages
from deepflash.bench.speed import SMOLLM2_135M, random_engine
from deepflash.drafter.checkpoint import load_drafter
from deepflash.engine.engine import Engine
from deepflash.engine.runtime import DEFAULT_DRAFTER


def parse_switches(text: str) -> dict:
    """Module switches given as `SWITCH;SWITCH...`, each `module.path.NAME:VALUE` under deepflash (VALUE a
    Python literal), e.g. 'models.gemv_kernel.WAVES:2': {(module, NAME): value}."""
    switches = {}
    for setting in filter(None, text.split(";")):
        path, _, value = setting.partition(":")
        module, _, attr = path.strip().rpartition(".")
        module = importlib.import_module(f"deepflash.{module}")
        if not hasattr(module, attr):
            raise SystemExit(f"{text!r}: deepflash.{path} does not exist")
        switches[(module, attr)] = ast.literal_eval(value.strip())
    return switches


def parse_arm(text: str) -> tuple[str, dict]:
    """An A/B arm given as NAME=SWITCH;SWITCH... (parse_switches), e.g. 'waves 2=models.gemv_kernel.WAVES:2':
    (NAME, its switches)."""
    name, _, settings = text.partition("=")
    return name, parse_switches(settings)


def set_switches(switches: dict) -> dict:
    """Set module switches ({(module, NAME): value}, parse_switches); returns what they were, which
    set_switches(returned) puts back."""
    before = {key: getattr(*key) for key in switches}
    for (module, name), value in switches.items():
        setattr(module, name, value)
    return before


def embedded_ab(description: str, arguments=lambda ap: None, prepare=lambda args: None):
    """(args, target, tokenizer, prompts, drafter) for --device, --prompts (24), --random, --out and what
    `arguments` adds to the parser; prepare(args) runs before the pair loads (so that a bad argument
    fails at once)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--random", action="store_true",
                    help="a random-weight target of the embedded one's shape and random 150-250-token prompts: "
                         "speeds without staging; on it a spec step commits one token (no draft matches)")
    ap.add_argument("--out")
    arguments(ap)
    args = ap.parse_args()
    prepare(args)
    if args.random:
        base = random_engine(SMOLLM2_135M, args.device)
        target, tok = base.target, base.tokenizer
        lengths = torch.randint(150, 250, (args.prompts,), generator=torch.Generator().manual_seed(0)).tolist()
        prompts = [torch.randint(2, target.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(i)).tolist()
                   for i, n in enumerate(lengths)]
    else:
        target, tok = embedded_pair(args.device)
        prompts = [tok.chat(m) for m in humaneval_messages(args.prompts)]
    drafter = load_drafter(DEFAULT_DRAFTER, target.device, target.dtype)
    return args, target, tok, prompts, drafter


def engine(args, target, tokenizer, drafter=None, **engine_args) -> Engine:
    """An engine on the pair; on a random target without stop tokens, so every request runs its length."""
    made = Engine(target, tokenizer, drafter, **engine_args)
    if args.random:
        made.stop_ids = frozenset()
    return made


def spec_row(r: dict, outputs: list, plain_outputs: list) -> dict:
    """A spec-on measure's figures (bench.accept.measure) and how many outputs equal plain decoding's."""
    return {"acceptance_length": r["acceptance_length"], "tok_per_s": r["tok_per_s"], "spec_s": r["spec_s"],
            "same_output_as_plain": sum(a == b for a, b in zip(outputs, plain_outputs))}


def report(rows: dict, out: str | None) -> None:
    print(json.dumps(rows))
    if out:
        Path(out).write_text(json.dumps(rows, indent=2))
