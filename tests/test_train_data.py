"""Drafter training's data: the short tasks and the prompt mixes made from site-packages (doctest, write,
recall), exercises the target writes, generating and storing the dataset (batched generation, shards,
the held-out split), repeat anchors and the long batches of an epoch."""

import json
import random
import re
import warnings
from pathlib import Path

import pytest
import torch
from helpers import DOCTEST, site_packages, tiny_target, tiny_tokenizer, train_dataset

from deepflash.engine.engine import Engine
from deepflash.engine.sampling import SamplingParams
from deepflash.errors import UserError
from deepflash.train import exercises
from deepflash.train.datagen import build_dataset, generate_batch
from deepflash.train.prompts import SHORT_TASKS, Task, parse_task_weights, short_task
from deepflash.train.shards import Sequence, read_all, split_held_out
from deepflash.train.trainer import TrainConfig, Trainer


def test_task_weights_choose_the_kinds_of_short_tasks():
    assert parse_task_weights(None) is None
    assert parse_task_weights("complete=3, explain=0.5") == {"complete": 3.0, "explain": 0.5}
    for bad in ("complete", "complet=2", "complete=-1", "complete=x"):
        with pytest.raises(UserError, match="KIND=WEIGHT"):
            parse_task_weights(bad)
    with pytest.raises(UserError, match="every kind weighs 0"):
        parse_task_weights(",".join(f"{k}=0" for k in SHORT_TASKS))
    text = 'def area(w, h):\n    """Area of a w x h rectangle."""\n    a = w * h\n    b = a\n    return b\n'
    only_complete = parse_task_weights(",".join(f"{k}={int(k == 'complete')}" for k in SHORT_TASKS))
    rng = random.Random(0)
    kinds = {short_task(rng, Path("m.py"), text, only_complete).kind for _ in range(20)}
    assert kinds == {"complete"}
    assert len({short_task(rng, Path("m.py"), text).kind for _ in range(200)}) > 3  # uniform without weights


NESTED = """
import os
class A:
    def m(self):
        x = 1
        y = 2
        z = 3
        return x
    class B:
        async def n(self):
            x = 1
            y = 2
            z = 3
            return x
if os.name:
    def f():
        def inner():
            a = 1
            b = 2
            c = 3
            return a
        c = 3
        return inner
try:
    pass
except OSError:
    def g():
        a = 1
        b = 2
        c = 3
        return a
else:
    with open(os.devnull) as fh:
        for _ in ():
            pass
        else:
            def h():
                a = 1
                b = 2
                c = 3
                return a
finally:
    while False:
        pass
    else:
        match os.name:
            case "nt":
                @staticmethod
                def k():
                    a = (lambda: 1)()
                    b = 2
                    c = 3
                    return a
"""


def test_functions_finds_every_definition_at_any_depth():
    """The statement-list walk finds what ast.walk finds: definitions in classes, functions, if, except,
    else, finally, with, for-else, while-else and match bodies (not lambdas), in file order."""
    import ast

    from deepflash.train.prompts import functions

    names = [name for name, _, _ in functions(NESTED)]
    walked = sorted((n.lineno, n.name) for n in ast.walk(ast.parse(NESTED))
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and 4 <= n.end_lineno - n.lineno <= 80)
    assert names == [name for _, name in walked] == ["m", "n", "f", "inner", "g", "h", "k"]
    assert functions(NESTED)[-1][1].startswith("@staticmethod\ndef k():")  # decorators included, dedented
    assert functions("def broken(:\n") == ()


def test_doctest_fraction_adds_humaneval_like_requests_and_keeps_the_other_prompts(tmp_path, monkeypatch):
    """A share of the tasks asks to complete functions whose docstrings carry doctest examples (at most
    two per file); the rest are the prompts the same seed gives without that share."""
    plain = 'def area(w, h):\n    """Area of a w x h rectangle."""\n    a = w * h\n    b = a\n    return b\n'
    prompts = site_packages(tmp_path, monkeypatch, lambda i: plain + "\n\n" + DOCTEST * (3 if i % 4 == 0 else 0))
    before = prompts.training_tasks(12, long_fraction=0.0, seed=3)
    mixed = prompts.training_tasks(12, long_fraction=0.0, seed=3, doctest_fraction=0.25)
    doctests = [t for t in mixed if t.kind == "complete_doctest"]
    assert len(mixed) == 12 and len(doctests) == 3
    assert all(">>>" in t.messages[0]["content"] and "Complete the following" in t.messages[0]["content"]
               for t in doctests)
    assert len({t.source for t in doctests}) == 2  # two from the first doctest file, one from the next
    assert [t.messages for t in mixed if t.kind != "complete_doctest"] == [t.messages for t in before[:9]]


def test_write_fraction_adds_requests_from_signatures_and_summaries(tmp_path, monkeypatch):
    """A share of the tasks asks to write a public function from its signature (self dropped) and its
    docstring's first paragraph, at most two per file; the rest are the prompts the same seed gives
    without that share, and the doctest share still comes on top."""
    method = ('class Box:\n    def area(self, w: int, h: int = 2) -> int:\n        """Area of a w x h box, in units.\n\n'
              '        Longer notes.\n        """\n        a = w * h\n        b = a\n        return b\n')
    private = 'def _hidden(x):\n    """A private helper of this module."""\n    y = x\n    z = y\n    return z\n'
    terse = 'def tiny(x):\n    """Short."""\n    y = x\n    z = y\n    return z\n'
    prompts = site_packages(tmp_path, monkeypatch,
                            lambda i: "\n\n".join([private, terse, method * (3 if i % 2 else 0), DOCTEST]))
    before = prompts.training_tasks(12, long_fraction=0.0, seed=3)
    mixed = prompts.training_tasks(12, long_fraction=0.0, seed=3, doctest_fraction=0.25, write_fraction=0.25)
    writes = [t for t in mixed if t.kind == "write"]
    assert len(mixed) == 12 and len(writes) == 3 and sum(t.kind == "complete_doctest" for t in mixed) == 3
    assert {t.messages[0]["content"] for t in writes} == {
        "Write a Python function `area(w: int, h: int=2) -> int`: Area of a w x h box, in units."}
    sources = [t.source for t in writes]  # two from the first file with a method, one from the next
    assert sources[0] == sources[1] != sources[2]
    assert [t.messages for t in mixed if t.kind not in ("write", "complete_doctest")] == [t.messages for t in before[:6]]


def test_function_offset_gives_new_doctest_and_write_requests_from_the_same_files(tmp_path, monkeypatch):
    """Offset k skips each file's first k x PER_FILE qualifying functions, so another offset asks about other
    functions (another seed would read the files in another order and ask about the same ones); the drawn
    tasks stay those of the seed."""
    doctests = "\n\n".join(DOCTEST.replace("double", f"double{j}") for j in range(5))
    prompts = site_packages(tmp_path, monkeypatch, lambda i: doctests)
    asked = {}
    for offset in (0, 1, 2):
        tasks = prompts.training_tasks(8, long_fraction=0.0, seed=3, doctest_fraction=0.5, function_offset=offset)
        asked[offset] = [t.messages for t in tasks if t.kind == "complete_doctest"]
        assert len(asked[offset]) == 4 and tasks[:4] == prompts.training_tasks(8, long_fraction=0.0, seed=3,
                                                                             doctest_fraction=0.5)[:4]
    names = {k: {re.search(r"def (double\d)", m[0]["content"])[1] for m in v} for k, v in asked.items()}
    assert names == {0: {"double0", "double1"}, 1: {"double2", "double3"}, 2: {"double4"}}


def test_recall_fraction_adds_raw_prompts_that_repeat_a_modules_opening(tmp_path, monkeypatch):
    """A share of the tasks is raw text, no chat: a module's opening (a quarter to three quarters of
    max_long_chars, drawn whatever the file's length: a shorter file gives none), then a prefix of it again,
    both cut at a line end, at most max_long_chars in all; the rest are the prompts the same seed gives
    without that share. Datagen's repeat is the opening's own tokens, so that the prompt ends on a token
    the opening has at that place."""
    from deepflash.train.datagen import prompt_ids

    body = "".join(f"def f{j}(x):\n    y = x + {j}\n    z = y\n    w = z\n    return w\n\n" for j in range(300))
    prompts = site_packages(tmp_path, monkeypatch, lambda i: body)
    before = prompts.training_tasks(12, long_fraction=0.0, seed=3)
    mixed = prompts.training_tasks(12, long_fraction=0.0, seed=3, recall_fraction=0.25, max_long_chars=8000)
    recalls = [t for t in mixed if t.kind == "recall"]
    assert len(mixed) == 12 and len(recalls) == 3 and len({t.text for t in recalls}) > 1
    for task in recalls:
        first, again = task.text, task.text[: task.again]
        assert task.messages == [] and first.endswith("\n") and again.endswith("\n")
        assert len(first) - len(again) >= 8000 // 8  # the continuation has text to copy
        assert 1900 <= len(first) <= 8000 * 3 // 4 and len(first) + len(again) <= 8000
    openings = [prompts.recall_task(random.Random(i), "x", body, 8000) for i in range(40)]
    assert max(len(t.text) for t in openings) > 8000 * 2 // 3  # the old cap
    short = [prompts.recall_task(random.Random(i), "x", body[:4000], 8000) for i in range(40)]
    assert 0 < sum(t is not None for t in short) < 40  # only the draws up to its length
    far = prompts.training_tasks(12, long_fraction=0.0, seed=3, recall_fraction=0.25, max_long_chars=8000,
                                 recall_min_opening=5500)
    lengths = [len(t.text) for t in far if t.kind == "recall"]  # cut at a line end: a line short of the draw
    assert len(lengths) == 3 and min(lengths) > 5500 - 60 and max(lengths) <= 8000 * 3 // 4
    assert [t.messages for t in mixed if t.kind != "recall"] == [t.messages for t in before[:9]]
    tok = tiny_tokenizer()
    chat = Task("test", "x", [{"role": "user", "content": "w5 w6"}])
    raw, recall = Task("recall", "x", [], text="w7 w8 w7"), Task("recall", "x", [], text="w7 w8 w9 w10", again=5)
    assert prompt_ids(tok, [chat, raw, recall, chat]) == [tok.chat(chat.messages), tok.encode("w7 w8 w7"),
                                                          tok.encode("w7 w8 w9 w10 w7"), tok.chat(chat.messages)]
    assert prompt_ids(tok, [recall]) == [tok.encode("w7 w8 w9 w10 w7")]  # recall alone: no chats to encode


def test_worker_processes_make_the_same_prompts(tmp_path, monkeypatch):
    """Each file's tasks depend on the file and the seed alone, so prompts made in two spawned processes
    equal those made in this one, in order, and asking for more tasks keeps the first ones."""
    doctests = "\n\n".join(DOCTEST.replace("double", f"double{j}") for j in range(3))
    write = 'def area(w, h):\n    """Area of a w x h rectangle, in units."""\n    a = w * h\n    b = a\n    return b\n'
    prompts = site_packages(tmp_path, monkeypatch, lambda i: (doctests * (i % 3 > 0) + "\n\n" + write) * (1 + i % 2))
    args = dict(long_fraction=0.5, seed=5, doctest_fraction=0.25, write_fraction=0.25)
    alone = prompts.training_tasks(16, **args)
    assert prompts.training_tasks(16, workers=2, **args) == alone
    assert [t for t in prompts.training_tasks(24, **args) if t.kind not in ("complete_doctest", "write")][:8] == \
        [t for t in alone if t.kind not in ("complete_doctest", "write")]


def test_batched_generation_matches_one_by_one():
    target = tiny_target(dtype=torch.float32)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    from deepflash.engine.sampling import SamplingParams as SP

    greedy = SP().validated()
    batch = generate_batch(target, prompts, 6, frozenset({1}), greedy, [0, 0, 0])
    tok = tiny_tokenizer()
    for p, got in zip(prompts, batch):
        engine = Engine(target, tok)
        engine.stop_ids = frozenset({1})
        assert got == engine.complete(p, SamplingParams(max_new_tokens=6)).token_ids


def test_the_held_out_split_is_fixed_by_content_as_data_grows():
    gen = torch.Generator().manual_seed(0)
    seqs = [Sequence(torch.randint(0, 1000, (int(n),), generator=gen), torch.ones(int(n), dtype=torch.bool))
            for n in torch.randint(5, 40, (600,), generator=gen)]
    def key(seq):
        return tuple(seq.tokens.tolist())

    held, train = split_held_out(seqs[:300], 0.1)
    held_more, train_more = split_held_out(seqs[300:] + seqs[:300], 0.1)  # more data, in another order
    assert {key(s) for s in held} <= {key(s) for s in held_more}
    assert not {key(s) for s in held_more} & {key(s) for s in train_more}
    assert 0.05 < len(held_more) / len(seqs) < 0.15
    copy = Sequence(held[0].tokens.clone(), held[0].loss_mask.clone())  # the same content is held out too
    assert key(copy) in {key(s) for s in split_held_out(seqs + [copy], 0.1)[0]}
    assert len(split_held_out(seqs[:2], 0.0)[0]) == 1 and split_held_out(seqs[:1], 0.5)[0] == []


def test_raw_prompts_too_long_for_a_full_response_are_cut_and_chats_dropped(tmp_path):
    """A recall prompt (raw text) longer than max_len - max_new_tokens keeps its first tokens, so that its
    continuation gets the whole response budget (the repeat ends sooner; its source lies as far back); a
    chat that long would lose its request, so it stays out as before."""
    target, tok = tiny_target(dtype=torch.float32), tiny_tokenizer()
    text = " ".join(f"w{5 + i % 80}" for i in range(150))
    tasks = [Task("recall", "x", [], text=text),
             Task("test", "x", [{"role": "user", "content": text}]),
             Task("test", "x", [{"role": "user", "content": "w5 w6"}])]
    summary = build_dataset(target, tok, tasks, tmp_path / "data", max_new_tokens=20, max_len=120, sampled_fraction=0.0)
    seqs, _ = read_all(tmp_path / "data")
    assert summary["sequences"] == len(seqs) == 2
    prompts = sorted((s.tokens[~s.loss_mask].tolist() for s in seqs), key=len)
    assert prompts[0] == tok.chat(tasks[2].messages) and prompts[1] == tok.encode(text)[:100]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return train_dataset(tmp_path_factory)


def test_dataset_shards_hold_prompt_and_response(dataset):
    target, tok, out, summary = dataset
    seqs, meta = read_all(out)
    assert len(seqs) == 8 and summary["shards"] == 3 and meta["max_len"] == 160
    for s in seqs:
        first = int(torch.nonzero(s.loss_mask)[0])
        assert s.loss_mask[first:].all() and not s.loss_mask[:first].any()
    # the cost accounting: every batch's phases, within the whole run's time
    seconds = summary["seconds"]
    assert set(seconds) == {"tokenize", "prefill", "first step", "decode", "generation"} and summary["batches"] >= 2
    assert 0 <= seconds["prefill"] + seconds["first step"] + seconds["decode"] <= seconds["generation"] + 0.01


def test_an_exercise_is_the_first_function_with_a_docstring_in_the_answer():
    doc = '    """Return the even numbers of a list, in order.\n    >>> evens([1, 2])\n    [2]\n    """'
    answer = ("Here is an exercise:\n```python\ndef helper(x):\n    return x\n\n"
              f"def evens(xs: list[int]) -> list[int]:\n{doc}\n")
    cut_off = answer + "    return [x for x in xs\n```\nThis function returns"  # the body cut off, prose after it
    assert exercises.first_header(cut_off) == f"def evens(xs: list[int]) -> list[int]:\n{doc}"
    assert exercises.first_header('def f(x):\n    """Short."""\n    return x') is None  # under 20 characters
    assert exercises.first_header("Write a function that adds two numbers.") is None


def test_an_exercise_with_a_stray_escape_is_read_without_a_warning():
    code = 'def path(x: str) -> str:\n    """Join x to C:\\cache, as in 1st examples."""'
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning of the escape would raise here
        assert exercises.first_header(code) == code


def test_exercise_tasks_ask_in_batches_and_keep_distinct_headers(dataset, monkeypatch):
    target, tok, _, _ = dataset
    assert exercises.exercise_tasks(target, tok, 3, seed=0, batch=4) == []  # random weights write no Python
    asked = []
    def generate(target, rows, *args):
        asked.append(len(rows))
        return [[5]] * len(rows)

    monkeypatch.setattr(exercises, "generate_batch", generate)
    a, b = 'def a():\n    """A."""', 'def b():\n    """B."""'
    headers = iter([a, None, a, b] * 3)
    monkeypatch.setattr(exercises, "first_header", lambda text: next(headers))
    tasks = exercises.exercise_tasks(target, tok, 2, seed=0, batch=2)
    assert asked == [2, 2]  # the second batch completes the two distinct exercises: no third
    assert [t.kind for t in tasks] == ["complete_exercise"] * 2
    assert tasks[1].messages[0]["content"] == SHORT_TASKS["complete"].format(header=b)
    assert exercises.exercise_requests(4, 1) == exercises.exercise_requests(4, 1) != exercises.exercise_requests(4, 2)


def _recall_shaped(gen, opening: int, again: int, response: int) -> Sequence:
    """A recall prompt's shape: an opening, its own first `again` tokens, then a response."""
    head = torch.randint(5, 90, (opening,), generator=gen)
    tokens = torch.cat([head, head[:again], torch.randint(5, 90, (response,), generator=gen)])
    return Sequence(tokens, torch.arange(len(tokens)) >= opening + again)


def test_repeat_anchors_mark_a_prompts_repeat_of_its_opening_and_nothing_else():
    from deepflash.train.repeats import MIN_REPEAT, repeat_start, with_repeat_anchors

    gen = torch.Generator().manual_seed(3)
    seq = _recall_shaped(gen, 600, 400, 30)
    for at in (100, 700):  # the opening's first tokens once more inside it (and its repeat): a probe that fails
        seq.tokens[at:at + 8] = seq.tokens[:8]
    marked = with_repeat_anchors(seq)
    assert torch.equal(marked.loss_mask, torch.arange(1030) >= 600) and not seq.loss_mask[600:1000].any()
    assert repeat_start(seq.tokens, 1000) == 600
    short = _recall_shaped(gen, 600, MIN_REPEAT - 1, 30)
    assert with_repeat_anchors(short) is short
    chat = Sequence(torch.randint(5, 90, (900,), generator=gen), torch.arange(900) >= 700)
    assert with_repeat_anchors(chat) is chat
    prompt_only = _recall_shaped(gen, 500, 300, 0)  # no response: the repeat runs to the end
    assert torch.equal(with_repeat_anchors(prompt_only).loss_mask, torch.arange(800) >= 500)


def test_training_with_repeat_anchors_draws_them_on_training_sequences_only(dataset, tmp_path, capsys):
    from deepflash.train.shards import write_shard
    from deepflash.train.trainer import sample_anchors

    target, tok, data, _ = dataset
    gen = torch.Generator().manual_seed(4)
    (tmp_path / "recall").mkdir()
    write_shard(tmp_path / "recall" / "shard-0000.safetensors", [_recall_shaped(gen, 60, 40, 20) for _ in range(8)],
                read_all(data)[1])
    tc = TrainConfig(data=str(tmp_path / "recall"), out=str(tmp_path / "run"), layers=2, taps=2, block_size=4,
                     anchors=64, steps=2, eval_fraction=0.25, attention="sdpa", mask_token_id=95, repeat_anchors=True,
                     long_share=0.5, min_repeat=16)
    trainer = Trainer(tc, target, tok, torch.device("cpu"))
    assert "--long-share 0.5: an epoch takes 0 of the 0 batches" in capsys.readouterr().err  # all short here
    assert all(bool(s.loss_mask[60:100].all()) for s in trainer.train_seqs)
    assert not any(bool(s.loss_mask[:100].any()) for s in trainer.eval_seqs)
    anchors = sample_anchors(trainer.train_seqs[0], 64, torch.Generator().manual_seed(0))
    assert int(anchors.min()) >= 60 and bool((anchors < 100).any())
    counts = json.loads((trainer.run() / "training.json").read_text())["data"]
    trained = len(trainer.train_seqs)
    assert counts["repeat_tokens"] == 40 * trained and counts["response_tokens"] == 20 * trained


def test_long_share_caps_the_long_batches_of_each_epoch_and_keeps_every_short_one():
    """--long-share: an epoch has every short batch once and a fresh random subset of the long ones, at most
    the share of its batches; without it (or with nothing short to train on) every batch, once."""
    from deepflash.train.shards import iter_batches, length_batches, long_batches_kept, split_long

    gen = torch.Generator().manual_seed(5)
    lengths = [int(n) for n in torch.randint(20, 90, (60,), generator=gen)] + [150 + i for i in range(40)]
    seqs = [Sequence(torch.randint(5, 90, (n,), generator=gen), torch.ones(n, dtype=torch.bool)) for n in lengths]

    def keys(batches, long):
        return sorted(tuple(map(id, b)) for b in batches if (len(b[-1]) > 100) == long)

    batches = length_batches(seqs, 400)
    short, long = keys(batches, False), keys(batches, True)
    assert len(long) == 20 and len(short) >= 9
    assert [keys(part, flag) for part, flag in zip(split_long(batches, 100), (False, True))] == [short, long]
    assert long_batches_kept(len(short), 20, 0.25) == round(len(short) / 3) and long_batches_kept(0, 20, 0.25) == 20
    epochs = []
    shuffler = torch.Generator().manual_seed(0)
    for _ in range(3):
        epoch = list(iter_batches(seqs, 400, shuffler, 0.25, 100))
        drawn = keys(epoch, True)
        assert keys(epoch, False) == short and len(drawn) == round(len(short) / 3) <= 0.25 * len(epoch)
        assert len(set(drawn)) == len(drawn) and set(drawn) <= set(long)
        epochs.append(tuple(drawn))
    assert len(set(epochs)) > 1  # a fresh subset each epoch
    whole = list(iter_batches(seqs, 400, torch.Generator().manual_seed(0)))
    assert keys(whole, False) == short and keys(whole, True) == long
    assert len(list(iter_batches(seqs[60:], 400, torch.Generator().manual_seed(0), 0.25, 100))) == 20
    with pytest.raises(UserError, match="--long-share"):
        TrainConfig(data="d", out="o", steps=1, long_share=1.0).validated()
