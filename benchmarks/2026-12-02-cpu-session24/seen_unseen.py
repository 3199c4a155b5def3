"""Seen against unseen data: the shipped drafter's held-out measure (Trainer.evaluate: the walked AL and
the loss), sequence by sequence, on N sequences generated in the twenty-fourth session, after that
drafter was trained (seed 16), and on N from the twenty-third session's data (the same generation
settings, seed 15), which its training drew from (a 10-minute arm beside another reads ~24 M of the
data's ~50 M tokens, so it saw about half of these). Sequences up to MAX_LEN tokens, drawn from the same
256-token length bins in equal numbers. The AL of a set is its response tokens over its walked steps
(each sequence's steps: its response tokens over its AL); the interval is a bootstrap over sequences.
A clear gap says the drafter fits the sequences it trains on beyond what carries over to new ones.
Usage: python3 seen_unseen.py DATA_FOLDER [N]. Ends with one JSON line."""
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

from deepflash.bench.common import embedded_pair
from deepflash.runtime import DEFAULT_DRAFTER
from deepflash.train.shards import read_shard
from deepflash.train.trainer import TrainConfig, Trainer

DATA, N = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 32
MAX_LEN = 1536
SETS = {"unseen (session 24, seed 16)": "shard-more-1796199281",
        "drawn from (session 23, seed 15)": "shard-more-1796192277"}


def sequences(prefix: str) -> list:
    paths = sorted(DATA.glob(f"{prefix}-[0-9]*.safetensors"))
    return [s for path in paths for s in read_shard(path)[0] if len(s) <= MAX_LEN and s.loss_mask.any()]


def matched(sets: dict[str, list], n: int) -> dict[str, list]:
    """n sequences from each set, drawn bin by bin (256-token bins) in equal numbers."""
    rng = random.Random(0)
    bins = [{} for _ in sets]
    for b, seqs in zip(bins, sets.values()):
        for s in seqs:
            b.setdefault(len(s) // 256, []).append(s)
    chosen = [[] for _ in sets]
    keys = sorted(set.intersection(*(set(b) for b in bins)))
    while len(chosen[0]) < n:
        for k in keys:
            if all(b[k] for b in bins) and len(chosen[0]) < n:
                for c, b in zip(chosen, bins):
                    c.append(b[k].pop(rng.randrange(len(b[k]))))
    return dict(zip(sets, chosen))


def pooled_al(rows: list[dict]) -> float:
    return sum(r["response_tokens"] for r in rows) / sum(r["response_tokens"] / r["eval_al"] for r in rows)


def bootstrap(rows: list[dict], draws: int = 2000) -> list[float]:
    rng = random.Random(1)
    values = sorted(pooled_al([rng.choice(rows) for _ in rows]) for _ in range(draws))
    return [round(values[int(0.025 * draws)], 3), round(values[int(0.975 * draws)], 3)]


def main():
    target, tok = embedded_pair("cpu")
    picked = matched({name: sequences(prefix) for name, prefix in SETS.items()}, N)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "data").mkdir()
        first = sorted(DATA.glob(f"{SETS[next(iter(SETS))]}-[0-9]*.safetensors"))[0]
        (Path(tmp) / "data" / "shard-0000.safetensors").symlink_to(first.resolve())
        tc = TrainConfig(data=str(Path(tmp) / "data"), out=str(Path(tmp) / "run"), init_from=str(DEFAULT_DRAFTER),
                         steps=1, device="cpu", attention="sdpa")
        trainer = Trainer(tc, target, tok, torch.device("cpu"))
        record = {}
        for name, seqs in picked.items():
            rows = []
            for seq in seqs:  # one at a time: evaluate() reads at most 32 sequences
                trainer.eval_seqs = [seq]
                r = trainer.evaluate()
                if r["eval_al"] == 0:  # no block anchored (a one-token response): no steps to count
                    continue
                rows.append({"tokens": len(seq), "response_tokens": int(seq.loss_mask.sum()),
                             "eval_al": r["eval_al"], "eval_loss": round(r["eval_loss"], 4)})
            record[name] = {"eval_al": round(pooled_al(rows), 3), "ci95": bootstrap(rows),
                            "eval_loss_mean": round(sum(r["eval_loss"] for r in rows) / len(rows), 4),
                            "sequences": rows}
            print(name, record[name]["eval_al"], record[name]["ci95"], record[name]["eval_loss_mean"], flush=True)
    print(json.dumps({"script": "seen_unseen", "n": N, "max_len": MAX_LEN, "results": record}))


if __name__ == "__main__":
    main()
