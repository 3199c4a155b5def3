"""Where a drafter training step's time goes. Trains the embedded target's drafter on synthetic sequences
shaped like the generated data (half of the prompts 150-700 tokens, half 1500-7500, + 320 response
tokens): step time and sequence tokens/s of the 3-layer drafter with the default attention (SDPA in
query chunks, train/chunks.py) and with flex_attention (compiled with dynamic shapes, train/flex.py),
then, for the default, the host-side time by function (cProfile) and the top kernels (torch.profiler) of
a few steps. Ends with one JSON line.

    python3 scripts/gpu/profile_train.py --out profile_train.json

`--short` makes every prompt 150-700 tokens (the batches with the most anchor blocks per token) and
`--random` trains against a random-weight target of the embedded one's shape (no staging).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch

from deepflash.bench.speed import SMOLLM2_135M, random_target
from deepflash.loading.targets import load_target
from deepflash.loading.tokenizer import load_tokenizer
from deepflash.train.shards import Sequence, iter_batches, write_shard
from deepflash.train.trainer import TrainConfig, Trainer


def synthetic_data(folder: Path, vocab: int, count: int, seed: int, response: int = 320, short: bool = False) -> None:
    """Sequences of random lengths; a new seed per variant, so that no variant meets shapes (and their
    cached kernel plans) that an earlier one made."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(count):  # like the generated data: about half short tasks, half whole-module ones
        low, high = (150, 700) if i % 2 or short else (1500, 7500)
        prompt = int(torch.randint(low, high, (1,), generator=gen))
        tokens = torch.randint(0, vocab, (prompt + response,), generator=gen)
        mask = torch.zeros(prompt + response, dtype=torch.bool)
        mask[prompt:] = True
        seqs.append(Sequence(tokens, mask))
    write_shard(folder / "shard-00000.safetensors", seqs, {"max_len": 8192})


def timed_steps(trainer: Trainer, steps: int) -> dict:
    batches = batches_of(trainer)
    trainer.step(batches[0])  # warm-up (allocator, kernels, flex compile)
    sync()
    began, tokens, times = time.perf_counter(), 0, []
    timed = batches[1: steps + 1] or batches[:1]  # a dry run may have only one batch
    for batch in timed:
        step_began = time.perf_counter()
        trainer.step(batch)  # its float(loss) waits for the step's GPU work
        times.append(time.perf_counter() - step_began)
        tokens += sum(len(s) for s in batch)
    sync()
    seconds = time.perf_counter() - began
    # the median leaves out a step that compiled for a new shape (flex_attention's first dynamic one)
    return {"steps": len(timed), "s_per_step": seconds / len(timed), "seq_tok_per_s": tokens / seconds,
            "median_s_per_step": sorted(times)[len(times) // 2], "step_s": [round(t, 3) for t in times]}


def batches_of(trainer: Trainer) -> list:
    return list(iter_batches(trainer.train_seqs, trainer.tc.batch_tokens, trainer.generator))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kernel_top(trainer: Trainer, steps: int) -> list[dict]:
    batches = batches_of(trainer)[:steps]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        for batch in batches:
            trainer.step(batch)
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name][0] += 1
            by_name[e.name][1] += e.device_time
    wall = sum(v[1] for v in by_name.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]
    print(f"--- kernels of {steps} steps: {wall / 1e3:.1f} ms busy")
    for name, (n, t) in top:
        print(f"{t / 1e3 / steps:9.2f} ms/step {n // steps:6d}x  {name[:100]}")
    return [{"kernel": k[:110], "calls_per_step": n / steps, "ms_per_step": t / 1e3 / steps} for k, (n, t) in top]


def host_top(trainer: Trainer, steps: int) -> list[dict]:
    """Python-side time of a few steps by function (cumulative), to find where an idle GPU waits."""
    import cProfile
    import pstats

    batches = batches_of(trainer)[:steps]
    profiler = cProfile.Profile()
    profiler.enable()
    for batch in batches:
        trainer.step(batch)
    sync()
    profiler.disable()
    stats = pstats.Stats(profiler).sort_stats("cumulative")
    rows = []
    for (path, line, name), (_, calls, _, cumulative, _) in stats.stats.items():
        rows.append({"function": f"{path.split('/')[-1]}:{line} {name}", "calls_per_step": calls / steps,
                     "s_per_step": cumulative / steps})
    rows.sort(key=lambda r: -r["s_per_step"])
    print(f"--- host time of {steps} steps by function (cumulative)")
    for r in rows[:30]:
        print(f"{r['s_per_step']:8.3f} s/step {r['calls_per_step']:8.1f}x  {r['function']}")
    return rows[:60]


def timed_run(run: dict, make, steps: int, device) -> Trainer | None:
    """Time `steps` steps of the trainer make() builds and their peak memory into `run` (or the error
    that stopped them); returns the trainer, None on an error."""
    try:
        trainer = make()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        run.update(timed_steps(trainer, steps))
        if device.type == "cuda":
            run["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except Exception as err:  # noqa: BLE001 - a failing variant is a result here
        run["error"] = f"{type(err).__name__}: {err}"
        trainer = None
    print(json.dumps(run), flush=True)
    return trainer


def make_trainer(args, target, tokenizer, device, data: Path, attention: str, seed: int) -> Trainer:
    synthetic_data(data, target.cfg.vocab_size, 64 if device.type == "cuda" else 3, seed=seed, short=args.short)
    tc = TrainConfig(data=str(data), out=str(data.with_name(f"{data.name}-run")), layers=3, batch_tokens=16384,
                     steps=1000,
                     attention=attention, device=args.device, eval_every=10**9, ckpt_every=10**9,
                     mask_token_id=target.cfg.vocab_size - 1 if tokenizer is None else None)
    return Trainer(tc, target, tokenizer, device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--device", default="cuda")  # cpu: a dry run of the script itself
    ap.add_argument("--out", required=True)
    ap.add_argument("--random", action="store_true", help="a random-weight target of the embedded one's shape")
    ap.add_argument("--short", action="store_true", help="every prompt 150-700 tokens")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.random:
        target = random_target(SMOLLM2_135M, device)
        tokenizer = None  # the mask token is then the vocabulary's last id
    else:
        target, folder = load_target(None, device, torch.bfloat16)
        tokenizer = load_tokenizer(folder)
    record = {"runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        # the first variant is the default, whose time is then broken down
        for index, attention in enumerate(("sdpa", "flex")):
            run = {"attention": attention, "batch_tokens": 16384, "attention_chunk": TrainConfig.attention_chunk}
            trainer = timed_run(run, partial(make_trainer, args, target, tokenizer, device,
                                             Path(tmp) / f"data-{index}", attention, index), args.steps, device)
            record["runs"].append(run)
            if index == 0 and trainer is not None:  # where the training time goes now
                record["host_top"] = host_top(trainer, 3)
                if device.type == "cuda":
                    record["top"] = kernel_top(trainer, 3)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps({"runs": record["runs"]}))


if __name__ == "__main__":
    main()
