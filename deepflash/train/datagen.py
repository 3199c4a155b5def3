"""Training data: the target answers the prompts itself, in its serving chat template, batched.

Prompts of similar length are batched together, left-padded (a key mask hides the padding; rope is
relative, so shifted positions do not change the results) and decoded in lockstep until every row has
ended or reached max_new_tokens. A fraction of the prompts is answered with sampling, so the drafter
also sees the target's less likely continuations.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from ..engine.graphs import StepGraphs
from ..engine.sampling import SamplingBuffers, SamplingParams, choose
from ..engine.stats import PhaseTimer
from ..progress import bar
from .prompts import Task
from .shards import Sequence, write_shard


@torch.no_grad()
def generate_batch(target, prompts: list[list[int]], max_new: int, stop_ids: frozenset[int],
                   params: SamplingParams, seeds: list[int], prefill_chunk: int = 512,
                   cuda_graphs: bool = True, timer: PhaseTimer | None = None) -> list[list[int]]:
    """Greedy or sampled continuations of left-padded prompts; each ends at its first stop token
    (included) or after max_new tokens. `timer` adds the batch's prefill, first step (the graph's
    capture) and decode times to its phases.

    The decode step attends over the batch's whole cache span (rows not written yet are masked), so it
    has one shape for the whole batch and runs as one CUDA graph: eager launches made data generation
    host-bound (8 minutes for 2,500 prompts on an H200, 2026-11-30)."""
    device = target.device
    timer = timer or PhaseTimer(device)
    b, longest = len(prompts), max(len(p) for p in prompts)
    total = longest + max_new
    tokens = torch.zeros(b, longest, dtype=torch.long, device=device)
    key_mask = torch.zeros(b, total, dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        tokens[i, longest - len(p) :] = torch.tensor(p, device=device)
        key_mask[i, longest - len(p) :] = True
    cache = target.new_cache(b, total)
    timer.start("prefill")
    for lo in range(0, longest, prefill_chunk):
        hi = min(longest, lo + prefill_chunk)
        logits, _ = target(tokens[:, lo:hi], torch.arange(lo, hi, device=device), cache, hi, key_mask=key_mask,
                           logits="last" if hi == longest else "none")
    sampling = SamplingBuffers.of(params, device, seeds)
    pos = torch.full((1,), longest, device=device)  # position of the newest chosen token
    token = choose(logits[:, -1], pos.expand(b), params, sampling)
    timer.stop()

    def step() -> None:  # feed the newest token at `pos`, choose the one after it
        step_logits, _ = target(token[:, None], pos, cache, total, key_mask=key_mask)
        token.copy_(choose(step_logits[:, -1], (pos + 1).expand(b), params, sampling))
        pos.add_(1)

    graphs = StepGraphs([pos, token], device, enabled=cuda_graphs, cache=cache)
    out = torch.zeros(b, max_new, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    stops = torch.tensor(sorted(stop_ids), device=device)
    timer.start("first step")
    for i in range(max_new):
        out[:, i] = token
        done |= torch.isin(token, stops)
        if i == max_new - 1 or (i % 16 == 15 and bool(done.all())):  # a host check now and then
            break
        graphs.run("decode", step)
        if i == 0:
            timer.stop()
            timer.start("decode")
    timer.stop()
    return [_until_stop(row, stop_ids) for row in out.tolist()]


def _until_stop(row: list[int], stop_ids: frozenset[int]) -> list[int]:
    for i, t in enumerate(row):
        if t in stop_ids:
            return row[: i + 1]
    return row


def build_dataset(target, tokenizer, tasks: list[Task], out: Path, *, max_new_tokens: int = 512,
                  max_len: int = 8192, batch_tokens: int = 400_000, max_batch: int = 256, sampled_fraction: float = 0.3,
                  temperature: float = 0.8, shard_size: int = 500, seed: int = 0,
                  seconds: dict[str, float] | None = None) -> dict:
    """Generate responses for `tasks` and write shards to `out`; returns counts for the log. `seconds`:
    time spent on the data before (building the prompts), reported with this function's."""
    rng = random.Random(seed)
    stop_ids = tokenizer.stop_ids(target.cfg.eos_token_ids)
    started = time.perf_counter()
    items = []
    for task, ids in zip(tasks, prompt_ids(tokenizer, tasks)):
        if task.text is not None:  # raw recall text: cutting the repeat short leaves the source as far back
            ids = ids[: max_len - max_new_tokens]
        if len(ids) + 16 <= max_len:
            items.append((ids, rng.random() < sampled_fraction, rng.getrandbits(31)))
    before = (seconds or {}) | {"tokenize": time.perf_counter() - started}
    items.sort(key=lambda item: (item[1], len(item[0])))
    batches = _batches(items, max_new_tokens, max_len, batch_tokens, max_batch)
    meta = {"chat_template": tokenizer.hf.chat_template, "vocab_size": target.cfg.vocab_size,
            "max_len": max_len, "max_new_tokens": max_new_tokens}
    sequences: list[Sequence] = []
    shards = generated = 0
    # where the time goes: the phases' device-stream seconds, and the rest (host work, shard writes)
    timer, started = PhaseTimer(target.device), time.perf_counter()
    with bar() as display:
        task_id = display.add_task("generating responses", total=len(items))
        for batch in batches:
            sampled = batch[0][1]
            params = SamplingParams(temperature=temperature if sampled else 0.0, seed=0).validated()
            room = min(max_new_tokens, max_len - max(len(i[0]) for i in batch))
            replies = generate_batch(target, [i[0] for i in batch], room, stop_ids, params, [i[2] for i in batch],
                                     timer=timer)
            for (ids, _, _), reply in zip(batch, replies):
                tokens = torch.tensor(ids + reply)
                mask = torch.zeros(len(tokens), dtype=torch.bool)
                mask[len(ids) :] = True
                sequences.append(Sequence(tokens, mask))
                generated += len(reply)
            while len(sequences) >= shard_size:
                write_shard(out / f"shard-{shards:04d}.safetensors", sequences[:shard_size], meta)
                sequences, shards = sequences[shard_size:], shards + 1
            display.advance(task_id, len(batch))
    if sequences:
        write_shard(out / f"shard-{shards:04d}.safetensors", sequences, meta)
        shards += 1
    seconds = before | timer.collect() | {"generation": time.perf_counter() - started}
    summary = {"sequences": len(items), "generated_tokens": generated, "shards": shards, "batches": len(batches),
               "seconds": {name: round(s, 3) for name, s in seconds.items()}}
    (out / "summary.json").write_text(json.dumps(summary | meta, indent=2))
    return summary


def prompt_ids(tokenizer, tasks: list[Task]) -> list[list[int]]:
    """Each task's prompt tokens: its chat in the serving template (one batched call for them all), or its
    raw text (recall tasks) with its repeat (recall_ids)."""
    chats = iter(tokenizer.chats([task.messages for task in tasks if task.text is None]))
    return [recall_ids(tokenizer, task) if task.text is not None else next(chats) for task in tasks]


def recall_ids(tokenizer, task: Task) -> list[int]:
    """The opening's tokens, then its own first tokens again, as many as tokenizing its first `again`
    characters gives less the last (which may stand where the opening merges it with what follows): joined as
    text, the repeat's closing newline was a token of its own where the opening merges it with the next
    line's indent, a last token the opening never has there, and the embedded target copied from the opening
    about half as much (14.6% of its 6-grams found only there against 26.5%, and 1.1% against 12.5% from
    beyond 4096 tokens, on 8 prompts on the CPU)."""
    ids = tokenizer.encode(task.text)
    if not task.again:
        return ids
    return ids + ids[: len(tokenizer.encode(task.text[: task.again])) - 1]


def _batches(items, max_new: int, max_len: int, batch_tokens: int, max_batch: int):
    """Consecutive runs of (sorted) items whose padded length x count stays within batch_tokens."""
    batches, current = [], []
    for item in items:
        width = min(len(item[0]) + max_new, max_len)
        fits = (len(current) + 1) * width <= batch_tokens and len(current) < max_batch
        if current and (not fits or current[0][1] != item[1]):
            batches.append(current)
            current = []
        current.append(item)
    if current:
        batches.append(current)
    return batches
