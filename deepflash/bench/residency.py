"""deepflash bench residency: what --kv-budget costs in quality, on the embedded target (plain greedy decoding).

Per KV budget (and full attention):
- recall: raw prompts of DEPTH tokens that repeat a standard-library module's opening DISTANCE tokens back
  (prompts.recall_prompts), so that the right continuation is the module's own next tokens: the share of output
  tokens equal to them (copy accuracy), the share of prompts whose output equals full attention's (exact match),
  and the mean share of output tokens before the first difference from full attention's (agreeing prefix);
- needle: a pass key stated once inside filler of DEPTH tokens, at a fraction of the way in, then asked for
  (chat template): the share of prompts whose answer holds the key.
The budget's pool is rebuilt every few hundred positions of these prompts (prefill chunk 256), so a page the
question needs must be chosen by its key summaries to be seen at all.

    deepflash bench residency --out benchmarks/long-context/residency.json
"""

from __future__ import annotations

import random

from ..engine.config import EngineConfig
from ..engine.engine import Engine
from ..engine.runtime import resolve_device
from ..engine.sampling import SamplingParams
from .accept import _recall_shape
from .common import embedded_pair, environment, finish, save, table
from .prompts import recall_prompts

CHUNK = 256  # prefill chunk: small budgets need a small step (kv_budget.KVBudget.growth)
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")


def needle_prompts(tokenizer, depths: list[int], fractions: list[float], seed: int = 0) -> list[tuple[list[int], str]]:
    """(chat prompt ids, pass key) with the key stated at each fraction of filler of about each depth."""
    rng = random.Random(seed)
    per_filler = len(tokenizer.encode(FILLER))
    out = []
    for depth in depths:
        for fraction in fractions:
            key = str(rng.randrange(10000, 99999))
            fillers = max(1, (depth - 64) // per_filler)
            at = int(fillers * fraction)
            text = (FILLER * at + f"The pass key is {key}. Remember it. {key} is the pass key. "
                    + FILLER * (fillers - at))
            question = "There is a pass key hidden in the text above. What is the pass key?"
            out.append((tokenizer.chat([{"role": "user", "content": text + "\n\n" + question}]), key))
    return out


def greedy(engine: Engine, prompt: list[int], max_new: int) -> list[int]:
    return engine.complete(prompt, SamplingParams(max_new_tokens=max_new)).token_ids


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def budget_rows(target, tokenizer, budgets: list[int | None], recall: list[list[int]], truths: list[list[int]],
                needles: list[tuple[list[int], str]], max_new: int) -> list[dict]:
    rows, full = [], None
    for budget in budgets:
        engine = Engine(target, tokenizer, config=EngineConfig(kv_budget=budget, prefill_chunk=CHUNK))
        outputs = [greedy(engine, p, max_new) for p in recall]
        full = outputs if budget is None else full
        answers = [tokenizer.decode(greedy(engine, p, 16)) for p, _ in needles]
        copied = [sum(x == y for x, y in zip(out, truth)) / len(truth) for out, truth in zip(outputs, truths)]
        rows.append({
            "kv_budget": budget,
            "copy_accuracy": sum(copied) / len(copied),
            "exact_match": sum(o == f for o, f in zip(outputs, full)) / len(outputs),
            "agreeing_prefix": sum(first_difference(o, f) / max(len(o), len(f), 1) for o, f in zip(outputs, full))
            / len(outputs),
            "needle_accuracy": sum(key in answer for answer, (_, key) in zip(answers, needles)) / len(needles),
            "needle_answers": answers,
        })
    return rows


def run(args) -> dict:
    device = resolve_device(args.device)
    target, tokenizer = embedded_pair(args.device)
    depth, distance = _recall_shape(args.recall, args.max_new_tokens)
    recall = recall_prompts(tokenizer, depth, distance, args.prompts)
    start = depth - distance  # the repeated opening ends here: the module goes on from its token `start`
    truths = [p[start : start + args.max_new_tokens] for p in recall]
    needles = needle_prompts(tokenizer, [int(d) for d in args.needle_depths.split(",")],
                             [float(f) for f in args.needle_fractions.split(",")])
    budgets = [None] + [int(b) for b in args.budgets.split(",")]
    record = {"bench": "residency", **environment(device), "recall": {"depth": depth, "distance": distance,
              "prompts": len(recall)}, "needles": len(needles), "prefill_chunk": CHUNK,
              "max_new_tokens": args.max_new_tokens}
    record["rows"] = budget_rows(target, tokenizer, budgets, recall, truths, needles, args.max_new_tokens)
    save(record, args.out)
    table(f"--kv-budget on the embedded target: recall at {depth} tokens ({distance} back), needles at "
          f"{args.needle_depths} tokens", ["KV budget", "copy accuracy", "exact match", "agreeing prefix",
                                           "needle accuracy"],
          [[r["kv_budget"] or "full", r["copy_accuracy"], r["exact_match"], r["agreeing_prefix"],
            r["needle_accuracy"]] for r in record["rows"]])
    return finish(record, args.out)


def register(sub) -> None:
    p = sub.add_parser("residency", help="what --kv-budget costs in quality: recall and needles, embedded target")
    p.add_argument("--device", default="auto")
    p.add_argument("--budgets", default="1024,2048,4096", help="comma list of KV budgets in tokens")
    p.add_argument("--recall", default="7500:4500", metavar="DEPTH:DISTANCE")
    p.add_argument("--prompts", type=int, default=5, help="recall prompts")
    p.add_argument("--needle-depths", default="2048,4096,7500")
    p.add_argument("--needle-fractions", default="0.1,0.5,0.9")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", help="JSON file")
    p.set_defaults(func=run)
