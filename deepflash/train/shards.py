"""Token shards: target-generated conversations as flat token arrays with a loss mask.

One shard is a safetensors file with `tokens` (int32, all sequences back to back), `loss_mask`
(uint8, 1 on response tokens) and `offsets` (int64, S+1 boundaries); metadata says which target and
chat template made it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


@dataclass
class Sequence:
    tokens: torch.Tensor  # [L] int64
    loss_mask: torch.Tensor  # [L] bool, True on response tokens

    def __len__(self) -> int:
        return self.tokens.shape[0]


def write_shard(path: Path, sequences: list[Sequence], meta: dict) -> None:
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    tensors = {
        "tokens": torch.cat([s.tokens for s in sequences]).to(torch.int32),
        "loss_mask": torch.cat([s.loss_mask for s in sequences]).to(torch.uint8),
        "offsets": offsets,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"deepflash": json.dumps(meta)})


def read_shard(path: Path) -> tuple[list[Sequence], dict]:
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["deepflash"])
        tokens, mask, offsets = (f.get_tensor(n) for n in ("tokens", "loss_mask", "offsets"))
    bounds = offsets.tolist()
    seqs = [Sequence(tokens[a:b].long(), mask[a:b].bool()) for a, b in zip(bounds, bounds[1:])]
    return seqs, meta


def shard_paths(folder: Path) -> list[Path]:
    paths = sorted(Path(folder).glob("shard-*.safetensors"))
    if not paths:
        from ..errors import UserError

        raise UserError(f"no shard-*.safetensors in {folder}; run `deepflash train-drafter generate` first")
    return paths


def read_all(folder: Path) -> tuple[list[Sequence], dict]:
    seqs, meta = [], {}
    for path in shard_paths(folder):
        part, meta = read_shard(path)
        seqs.extend(part)
    return seqs, meta


def content_key(seq: Sequence) -> float:
    """A number in [0, 1) fixed by the sequence's tokens alone."""
    digest = hashlib.blake2b(seq.tokens.to(torch.int32).numpy().tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def split_held_out(seqs: list[Sequence], fraction: float) -> tuple[list[Sequence], list[Sequence]]:
    """(held out, train): a sequence is held out when its content key is below `fraction` (at least one
    when there are two or more), so it stays held out however much data is added later. A seeded shuffle
    of all sequences did not: each session's new data moved sequences an earlier run had trained on (its
    drafter continued by --init-from) into the next run's evaluation. Both lists come ordered by key."""
    keys = [content_key(s) for s in seqs]
    order = sorted(range(len(seqs)), key=keys.__getitem__)
    n = sum(k < fraction for k in keys)
    n = max(1, n) if len(seqs) > 1 else 0
    held = [seqs[i] for i in order[:n]]
    return held, [seqs[i] for i in order[n:]] or held


def length_batches(seqs: list[Sequence], batch_tokens: int) -> list[list[Sequence]]:
    """Sequences of similar length grouped so that a batch holds about batch_tokens padded tokens (long
    ones alone), each batch's longest last."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    batches, current = [], []
    for i in order:
        if current and len(seqs[i]) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(seqs[i])
    if current:
        batches.append(current)
    return batches


def split_long(batches: list[list[Sequence]], long_tokens: int) -> tuple[list[list[Sequence]], list[list[Sequence]]]:
    """(short, long): the batches whose longest sequence has at most, or more than, long_tokens tokens."""
    long = [b for b in batches if len(b[-1]) > long_tokens]
    return [b for b in batches if len(b[-1]) <= long_tokens], long


def long_batches_kept(short: int, long: int, share: float) -> int:
    """How many of `long` long batches an epoch keeps beside `short` others so that they make up at most
    `share` of it; all of them when there is nothing else to train on."""
    return min(long, round(share / (1 - share) * short)) if short else long


def iter_batches(seqs: list[Sequence], batch_tokens: int, generator: torch.Generator,
                 long_share: float | None = None, long_tokens: int = 4096) -> Iterator[list[Sequence]]:
    """One epoch of length_batches in random order. With long_share, the batches of sequences longer than
    long_tokens are a random subset (drawn anew each epoch) that makes up at most that share of the epoch:
    grouped by tokens, a few thousand long recall prompts otherwise take most steps (86% of them on the
    shipped drafter's data) and the short chats' share, which HumanEval AL follows, shrinks."""
    batches = length_batches(seqs, batch_tokens)
    if long_share is not None:
        short, long = split_long(batches, long_tokens)
        chosen = torch.randperm(len(long), generator=generator)[:long_batches_kept(len(short), len(long), long_share)]
        batches = short + [long[i] for i in chosen.tolist()]
    for j in torch.randperm(len(batches), generator=generator).tolist():
        yield batches[j]
