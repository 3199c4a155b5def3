"""CPU: does a drafter look at the far source it should copy from? Teacher-forced on recall text.

Each prompt is a standard-library module's first DISTANCE tokens followed by the module again from its
start (bench.prompts.recall_prompts' shape), so every token of the second copy has its source exactly
DISTANCE tokens back. At anchors in the second copy the drafter drafts from the text's own target features
(the block [text[a], MASK x 15] at positions a..a+15, context positions < a), with the whole context and
with the context cut to its last 4096, 2048 and 1024 positions, as the engine's caps do.
Per drafter it prints: draft accuracy per block position against the text and the acceptance length those
drafts would get against it (1 + the leading run of matches), per window with a paired bootstrap interval
over anchors, also on the anchors alone where the target's own teacher-forced greedy choice is the text at
all 15 positions (there the text's acceptance is the real one); and, with the whole context, each layer's
attention mass (queries and heads averaged, and the most source-bound head) on the source span (the 16
tokens the block copies and the one before), on a control span of the same width 300 tokens further back,
and on everything beyond 4096 and 1024 back. --distance and --length set the shape (default 4500 and 7700:
the source beyond a 4096 cap).

PYTHONPATH=$PWD python benchmarks/2026-12-03-h200-session36/far_attention.py DRAFTER... [--prompts 4]
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random

import torch

import deepflash.drafter as drafter_module
from deepflash.bench.accept import paired_change
from deepflash.bench.prompts import recall_prompts
from deepflash.drafter import load_drafter
from deepflash.models import load_target
from deepflash.tokenizer import load_tokenizer

BLOCK = 16
WINDOWS = {"full": None, "4096": 4096, "2048": 2048, "1024": 1024}
DISTANCE = 4500  # --distance
DRAFTERS: list = []  # the drafters under test (main)
recorded: list[torch.Tensor] = []  # each layer's attention weights of the last drafter call [H, T, S]


def recording_attend(q, ctx_k, ctx_v, k, v, mask):
    """drafter.attend for one block over all its context and itself (full-attention layers, one block:
    nothing is masked), with the weights kept for inspection."""
    keys, values = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
    groups = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    weights = torch.softmax(q @ keys.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
    recorded.append(weights[0])
    return weights @ values


def text_features(target, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The tap-layer features of the text, and where the target's own greedy choice (teacher-forced)
    equals the text's next token [len - 1]."""
    taps = DRAFTERS[0].cfg.target_layer_ids
    tokens = torch.tensor([ids])
    cache = target.new_cache(1, len(ids))
    with torch.no_grad():
        _, states = target(tokens, torch.arange(len(ids)), cache, len(ids),
                           capture=[*taps, target.cfg.num_layers - 1], logits="none")
        width = target.cfg.hidden_size
        normed = states[0, :-1, -width:]
        choice = torch.cat([target.lm_head(rows).argmax(-1) for rows in normed.split(512)])
    return states[..., :-width], choice == tokens[0, 1:]


def draft(drafter, target, ids, ctx_kv, anchor: int, window: int | None):
    low = 0 if window is None else max(0, anchor - window)
    kv = [(k[:, :, low:anchor], v[:, :, low:anchor]) for k, v in ctx_kv]
    block = torch.tensor([[ids[anchor]] + [drafter.cfg.mask_token_id] * (BLOCK - 1)])
    x = drafter.block_embeddings(target.model.embed_tokens, block)
    recorded.clear()
    hidden = drafter(x, torch.arange(anchor, anchor + BLOCK), kv, [None] * len(kv))
    return drafter.logits(hidden[0, 1:], target.lm_head).argmax(-1), low


def spans_mass(weights: torch.Tensor, low: int, anchor: int) -> dict:
    """Mass of weights [H, T, keys] (keys: context low..anchor-1, then the block) on the source span,
    the control span and beyond 4096 and 1024 back: per head, averaged over the block's queries."""
    def mass(first, last):  # absolute positions first..last-1
        return weights[:, :, first - low:last - low].sum(-1).mean(-1)
    source = anchor - DISTANCE
    return {"source": mass(source, source + BLOCK + 1), "control": mass(source - 300, source - 300 + BLOCK + 1),
            "beyond_4096": mass(low, max(low, anchor - 4096)), "beyond_1024": mass(low, anchor - 1024)}


def per_anchor(lengths: list[int]) -> dict:
    """Acceptance lengths as measure()'s rows (one step each), for bench.accept.paired_change."""
    return {"per_prompt_steps_committed": [[1, n] for n in lengths]}


def leading(matches: torch.Tensor) -> int:
    return int(matches.long().cumprod(0).sum())


def measure(drafter, target, texts, features, anchors_per_text: int) -> dict:
    rng = random.Random(0)
    al = {w: [] for w in WINDOWS}
    copies = []  # per anchor: the target's greedy choice is the text's token at all 15 drafted positions
    hits = {w: torch.zeros(BLOCK - 1) for w in WINDOWS}
    masses = []
    for ids, (feats, agrees) in zip(texts, features):
        with torch.no_grad():
            ctx_kv = drafter.context_kv(drafter.fuse(feats), torch.arange(len(ids)))
            for anchor in sorted(rng.sample(range(DISTANCE + 500, len(ids) - BLOCK), anchors_per_text)):
                truth = torch.tensor(ids[anchor + 1:anchor + BLOCK])
                copies.append(bool(agrees[anchor:anchor + BLOCK - 1].all()))
                for name, window in WINDOWS.items():
                    drafts, low = draft(drafter, target, ids, ctx_kv, anchor, window)
                    matches = drafts == truth
                    hits[name] += matches.float()
                    al[name].append(1 + leading(matches))
                    if window is None:
                        masses.append([spans_mass(w, low, anchor) for w in recorded])
    count = len(al["full"])
    record = {"anchors": count, "target_copies_block": sum(copies)}
    for name in WINDOWS:
        copied = [x for x, c in zip(al[name], copies) if c]
        row = {"acceptance_length": round(sum(al[name]) / count, 4),
               "acceptance_length_where_target_copies": round(sum(copied) / max(len(copied), 1), 4),
               "per_position_accuracy": [round(x, 4) for x in (hits[name] / count).tolist()]}
        if name != "full":
            row["vs_full"] = round(sum(al[name]) / sum(al["full"]) - 1, 4)
            row["vs_full_ci95"] = paired_change(per_anchor(al["full"]), per_anchor(al[name]))["ci95"]
        record[name] = row
    layers = []
    for i in range(len(masses[0])):
        per = {key: torch.stack([m[i][key] for m in masses]) for key in masses[0][i]}  # [anchors, H]
        head = int(per["source"].mean(0).argmax())
        layers.append({key: round(float(v.mean()), 4) for key, v in per.items()}
                      | {"best_head": head, "best_head_source": round(float(per["source"][:, head].mean()), 4),
                         "best_head_control": round(float(per["control"][:, head].mean()), 4)})
    record["attention"] = layers
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("drafters", nargs="+")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--distance", type=int, default=4500)
    parser.add_argument("--length", type=int, default=7700)
    parser.add_argument("--anchors", type=int, default=24, help="per prompt")
    args = parser.parse_args()
    global DISTANCE
    DISTANCE = args.distance
    drafter_module.attend = recording_attend
    target, folder = load_target(None)
    tok = load_tokenizer(folder)
    DRAFTERS[:] = [load_drafter(path) for path in args.drafters]
    texts = recall_prompts(tok, args.length, DISTANCE, args.prompts)
    features = [text_features(target, ids) for ids in texts]
    out = {"distance": DISTANCE, "length": args.length, "prompts": len(texts)}
    for path, drafter in zip(args.drafters, DRAFTERS):
        record = measure(drafter, target, texts, features, args.anchors)
        out[path] = record
        print(path, json.dumps({k: v for k, v in record.items() if k != "attention"}))
        for i, layer in enumerate(record["attention"]):
            print(f"  layer {i}: {layer}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
