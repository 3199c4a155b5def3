"""How far back a text copies from its prompt: what a drafter whose feature window is capped cannot see
(bench accept's window sweeps report it beside each cap; training's deep_eval picks the held-out sequences
that copy from beyond its cap)."""

from __future__ import annotations


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
