"""CPU: what --repeat-anchors finds in a data folder (train/repeats.py), per shard group.

For each group of shards (their name less the shard number): sequences, raw ones (no chat template: the
recall prompts), those whose prompt repeats its opening, the positions that adds, and how far back the
repeats' sources lie; then the same over all. Ends with one JSON line.

PYTHONPATH=$PWD python benchmarks/2026-12-03-h200-session36/repeat_reach.py DATA_FOLDER
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from deepflash.train.repeats import with_repeat_anchors
from deepflash.train.shards import read_shard, shard_paths

CHAT_START = 1  # <|im_start|>: every chat in the serving template begins with it


def summary(rows: list[tuple[bool, int, int]]) -> dict:
    """rows: (raw, positions added, source distance) per sequence; distance 0 where nothing was added."""
    added = [(n, d) for _, n, d in rows if n]
    distances = [d for _, d in added]
    return {"sequences": len(rows), "raw": sum(raw for raw, _, _ in rows), "repeating": len(added),
            "positions": sum(n for n, _ in added),
            "repeat_median": statistics.median(n for n, _ in added) if added else None,
            "distance_median": statistics.median(distances) if added else None,
            "beyond_4096": round(sum(d > 4096 for d in distances) / len(distances), 4) if added else None}


def main() -> None:
    started = time.perf_counter()
    groups = defaultdict(list)
    for path in shard_paths(Path(sys.argv[1])):
        seqs, _ = read_shard(path)
        for seq in seqs:
            marked = with_repeat_anchors(seq)
            added = int(marked.loss_mask.sum() - seq.loss_mask.sum())
            end = int(seq.loss_mask.int().argmax()) if bool(seq.loss_mask.any()) else len(seq)
            groups[path.stem.rsplit("-", 1)[0]].append((int(seq.tokens[0]) != CHAT_START, added,
                                                        end - added if added else 0))
    record = {name: summary(rows) for name, rows in groups.items()}
    record["all"] = summary([row for rows in groups.values() for row in rows])
    record["seconds"] = round(time.perf_counter() - started, 1)
    for name, row in record.items():
        print(name, row)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
