"""How sure the target is where the drafter misses: the shipped drafter's first drafted token of each spec
step (k = 1) against the target's own next-token distribution there (greedy, 128 tokens, CPU float32),
on HumanEval's first N requests and N "write" requests (regions_al.py's sets), split into steps inside
the first code block and after it (the prose that explains the code).
Per set and region: k = 1 acceptance by the target's top-1 probability (bins), and at the misses the
target's rank of the drafted token and its probability. If the drafter misses where the target itself
hesitates, and its misses are the target's second choice, the loss is in the target's near-ties.
Also prints the misses where the target was at least 0.9 sure, with the text before them (HumanEval's
first 8 requests).
Usage: python3 miss_confidence.py [N]. Ends with one JSON line."""
import json
import random
import sys

import torch

from deepflash import spec
from deepflash.bench.common import embedded_pair
from deepflash.bench.prompts import humaneval_messages
from deepflash.drafter import load_drafter
from deepflash.engine import Engine
from deepflash.runtime import DEFAULT_DRAFTER
from deepflash.sampling import SamplingParams
from deepflash.train.prompts import site_package_files, write_tasks

N = int(sys.argv[1]) if len(sys.argv) > 1 else 24
BINS = (0.0, 0.3, 0.5, 0.7, 0.9, 0.99, 1.01)

drafts: list[tuple[int, list[int]]] = []  # (position of the first drafted token, drafted tokens)
propose = spec.propose


def recording(drafter, target, context, last, q_pos, span=None):
    out = propose(drafter, target, context, last, q_pos, span)
    drafts.append((int(q_pos[1]), out.tolist()))
    return out


spec.propose = recording


def library(make, n: int) -> list[list[dict]]:
    """regions_al.py's "write" set: one request per site-packages file, in a seeded order."""
    files = site_package_files()
    random.Random(0).shuffle(files)
    out = []
    for path in files:
        out += [t.messages for t in make(path, path.read_text(errors="replace"))][:1]
        if len(out) == n:
            break
    return out


def region(tok, answer: list[int], at: int) -> str:
    return "code" if tok.decode(answer[:at]).count("```") == 1 else "other"


def analyse(engine, target, tok, requests, examples: int = 0) -> dict:
    firsts: dict[str, list[tuple[float, int, float]]] = {}  # region -> (target top-1 p, drafted token's rank, its p)
    for n, messages in enumerate(requests):
        prompt = tok.chat(messages)
        drafts.clear()
        answer = engine.complete(prompt, SamplingParams(max_new_tokens=128)).token_ids
        full = torch.tensor(prompt + answer)
        with torch.no_grad():
            logits, _ = target(full[None], torch.arange(len(full)), target.new_cache(1, len(full)))
        probs = logits[0].float().softmax(-1)  # probs[t - 1] predicts the token at t
        for first, tokens in drafts:
            if first >= len(full):
                continue
            p = probs[first - 1]
            ranks = (p > p[tokens[0]]).sum().item()
            where = region(tok, answer, first - len(prompt))
            firsts.setdefault(where, []).append((p.max().item(), ranks, p[tokens[0]].item()))
            if n < examples and ranks > 0 and p.max() >= 0.9:
                before = tok.decode(answer[max(0, first - len(prompt) - 12) : first - len(prompt)])[-60:]
                print(f"{where}: {before!r} -> {tok.decode([int(full[first])])!r} (p {p.max():.3f}), drafted "
                      f"{tok.decode([tokens[0]])!r} (p {p[tokens[0]]:.4f})", flush=True)
    return {where: summary(rows) for where, rows in firsts.items()}


def summary(rows) -> dict:
    bins = {}
    for lo, hi in zip(BINS, BINS[1:]):
        inside = [r for r in rows if lo <= r[0] < hi]
        if inside:
            bins[f"{lo:.2f}-{min(hi, 1.0):.2f}"] = {"steps": len(inside),
                                                   "accept_k1": round(sum(r[1] == 0 for r in inside) / len(inside), 3)}
    misses = [r for r in rows if r[1] > 0]
    return {"steps": len(rows), "accept_k1": round(1 - len(misses) / len(rows), 3),
            "target_top1_p_median_at_hits": round(float(torch.tensor([r[0] for r in rows if r[1] == 0]).median()), 3),
            "target_top1_p_median_at_misses": round(float(torch.tensor([r[0] for r in misses]).median()), 3),
            "misses_target_second_choice": round(sum(r[1] == 1 for r in misses) / len(misses), 3),
            "misses_target_p_of_drafted_median": round(float(torch.tensor([r[2] for r in misses]).median()), 3),
            "by_target_top1_p": bins}


target, tok = embedded_pair("cpu")
engine = Engine(target, tok, load_drafter(str(DEFAULT_DRAFTER), target.device, target.dtype), spec="on")
record = {}
for name, requests in {"humaneval": humaneval_messages(N), "write": library(write_tasks, N)}.items():
    record[name] = analyse(engine, target, tok, requests, examples=8 if name == "humaneval" else 0)
    print(name, json.dumps(record[name]), flush=True)
print(json.dumps(record))
