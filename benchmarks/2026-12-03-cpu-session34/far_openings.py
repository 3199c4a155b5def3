"""Recall prompts drawn with --recall-min-opening (default 15000 characters) against the default draw: how many
this machine's site-packages give, their openings (the continuation's distance back) and whole prompts in the
embedded tokenizer's tokens, and how many keep a repeat once datagen cuts the prompt to leave room for the answer.
Usage: far_openings.py COUNT [MIN_OPENING] (seed 29)."""
import statistics, sys, time
from deepflash.config import EngineConfig
from deepflash.runtime import load_runtime
from deepflash.train.datagen import recall_ids
from deepflash.train.prompts import training_tasks


def main():  # spawned prompt workers import this file: the work only under __main__
    count = int(sys.argv[1])
    min_opening = int(sys.argv[2]) if len(sys.argv) > 2 else 15000
    tokenizer = load_runtime(EngineConfig(device="cpu", no_draft=True)).tokenizer
    for label, least in (("default draw", None), (f"--recall-min-opening {min_opening}", min_opening)):
        started = time.perf_counter()
        tasks = training_tasks(count, seed=29, recall_fraction=1.0, recall_min_opening=least, workers=2)
        openings = [len(tokenizer.encode(t.text)) for t in tasks]
        prompts = [len(recall_ids(tokenizer, t)) for t in tasks]
        for cut in (7680, 8064):  # datagen cuts a recall prompt at max_len - max_new_tokens (512, 128)
            repeats = [min(p, cut) - o for o, p in zip(openings, prompts)]
            print(f"{label}: {len(tasks)} prompts in {time.perf_counter() - started:.0f} s; opening tokens median "
                  f"{statistics.median(openings):.0f} (min {min(openings)}, max {max(openings)}), beyond 4096: "
                  f"{sum(o > 4096 for o in openings)}; prompt tokens median {statistics.median(prompts):.0f}; "
                  f"cut at {cut}: no repeat left {sum(r <= 0 for r in repeats)}, a repeat of 256 tokens or more "
                  f"{sum(r >= 256 for r in repeats)}, of them beyond 4096 "
                  f"{sum(r >= 256 and o > 4096 for o, r in zip(openings, repeats))}")


if __name__ == "__main__":
    main()
