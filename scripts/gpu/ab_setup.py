"""What the A/B scripts on the embedded pair share: arguments, the pair, HumanEval chat prompts, the
shipped drafter, and the record's printing and writing."""

import argparse
import json
from pathlib import Path

from deepflash.bench.common import embedded_pair
from deepflash.bench.prompts import humaneval_messages
from deepflash.drafter import load_drafter


def embedded_ab(description: str, arguments=lambda ap: None):
    """(args, target, tokenizer, prompts, drafter) for --device, --prompts (24), --out and what
    `arguments` adds to the parser."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--out")
    arguments(ap)
    args = ap.parse_args()
    target, tok = embedded_pair(args.device)
    prompts = [tok.chat(m) for m in humaneval_messages(args.prompts)]
    drafter = load_drafter("deepflash/drafters/smollm2-135m", target.device, target.dtype)
    return args, target, tok, prompts, drafter


def report(rows: dict, out: str | None) -> None:
    print(json.dumps(rows))
    if out:
        Path(out).write_text(json.dumps(rows, indent=2))
