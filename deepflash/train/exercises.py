"""Exercises the target writes itself, asked back as "complete" requests.

The target is asked, sampled, for a new Python exercise on a topic: a signature and a docstring with
examples. Each answer's first function that parses with a docstring gives its header, which becomes a
"complete" request worded like bench accept's HumanEval ones. The text is the target's own, so no
evaluation source enters training. Short algorithmic functions are what HumanEval asks for and what the
site-packages tasks rarely are: on the CPU the shipped drafter walked 40 such requests at 3.10, HumanEval's
first 40 at 3.06 and the data's write requests at 3.21, all within each other's 95% intervals.
Trained on, 3000 of them raised HumanEval AL 2.0% on the
GPU where as many drawn tasks gave 0.8% (H200).
"""

from __future__ import annotations

import ast
import random

from ..engine.sampling import SamplingParams
from ..progress import bar
from .datagen import generate_batch
from .prompts import SHORT_TASKS, Task, _header, parse_quietly

# the short algorithmic functions of an introductory programming course: with the first 32 topics, 3000
# exercises had 1835 distinct function names, 214 of them palindromes or fibonacci numbers
TOPICS = ("strings", "lists of numbers", "prime numbers", "dictionaries", "sorting", "dates", "matrices",
          "palindromes", "vowels", "binary numbers", "fibonacci numbers", "anagrams", "word counts", "averages",
          "intervals", "brackets", "digits of a number", "tuples", "sets", "rounding", "leap years", "temperatures",
          "shopping carts", "grades", "coordinates", "triangles", "GCD", "run-length encoding", "camel case",
          "duplicates", "rotations", "substrings", "factorials", "powers of two", "roman numerals",
          "hexadecimal strings", "Caesar ciphers", "bank account balances", "stock prices", "running maximums",
          "moving averages", "medians", "variance", "polynomials", "fractions", "percentages", "time durations",
          "clock times", "phone numbers", "email addresses", "file names", "URLs", "CSV lines", "sentences",
          "capital letters", "whitespace", "character frequencies", "unique characters", "common prefixes",
          "string compression", "nested lists", "flattening lists", "list chunks", "pairs that sum to a target",
          "subarrays", "sliding windows", "binary search", "merging sorted lists", "list intersections",
          "even and odd numbers", "negative numbers", "perfect squares", "divisors", "multiples", "prime factors",
          "number bases", "bit counts", "Collatz sequences", "arithmetic sequences", "triangular numbers",
          "reversing numbers", "perfect numbers", "distances between points", "rectangles", "circles", "vectors",
          "grids", "paths in a grid", "tic-tac-toe boards", "inventories", "students and scores",
          "employees and salaries", "queues", "stacks", "histograms", "word lengths", "longest words",
          "reversing words", "sorting by a key", "rankings", "minimum and maximum", "unit conversion",
          "making change", "discounts", "taxes", "weekdays", "ages", "passwords", "input validation")
REQUEST = ("Write a new Python programming exercise about {topic}: only a function signature with type hints and "
           "a docstring that describes the task and gives two examples (>>>). Do not write the solution.")
ANSWER_TOKENS = 220  # room for a signature, a docstring and its examples (the target adds more, cut off)
# a cap, not a cost (the asking stops once enough answers held a function): about half of the answers
# hold a usable one (51 of 96 on the CPU with 32 topics, 20 of 48 with these 109)
ASKS_PER_EXERCISE = 3


def exercise_requests(count: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    return [[{"role": "user", "content": REQUEST.format(topic=rng.choice(TOPICS))}] for _ in range(count)]


def first_header(text: str) -> str | None:
    """Signature + docstring (20 characters or more) of the first function in a markdown answer. Its code
    may be cut off or followed by prose, so ever shorter runs of lines from each `def` are parsed."""
    lines = text.replace("```python", "").replace("```", "").splitlines()
    for start in (i for i, line in enumerate(lines) if line.startswith("def ")):
        for end in range(min(len(lines), start + 60), start + 1, -1):
            code = "\n".join(lines[start:end])
            try:
                node = parse_quietly(code).body[0]
            except SyntaxError:
                continue
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            if doc is not None and len(doc) >= 20:
                return _header(code)
            break  # the longest run that parses decides this def
    return None


def exercise_tasks(target, tokenizer, count: int, seed: int, batch: int = 256) -> list[Task]:
    """Up to `count` distinct "complete" requests for exercises the target writes (sampled at 0.8), asking
    up to ASKS_PER_EXERCISE x count times in batches."""
    rng = random.Random(seed)
    asks = tokenizer.chats(exercise_requests(ASKS_PER_EXERCISE * count, seed))
    stop_ids = tokenizer.stop_ids(target.cfg.eos_token_ids)
    params = SamplingParams(temperature=0.8, seed=0).validated()
    headers: dict[str, None] = {}  # ordered and distinct
    with bar() as display:
        progress = display.add_task("writing exercises", total=count)
        for lo in range(0, len(asks), batch):
            rows = asks[lo : lo + batch]
            replies = generate_batch(target, rows, ANSWER_TOKENS, stop_ids, params, [rng.getrandbits(31) for _ in rows])
            texts = tokenizer.hf.batch_decode(replies, skip_special_tokens=True)
            headers.update(dict.fromkeys(h for h in map(first_header, texts) if h))
            display.update(progress, completed=min(len(headers), count))
            if len(headers) >= count:
                break
    return [Task("complete_exercise", "written by the target",
                 [{"role": "user", "content": SHORT_TASKS["complete"].format(header=header)}])
            for header in list(headers)[:count]]
