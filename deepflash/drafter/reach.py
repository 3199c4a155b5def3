"""How far back a text copies from its prompt: what a drafter whose feature window is capped cannot see
(bench accept's window sweeps report it beside each cap; training's deep_eval picks the held-out sequences
that copy from beyond its cap)."""

from __future__ import annotations

import bisect
from collections import defaultdict


def copied_from_beyond(prompts: list[list[int]], outputs: list[list[int]], window: int, n: int = 6) -> float:
    """Share of the outputs' n-grams that occur in their prompt only more than `window` tokens before its
    end: text a drafter capped at `window` cannot see. If the target copies nothing from there, a cap
    cannot cost acceptance on these prompts."""
    far = total = 0
    for ids, out in zip(prompts, outputs):
        last_seen: dict[tuple, int] = {}
        for p in range(len(ids) - n + 1):
            last_seen[tuple(ids[p : p + n])] = p
        grams = [tuple(out[p : p + n]) for p in range(len(out) - n + 1)]
        total += len(grams)
        far += sum(1 for g in grams if last_seen.get(g, len(ids)) + n <= len(ids) - window)
    return far / total if total else 0.0


def far_steps(prompt: list[int], output: list[int], trace: list[int], window: int, n: int = 6) -> list[int]:
    """Tokens committed by each speculative step of `trace` (SpecStats.trace: per step, the tokens a spec
    step committed, 0 for a plain step) that began where the target's next n tokens occur in the text
    before them (the prompt and the output so far) only more than `window` tokens back: the steps on which
    only a drafter that reads beyond a cap of `window` can follow the target. The output's first token
    came from prefill, so the first step begins after it."""
    text = prompt + output
    starts = defaultdict(list)  # n-gram -> where it starts, in order
    for p in range(len(text) - n + 1):
        starts[tuple(text[p : p + n])].append(p)
    commits, at = [], 1
    for committed in trace:
        end = len(prompt) + at  # the step drafted from text[:end]
        gram = tuple(output[at : at + n])
        if committed and len(gram) == n:
            seen = starts.get(gram, [])
            last = bisect.bisect_right(seen, end - n) - 1  # its last occurrence wholly before `end`
            if last >= 0 and seen[last] + n <= end - window:
                commits.append(committed)
        at += committed or 1
    return commits
