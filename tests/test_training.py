"""Drafter training on a tiny random target: masks against a naive rule, labels and weights, a few
steps lower the loss, and the exported drafter loads and keeps the greedy contract."""

import json
import random
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import DOCTEST, site_packages, tiny_target, tiny_tokenizer

from deepflash.cli import main
from deepflash.drafter.checkpoint import load_drafter, save_drafter
from deepflash.drafter.context import DrafterContext
from deepflash.engine.engine import Engine
from deepflash.engine.sampling import SamplingParams
from deepflash.errors import UserError
from deepflash.train import exercises
from deepflash.train.datagen import build_dataset, generate_batch
from deepflash.train.loss import acceptance_by_position, accepted_drafts, block_loss, walked_acceptance
from deepflash.train.masks import default_gamma, loss_weights, training_mask, training_mask_mod
from deepflash.train.prompts import SHORT_TASKS, Task, parse_task_weights, short_task
from deepflash.train.shards import Sequence, read_all, split_held_out
from deepflash.train.trainer import TrainConfig, Trainer, fold_feature_scale


def naive_allowed(anchors, seq_len, block, causal, window, q, kv):
    """The rule of REFERENCE 4, one query/key pair at a time."""
    a, k = divmod(q, block)
    q_position = anchors[a] + k
    if kv < seq_len:  # context: strictly before the anchor (and inside a sliding window)
        return kv < anchors[a] and (window is None or q_position - kv < window)
    b, k2 = divmod(kv - seq_len, block)
    if b != a:  # blocks never see each other
        return False
    if causal and k2 > k:
        return False
    return window is None or abs(k - k2) < window


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 3), (False, 5)])
def test_training_mask_equals_naive_rule(causal, window):
    anchors, seq_len, block = torch.tensor([0, 3, 4, 9]), 12, 4
    mask = training_mask(anchors, seq_len, block, causal, window)
    mod = training_mask_mod(anchors, seq_len, block, causal, window)
    for q in range(mask.shape[0]):
        for kv in range(mask.shape[1]):
            want = naive_allowed(anchors.tolist(), seq_len, block, causal, window, q, kv)
            assert bool(mask[q, kv]) == want, (q, kv)
            assert bool(mod(0, 0, torch.tensor(q), torch.tensor(kv))) == want, (q, kv)
    # one row of anchors per sequence: each sequence's own mask
    batch = torch.stack([anchors, torch.tensor([1, 2, 6, 11])])
    batched, mod = training_mask(batch, seq_len, block, causal, window), training_mask_mod(batch, seq_len, block,
                                                                                          causal, window)
    for b in range(2):
        assert torch.equal(batched[b], training_mask(batch[b], seq_len, block, causal, window))
        assert all(bool(mod(torch.tensor(b), 0, torch.tensor(q), torch.tensor(kv))) == bool(batched[b, q, kv])
                   for q in range(0, batched.shape[1], 3) for kv in range(batched.shape[2]))


@pytest.mark.parametrize("causal,window", [(False, None), (True, 3)])
def test_chunked_attention_equals_the_dense_masked_one(causal, window):
    """Query chunks that see [context, own blocks] give the dense training mask's outputs and gradients
    (other chunks' block keys are masked there anyway); GQA heads, two sequences."""
    from deepflash.drafter.model import attend
    from deepflash.models.layers import fold_mask
    from deepflash.train.chunks import chunked_mask

    gen = torch.Generator().manual_seed(0)
    anchors = torch.tensor([[0, 3, 4, 9, 10, 11], [1, 2, 6, 7, 8, 11]])
    b, seq_len, block, heads, kv_heads, dim = 2, 12, 4, 4, 2, 8
    q_len = anchors.shape[1] * block
    q = torch.randn(b, heads, q_len, dim, generator=gen, requires_grad=True)
    ctx_k, ctx_v = (torch.randn(b, kv_heads, seq_len, dim, generator=gen, requires_grad=True) for _ in range(2))
    k, v = (torch.randn(b, kv_heads, q_len, dim, generator=gen, requires_grad=True) for _ in range(2))
    dense = training_mask(anchors, seq_len, block, causal, window)[:, None]
    for blocks in (1, 2, 3):
        chunked = chunked_mask(anchors, seq_len, block, causal, window, blocks, heads // kv_heads, q.dtype)
        folded = fold_mask(dense, heads // kv_heads, q.dtype)  # attend takes masks folded for attention
        outs = [attend(q, ctx_k, ctx_v, k, v, mask) for mask in (folded, chunked)]
        grads = [torch.autograd.grad(out.square().sum(), (q, ctx_k, ctx_v, k, v)) for out in outs]
        torch.testing.assert_close(outs[1], outs[0])
        for got, want in zip(*grads[::-1]):
            torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="do not split"):
        chunked_mask(anchors, seq_len, block, causal, window, 4, 2, q.dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention's backward needs CUDA (the CPU has none)")
def test_flex_attention_equals_the_dense_masked_one_without_a_compile_per_shape():
    """The flex path (CUDA) gives the dense training mask's outputs and gradients for batches of several
    context lengths and sequence counts, as training meets them, and compiles a few graphs in all, not
    one per shape (dynamo's limit of 8 then sent the rest to the unfused path: 9x slower steps)."""
    import torch._dynamo.utils as dynamo_utils

    from deepflash.drafter.model import attend
    from deepflash.models.layers import fold_mask
    from deepflash.train.flex import block_mask_for

    gen = torch.Generator(device="cuda").manual_seed(0)
    block, heads, kv_heads, dim = 16, 4, 2, 64
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    for b, seq_len in [(2, 256), (3, 512), (1, 768), (2, 1280), (4, 1792), (3, 2304)]:
        anchors = torch.randint(1, seq_len, (b, 32), device="cuda", generator=gen).sort(dim=1).values
        q_len = anchors.shape[1] * block

        def rand(*shape):
            return torch.randn(*shape, device="cuda", generator=gen, requires_grad=True)

        q, k, v = rand(b, heads, q_len, dim), rand(b, kv_heads, q_len, dim), rand(b, kv_heads, q_len, dim)
        ctx_k, ctx_v = rand(b, kv_heads, seq_len, dim), rand(b, kv_heads, seq_len, dim)
        dense = fold_mask(training_mask(anchors, seq_len, block, False, None)[:, None], heads // kv_heads, q.dtype)
        flex = block_mask_for(training_mask_mod(anchors, seq_len, block, False, None), q_len, seq_len + q_len,
                              "cuda", batch=b)
        outs = [attend(q, ctx_k, ctx_v, k, v, mask) for mask in (dense, flex)]
        grads = [torch.autograd.grad(out.square().sum(), (q, ctx_k, ctx_v, k, v)) for out in outs]
        torch.testing.assert_close(outs[1], outs[0], atol=2e-3, rtol=2e-3)
        for got, want in zip(*grads[::-1]):
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert dynamo_utils.counters["stats"]["unique_graphs"] - graphs <= 4


def test_decay_weights_start_at_one():
    w = loss_weights(16, default_gamma(16))
    assert w.shape == (15,) and w[0] == 1.0 and torch.isclose(w[7], torch.exp(torch.tensor(-1.0)))
    assert default_gamma(10) == 5 and default_gamma(8) == 4


def test_a_block_counts_as_accepted_up_to_its_first_miss():
    hits = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    accepted = accepted_drafts(hits)
    assert accepted.tolist() == [2, 1, 0, 4]
    assert acceptance_by_position(accepted, 5).tolist() == [3, 2, 1, 1]  # blocks that keep draft k


def test_the_walk_anchors_each_step_after_the_previous_one_commits():
    """Blocks at every position of a response 10..19: the engine's steps start at 10, then after each
    step's accepted drafts and its own token; blocks in between are never drafted."""
    anchors = list(range(10, 19))
    accepted = {10: 2, 11: 7, 12: 7, 13: 0, 14: 3, 15: 3, 16: 2, 17: 1, 18: 0}
    steps, tokens = walked_acceptance(anchors, [accepted[p] for p in anchors], end=20)
    assert (steps, tokens) == (4, 9)  # 10 -> 13 -> 14 -> 18 -> end; every token after 10 committed once


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


@pytest.mark.parametrize("bad,message", [(dict(steps=None), "give a budget"), (dict(eval_every=0), "--eval-every"),
                                         (dict(ckpt_every=0), "--ckpt-every"), (dict(gamma=0.0), "--gamma"),
                                         (dict(ema=1.0), "--ema")])
def test_training_settings_are_checked(bad, message):
    with pytest.raises(UserError, match=message):
        TrainConfig(**{"data": "d", "out": "o", "steps": 1, **bad}).validated()


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


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    target = tiny_target(dtype=torch.float32)
    tok = tiny_tokenizer()
    rng = torch.Generator().manual_seed(0)
    tasks = [Task("test", "x", [{"role": "user", "content": " ".join(f"w{int(i)}" for i in
                                                                   torch.randint(5, 90, (n,), generator=rng))}])
             for n in [20, 35, 50, 12, 60, 40, 25, 45]]
    out = tmp_path_factory.mktemp("data")
    summary = build_dataset(target, tok, tasks, out, max_new_tokens=40, max_len=160, sampled_fraction=0.5,
                            shard_size=3)
    return target, tok, out, summary


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


def test_deep_eval_reads_the_held_out_sequences_that_copy_from_beyond_its_window(dataset, tmp_path, monkeypatch):
    """deep_eval picks the held-out sequences whose response copies from beyond DEEP_WINDOW tokens back (not
    merely long ones) and reads them with the whole context and with every layer's window capped there; a
    cap longer than the sequences changes nothing, a shorter one changes the drafter's outputs."""
    from deepflash.train import trainer as trainer_module
    from deepflash.train.shards import write_shard

    target, tok, data, _ = dataset
    gen = torch.Generator().manual_seed(1)
    seqs = []
    for i in range(24):
        prompt = torch.randint(5, 90, (60,), generator=gen)
        response = prompt[:20] if i % 2 else torch.randint(5, 90, (20,), generator=gen)  # odd ones copy from 60 back
        seqs.append(Sequence(torch.cat([prompt, response]), torch.arange(80) >= 60))
    (tmp_path / "copies").mkdir()
    write_shard(tmp_path / "copies" / "shard-0000.safetensors", seqs, read_all(data)[1])
    monkeypatch.setattr(trainer_module, "DEEP_WINDOW", 30)
    tc = TrainConfig(data=str(tmp_path / "copies"), out=str(tmp_path / "run"), layers=2, taps=2, block_size=4,
                     anchors=16, steps=1, eval_fraction=0.5, attention="sdpa", mask_token_id=95)
    trainer = Trainer(tc, target, tok, torch.device("cpu"))
    copying = [seq for seq in trainer.eval_seqs if torch.equal(seq.tokens[60:], seq.tokens[:20])]
    assert 0 < len(copying) < len(trainer.eval_seqs)
    record = trainer.deep_eval()
    assert record == {"deep_sequences": len(copying), "deep_al": trainer.evaluate(copying)["eval_al"],
                      "deep_al_30": trainer.evaluate(copying, window=30)["eval_al"]}
    whole = trainer.evaluate(copying)["eval_loss"]
    assert trainer.evaluate(copying, window=10_000)["eval_loss"] == whole
    assert trainer.evaluate(copying, window=30)["eval_loss"] != whole
    monkeypatch.setattr(trainer_module, "DEEP_WINDOW", 70)  # nothing copies from 70 back
    assert trainer.deep_eval() == {}


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


def test_training_with_repeat_anchors_draws_them_on_training_sequences_only(dataset, tmp_path, monkeypatch, capsys):
    from deepflash.train import repeats
    from deepflash.train.shards import write_shard
    from deepflash.train.trainer import sample_anchors

    target, tok, data, _ = dataset
    monkeypatch.setattr(repeats, "MIN_REPEAT", 16)
    gen = torch.Generator().manual_seed(4)
    (tmp_path / "recall").mkdir()
    write_shard(tmp_path / "recall" / "shard-0000.safetensors", [_recall_shaped(gen, 60, 40, 20) for _ in range(8)],
                read_all(data)[1])
    tc = TrainConfig(data=str(tmp_path / "recall"), out=str(tmp_path / "run"), layers=2, taps=2, block_size=4,
                     anchors=64, steps=2, eval_fraction=0.25, attention="sdpa", mask_token_id=95, repeat_anchors=True,
                     long_share=0.5)
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


def test_training_lowers_loss_and_exports_a_working_drafter(dataset, tmp_path):
    target, tok, data, _ = dataset
    tc = TrainConfig(data=str(data), out=str(tmp_path / "run"), layers=2, taps=2, block_size=4, anchors=16,
                     steps=40, lr=3e-3, batch_tokens=400, eval_every=1000, ckpt_every=20, log_every=1,
                     eval_fraction=0.25, attention="sdpa", mask_token_id=95)
    trainer = Trainer(tc, target, tok, torch.device("cpu"))
    first = trainer.evaluate()["eval_loss"]
    folder = trainer.run()
    last = trainer.progress.history[-1]["eval_loss"]
    assert last < first - 0.3, (first, last)
    log = [json.loads(l) for l in (tmp_path / "run" / "train.jsonl").read_text().splitlines()]
    assert log[0]["step"] == 1 and len(log[0]["accept"]) == 3 and log[-1]["eval_al"] >= 1
    drafter = load_drafter(folder)
    assert drafter.cfg.trained_context_length == 160 and drafter.cfg.block_size == 4
    data = json.loads((folder / "training.json").read_text())["data"]
    assert data["sequences"] + data["held_out"] == 8 and data["held_out"] >= 1 and data["response_tokens"] > 0
    # train-drafter export makes the same drafter from the run's checkpoint and says its step
    assert main(["train-drafter", "export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    exported = json.loads((tmp_path / "exported" / "training.json").read_text())
    assert exported["steps"] == 40 and exported["last_eval"] == trainer.progress.history[-1]
    assert exported["train_config"] == json.loads((folder / "training.json").read_text())["train_config"]
    prompt = [5, 9, 22, 31]
    params = SamplingParams(max_new_tokens=20)
    spec = Engine(target, tok, drafter, spec="on").complete(prompt, params)
    assert spec.token_ids == Engine(target, tok).complete(prompt, params).token_ids


def test_exported_drafter_reads_raw_features_like_the_trained_one_reads_scaled_ones(dataset, tmp_path):
    """Training feeds features * scale (trainer module doc); export folds the scale into fc."""
    target, tok, data, _ = dataset
    tc = TrainConfig(data=str(data), out=str(tmp_path / "run"), layers=1, taps=2, block_size=4, steps=1,
                     attention="sdpa", mask_token_id=95)
    trainer = Trainer(tc, target, tok, torch.device("cpu"))
    scale = trainer.feature_scale
    assert scale.shape == (2 * target.cfg.hidden_size,) and torch.all(scale > 0)
    raw = torch.randn(7, scale.shape[0]) * 50
    folded = fold_feature_scale(trainer.drafter, scale)
    torch.testing.assert_close(folded.fuse(raw), trainer.drafter.fuse(raw * scale), rtol=1e-5, atol=1e-5)
    assert not torch.equal(folded.fc.weight, trainer.drafter.fc.weight)  # a copy, training state untouched


@pytest.mark.parametrize("layer_types", [[], ["sliding_attention", "full_attention"]])
def test_training_scores_a_block_as_the_engine_drafts_it(dataset, tmp_path, layer_types):
    """The training forward of an anchor block and the engine's draft of the same block are one
    computation: context features strictly before the anchor, [anchor token, MASK x (B-1)] at positions
    anchor + k, labels at anchor + k (REFERENCE 3-4). Scored with the exported drafter through the
    inference path (DrafterContext, drafter.logits), the blocks give the training loss."""
    target, tok, data, _ = dataset
    tc = TrainConfig(data=str(data), out=str(tmp_path / "run"), layers=2, taps=2, block_size=4, steps=1,
                     attention="sdpa", mask_token_id=95, layer_types=layer_types, sliding_window=6)
    trainer = Trainer(tc, target, tok, torch.device("cpu"))
    with torch.no_grad():  # away from the initialisation, whose zeroed projections hide the attention
        for p in trainer.drafter.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    seq = max(read_all(data)[0], key=len)
    anchors = torch.nonzero(seq.loss_mask[:-4]).flatten()[[0, 3, 10]]
    tokens = seq.tokens[None]
    feats, _ = trainer._target_pass(tokens)
    loss, *_ = block_loss(trainer.drafter, target, tokens, torch.tensor([len(seq)]), feats * trainer.feature_scale,
                          seq.loss_mask[None], anchors[None], torch.tensor([3]), trainer.weights, "sdpa")
    exported = fold_feature_scale(trainer.drafter, trainer.feature_scale)
    drafted = 0.0
    for a in anchors.tolist():
        context = DrafterContext(exported, window=512)
        context.append(torch.arange(a), feats[0, :a])
        q_pos = torch.arange(a, a + 4)
        block = torch.tensor([[int(seq.tokens[a]), 95, 95, 95]])
        hidden = exported(exported.block_embeddings(target.model.embed_tokens, block), q_pos, context.kv(),
                          context.masks(q_pos))
        logits = exported.logits(hidden[0, 1:], target.lm_head)
        drafted += (F.cross_entropy(logits, seq.tokens[a + 1 : a + 4], reduction="none") * trainer.weights).sum()
    torch.testing.assert_close(loss.detach(), drafted.detach(), rtol=1e-5, atol=1e-5)


def test_init_from_an_exported_drafter_starts_where_it_ended(dataset, tmp_path):
    """--init-from loads the exported (scale-folded) weights back into training form: same eval loss."""
    target, tok, data, _ = dataset
    # anchors above the longest response (40 tokens): every response token is an anchor, so both
    # evaluations see the same blocks
    common = dict(data=str(data), taps=2, block_size=4, anchors=64, lr=3e-3, batch_tokens=400,
                  eval_fraction=0.25, attention="sdpa", mask_token_id=95)
    first = Trainer(TrainConfig(out=str(tmp_path / "a"), layers=2, steps=15, **common), target, tok,
                    torch.device("cpu"))
    exported = first.run()
    second = Trainer(TrainConfig(out=str(tmp_path / "b"), layers=1, steps=1, init_from=str(exported), **common),
                     target, tok, torch.device("cpu"))
    assert second.cfg.num_layers == 2  # the drafter's architecture, not --layers
    ended = first.evaluate()["eval_loss"]
    assert abs(second.evaluate()["eval_loss"] - ended) < 0.01 * ended  # bf16 export rounding only
    grown = Trainer(TrainConfig(out=str(tmp_path / "c"), layers=1, steps=3, init_from=str(exported), grow_layers=1,
                                **common), target, tok, torch.device("cpu"))
    assert grown.cfg.num_layers == 3 and grown.cfg.layer_types[-1] == "full_attention"
    assert abs(grown.evaluate()["eval_loss"] - ended) < 0.01 * ended  # the new layer starts as the identity
    grown.run()
    assert grown.drafter.layers[2].mlp.down_proj.weight.abs().sum() > 0  # and then learns
    assert grown.progress.history[0]["step"] == 0  # a continued run's first evaluation is its starting point
    width = second.cfg.intermediate_size
    wider = Trainer(TrainConfig(out=str(tmp_path / "w"), layers=1, steps=3, init_from=str(exported),
                                intermediate_size=width + 32, **common), target, tok, torch.device("cpu"))
    assert wider.cfg.intermediate_size == width + 32 and wider.cfg.num_layers == 2
    assert abs(wider.evaluate()["eval_loss"] - ended) < 0.01 * ended  # the new units start adding nothing
    wider.run()
    assert wider.drafter.layers[0].mlp.down_proj.weight[:, width:].abs().sum() > 0  # and then learn
    with pytest.raises(UserError, match="can only widen"):
        Trainer(TrainConfig(out=str(tmp_path / "n"), layers=1, steps=1, init_from=str(exported),
                            intermediate_size=width - 1, **common), target, tok, torch.device("cpu"))
    # a continued drafter keeps its storage unless --storage says otherwise
    save_drafter(load_drafter(exported), tmp_path / "int8", storage="int8")
    for init, storage, want in [(exported, None, "bf16"), (tmp_path / "int8", None, "int8"),
                                (tmp_path / "int8", "bf16", "bf16")]:
        tc = TrainConfig(out=str(tmp_path / "d"), layers=1, steps=1, init_from=str(init), storage=storage, **common)
        assert Trainer(tc, target, tok, torch.device("cpu")).storage == want


def test_resume_continues_from_the_checkpoint(dataset, tmp_path):
    target, tok, data, _ = dataset
    base = dict(data=str(data), out=str(tmp_path / "run"), layers=1, taps=1, block_size=4, anchors=8, lr=1e-3,
                batch_tokens=400, eval_every=1000, ckpt_every=5, attention="sdpa", mask_token_id=95)
    Trainer(TrainConfig(**base, steps=5), target, tok, torch.device("cpu")).run()
    resumed = Trainer(TrainConfig(**base, steps=8, resume=True), target, tok, torch.device("cpu"))
    assert resumed.progress.step >= 5
    resumed.run()
    assert resumed.progress.step == 8


def test_the_weight_average_follows_each_step_and_is_exported_beside_the_drafter(dataset, tmp_path, capsys):
    """--ema: after each step average = decay * average + (1 - decay) * weights, from the first step's weights;
    the run evaluates it and exports it as drafter-ema (train-drafter export --ema makes the same from the
    checkpoint), each export's training.json has its own weights' evaluation, and --resume carries it on."""
    from deepflash.train.shards import iter_batches

    target, tok, data, _ = dataset
    base = dict(data=str(data), out=str(tmp_path / "run"), layers=1, taps=2, block_size=4, anchors=16, lr=3e-3,
                batch_tokens=200, eval_every=1000, ckpt_every=1000, eval_fraction=0.25, attention="sdpa",
                mask_token_id=95, ema=0.75)
    trainer = Trainer(TrainConfig(**dict(base, out=str(tmp_path / "by-hand")), steps=3), target, tok,
                      torch.device("cpu"))
    batches = [b for _ in range(3) for b in iter_batches(trainer.train_seqs, 200, trainer.generator)]
    expected = None
    for batch in batches[:3]:
        trainer.step(batch)
        weights = [p.detach().clone() for p in trainer.drafter.parameters()]
        expected = weights if expected is None else [0.75 * e + 0.25 * w for e, w in zip(expected, weights)]
    for got, want in zip(trainer.averaged.module.parameters(), expected):
        torch.testing.assert_close(got, want)

    run = Trainer(TrainConfig(**base, steps=3), target, tok, torch.device("cpu"))
    folder = run.run()
    averaged = folder.parent / "drafter-ema"
    assert load_drafter(averaged).cfg == load_drafter(folder).cfg
    assert (averaged / "model.safetensors").read_bytes() != (folder / "model.safetensors").read_bytes()
    log = [json.loads(line) for line in (tmp_path / "run" / "train.jsonl").read_text().splitlines()]
    assert log[-1]["weights"] == "ema" and "weights" not in log[-2] and log[-1]["step"] == log[-2]["step"] == 3
    assert json.loads((folder / "training.json").read_text())["last_eval"] == log[-2]
    assert json.loads((averaged / "training.json").read_text())["last_eval"] == log[-1]
    assert main(["train-drafter", "export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "exported"),
                 "--ema"]) == 0
    assert (tmp_path / "exported" / "model.safetensors").read_bytes() == (averaged / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "exported" / "training.json").read_text())["last_eval"] == log[-1]

    resumed = Trainer(TrainConfig(**base, steps=5, resume=True), target, tok, torch.device("cpu"))
    assert int(resumed.averaged.n_averaged) == 3
    for got, want in zip(resumed.averaged.module.parameters(), run.averaged.module.parameters()):
        assert torch.equal(got, want)
    resumed.run()
    assert int(resumed.averaged.n_averaged) == 5
    plain = dict(base, ema=0.0, out=str(tmp_path / "plain"))
    Trainer(TrainConfig(**plain, steps=1), target, tok, torch.device("cpu")).run()
    assert not (tmp_path / "plain" / "drafter-ema").exists()
    assert main(["train-drafter", "export", "--run", str(tmp_path / "plain"), "--out", str(tmp_path / "x"),
                 "--ema"]) == 2
    assert "keeps no weight average" in capsys.readouterr().err
    with pytest.raises(UserError, match="made without --ema"):
        Trainer(TrainConfig(**dict(plain, ema=0.5), steps=2, resume=True), target, tok, torch.device("cpu"))


def test_norm_gains_start_at_the_target_scale_never_decay_and_take_their_own_learning_rate(dataset, tmp_path):
    target, tok, data, _ = dataset
    tc = TrainConfig(data=str(data), out=str(tmp_path / "run"), layers=1, taps=2, block_size=4, steps=2, lr=1e-3,
                     norm_lr_scale=10.0, attention="sdpa", mask_token_id=95)
    trainer = Trainer(tc, target, tok, torch.device("cpu"))
    torch.testing.assert_close(trainer.drafter.norm.weight, target.model.norm.weight.float())
    matrices, gains = trainer.opt.param_groups
    assert all(p.ndim == 2 for p in matrices["params"]) and matrices["weight_decay"] == tc.weight_decay
    names = {id(p): n for n, p in trainer.drafter.named_parameters()}
    assert {names[id(p)].rsplit(".", 2)[-2] for p in gains["params"]} >= {"q_norm", "k_norm", "norm", "hidden_norm"}
    assert gains["weight_decay"] == 0.0
    trainer.step(trainer.train_seqs[:1])
    assert gains["lr"] == pytest.approx(10 * matrices["lr"])


def test_cudnn_attention_switch_gives_the_same_loss(dataset, tmp_path):
    """--cudnn-attention only widens SDPA's choice of kernels (the CPU has no cuDNN attention)."""
    target, tok, data, _ = dataset
    common = dict(data=str(data), layers=1, taps=2, block_size=4, steps=1, anchors=64, attention="sdpa",
                  mask_token_id=95, eval_fraction=0.25)
    losses = [Trainer(TrainConfig(out=str(tmp_path / str(flag)), cudnn_attention=flag, **common), target, tok,
                      torch.device("cpu")).evaluate()["eval_loss"] for flag in (True, False)]
    assert losses[0] == losses[1]


def test_padding_shapes_leaves_the_loss_unchanged(dataset, tmp_path):
    """--pad-to adds context rows no query can see and anchors without loss: the same loss and accuracy."""
    target, tok, data, _ = dataset
    common = dict(data=str(data), layers=1, taps=2, block_size=4, steps=1, anchors=64, attention="sdpa",
                  mask_token_id=95, eval_fraction=0.25)
    plain, padded = (Trainer(TrainConfig(out=str(tmp_path / str(pad)), pad_to=pad, **common), target, tok,
                             torch.device("cpu")) for pad in (0, 48))
    assert padded._padded(100) == 144 and plain._padded(100) == 100
    torch.testing.assert_close(padded.feature_scale, plain.feature_scale)
    a, b = plain.evaluate(), padded.evaluate()
    assert abs(a["eval_loss"] - b["eval_loss"]) < 1e-4 and a["eval_accept"] == b["eval_accept"]


def test_a_batch_trains_like_its_sequences_one_by_one(dataset, tmp_path):
    """block_loss over a padded batch (one forward) gives each sequence's loss, weights, hits and
    gradients as if it ran alone: padding rows, padded anchors and other sequences never leak in."""
    target, tok, data, _ = dataset
    # anchors above the longest response: every response token is an anchor, so no draw differs
    trainer = Trainer(TrainConfig(data=str(data), out=str(tmp_path), layers=2, taps=2, block_size=4, steps=1,
                                  anchors=64, attention="sdpa", mask_token_id=95, pad_to=0), target, tok,
                      torch.device("cpu"))
    seqs = sorted(trainer.train_seqs, key=len)[:: max(1, len(trainer.train_seqs) // 3)][:3]
    assert len({len(s) for s in seqs}) > 1

    def run(batch):
        trainer.drafter.zero_grad()
        tokens, lengths, loss_mask, anchors, real = trainer._batch_inputs(batch)
        feats = trainer._raw_features(tokens) * trainer.feature_scale
        out = list(block_loss(trainer.drafter, target, tokens, lengths, feats, loss_mask, anchors, real,
                              trainer.weights, "sdpa"))
        out[2] = acceptance_by_position(out[2], 4)  # per k: sums over sequences
        out[0].backward()
        return [*out, *(p.grad.clone() for p in trainer.drafter.parameters())]

    together = run(seqs)
    alone = [sum(parts) for parts in zip(*(run([s]) for s in seqs))]
    for got, want in zip(together, alone):
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("limit", ["MASK_ELEMENTS", "PART_QUERIES"])
def test_a_batch_split_in_parts_gives_the_same_loss(dataset, tmp_path, monkeypatch, limit):
    """Batches whose masks would exceed MASK_ELEMENTS, or whose block queries PART_QUERIES, run in parts:
    same loss and accuracy."""
    from deepflash.train import trainer as trainer_module

    target, tok, data, _ = dataset
    trainer = Trainer(TrainConfig(data=str(data), out=str(tmp_path), layers=1, taps=2, block_size=4, steps=1,
                                  anchors=64, attention="sdpa", mask_token_id=95, pad_to=0), target, tok,
                      torch.device("cpu"))
    batch = trainer.train_seqs[:5]
    whole = trainer.batch_loss(batch, train=False)
    two_rows = {"MASK_ELEMENTS": 64 * 4 * (16 * 4 + max(map(len, batch))) * 2,  # 16-block chunks
                "PART_QUERIES": 64 * 4 * 2}
    monkeypatch.setattr(trainer_module, limit, two_rows[limit])
    assert len(trainer._parts(batch)) >= 3
    split = trainer.batch_loss(batch, train=False)
    torch.testing.assert_close(split[0], whole[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split[1], whole[1])


def test_a_step_follows_the_weighted_mean_loss_whole_or_in_parts(dataset, tmp_path, monkeypatch):
    """The gradient of a step is that of the batch's weighted mean CE (REFERENCE 4's clip of 1.0 assumes
    a mean), whether the batch runs whole or in parts."""
    from deepflash.train import trainer as trainer_module

    target, tok, data, _ = dataset
    trainer = Trainer(TrainConfig(data=str(data), out=str(tmp_path), layers=1, taps=2, block_size=4, steps=1,
                                  anchors=64, attention="sdpa", mask_token_id=95, pad_to=0), target, tok,
                      torch.device("cpu"))
    batch = trainer.train_seqs[:5]

    def grads(run):
        trainer.drafter.zero_grad()
        run()
        return [p.grad.clone() for p in trainer.drafter.parameters()]

    def mean_loss():
        tokens, lengths, loss_mask, anchors, real = trainer._batch_inputs(batch)
        feats = trainer._raw_features(tokens) * trainer.feature_scale
        loss, weight, _, _ = block_loss(trainer.drafter, target, tokens, lengths, feats, loss_mask, anchors, real,
                                        trainer.weights, "sdpa")
        (loss / weight).backward()

    want = grads(mean_loss)
    whole = grads(lambda: trainer.batch_loss(batch))
    monkeypatch.setattr(trainer_module, "MASK_ELEMENTS", 64 * 4 * (16 * 4 + max(map(len, batch))) * 2)  # 16-block chunks
    assert len(trainer._parts(batch)) >= 3
    split = grads(lambda: trainer.batch_loss(batch))
    for w, a, b in zip(want, whole, split):
        torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(b, w, rtol=1e-4, atol=1e-6)


def test_distillation_reads_the_target_distribution_that_predicts_each_label(dataset, tmp_path):
    """--distill: the teacher of the token at p is the target's output at p - 1 (no shift either way),
    and its KL loss is CE minus the target's entropy, per label."""
    from deepflash.train.loss import _head_loss

    target, tok, data, _ = dataset
    trainer = Trainer(TrainConfig(data=str(data), out=str(tmp_path), layers=1, taps=2, block_size=4, steps=1,
                                  anchors=64, attention="sdpa", mask_token_id=95, distill=True), target, tok,
                      torch.device("cpu"))
    seq = trainer.train_seqs[0]
    tokens = seq.tokens[None]
    _, final = trainer._target_pass(tokens, final=True)
    cache = target.new_cache(1, tokens.shape[1])
    logits, _ = target(tokens, torch.arange(tokens.shape[1]), cache, tokens.shape[1], logits="all")
    torch.testing.assert_close(target.project(final, "all"), logits, rtol=1e-4, atol=1e-4)

    hidden = torch.randn(3, 2, target.cfg.hidden_size)
    labels = torch.randint(5, 90, (3, 2))
    w, valid = torch.ones(3, 2), torch.ones(3, 2, dtype=torch.bool)
    teacher = final[0, :6].view(3, 2, -1)
    kl, _ = _head_loss(trainer.drafter, target, hidden, labels, w, valid, teacher)
    log_q = torch.log_softmax(trainer.drafter.logits(hidden, target.lm_head).float(), -1)
    log_p = torch.log_softmax(target.project(teacher, "all").float(), -1)
    cross, entropy = -(log_p.exp() * log_q).sum(-1), -(log_p.exp() * log_p).sum(-1)
    torch.testing.assert_close(kl, (cross - entropy).sum(), rtol=1e-4, atol=1e-4)


def test_distillation_teachers_predict_the_labels_of_greedy_data(tmp_path):
    """On responses the target wrote greedily, the teacher distribution of every label has that label
    as its argmax: labels and teachers line up (a shift by one position either way breaks this)."""
    from deepflash.train.loss import labelled, teacher_states

    target, tok = tiny_target(dtype=torch.float32), tiny_tokenizer()
    tasks = [Task("test", "x", [{"role": "user", "content": " ".join(f"w{i}" for i in range(5, 5 + n))}])
             for n in (12, 30)]
    build_dataset(target, tok, tasks, tmp_path / "data", max_new_tokens=20, max_len=120, sampled_fraction=0.0)
    trainer = Trainer(TrainConfig(data=str(tmp_path / "data"), out=str(tmp_path / "run"), layers=1, taps=2,
                                  block_size=4, steps=1, anchors=64, attention="sdpa", mask_token_id=95,
                                  distill=True, pad_to=0, eval_fraction=0.0), target, tok, torch.device("cpu"))
    tokens, lengths, loss_mask, anchors, real = trainer._batch_inputs(trainer.train_seqs)
    _, final = trainer._target_pass(tokens, final=True)
    valid, label_pos = labelled(anchors, lengths, loss_mask, real, 4)
    predicted = target.project(teacher_states(final, label_pos), "all").argmax(-1).view_as(valid)
    labels = tokens.gather(1, label_pos).view_as(valid)
    assert valid.sum() > 20 and torch.equal(predicted[valid], labels[valid])


def test_distillation_trains_a_working_drafter(dataset, tmp_path):
    """Also exported as int8 rows (--storage int8), which keeps the greedy contract like any drafter."""
    target, tok, data, _ = dataset
    tc = TrainConfig(data=str(data), out=str(tmp_path / "run"), layers=1, taps=2, block_size=4, anchors=16,
                     steps=30, lr=3e-3, batch_tokens=400, eval_every=1000, ckpt_every=1000, eval_fraction=0.25,
                     attention="sdpa", mask_token_id=95, distill=True, storage="int8")
    trainer = Trainer(tc, target, tok, torch.device("cpu"))
    first = trainer.evaluate()["eval_loss"]
    folder = trainer.run()
    assert trainer.progress.history[-1]["eval_loss"] < first - 0.1
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["quant_method"] == "int8-rows"
    prompt, params = [5, 9, 22, 31], SamplingParams(max_new_tokens=12)
    spec = Engine(target, tok, load_drafter(folder), spec="on").complete(prompt, params)
    assert spec.token_ids == Engine(target, tok).complete(prompt, params).token_ids


def test_data_parallel_workers_train_one_drafter(dataset, tmp_path):
    """--workers 2 on the CPU (gloo): the workers end on the same step with identical replicas (the run
    raises otherwise), and the lead's export keeps the greedy contract; with --ema the workers share the
    weight average's start (its CPU step count too, which NCCL carries from the GPU) and the lead exports it."""
    from helpers import tiny_target_and_tokenizer

    from deepflash.train.parallel import train

    target, tok, data, _ = dataset
    tc = TrainConfig(data=str(data), out=str(tmp_path / "run"), layers=1, taps=2, block_size=4, anchors=16, steps=6,
                     lr=3e-3, batch_tokens=200, eval_every=1000, ckpt_every=1000, log_every=1, attention="sdpa",
                     mask_token_id=95, ema=0.5)
    folder = train(2, tc, tiny_target_and_tokenizer, torch.device("cpu"))
    log = [json.loads(line) for line in (tmp_path / "run" / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert load_drafter(tmp_path / "run" / "drafter-ema").cfg == load_drafter(folder).cfg
    prompt, params = [5, 9, 22, 31], SamplingParams(max_new_tokens=12)
    spec = Engine(target, tok, load_drafter(folder), spec="on").complete(prompt, params)
    assert spec.token_ids == Engine(target, tok).complete(prompt, params).token_ids


def _group_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from deepflash.train.parallel import Group

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = Group(rank, 2)
    weight = torch.nn.Parameter(torch.full((3,), 1.0 + rank))
    weight.grad = torch.full((3,), 2.0 * rank)
    idle = torch.nn.Parameter(torch.zeros(2))  # no gradient on rank 0: it contributes zeros
    idle.grad = None if rank == 0 else torch.ones(2)
    values = group.average_step([weight, idle], [10.0 * rank, 0.5])
    try:
        group.check_replicas([weight])
        drift = None
    except RuntimeError as err:
        drift = str(err)
    torch.save({"grad": weight.grad, "idle": idle.grad, "values": values, "drift": drift}, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def test_workers_average_gradients_and_notice_drifted_replicas(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_group_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert torch.equal(got["grad"], torch.ones(3)) and torch.equal(got["idle"], torch.full((2,), 0.5))
        assert got["values"] == [5.0, 0.5]
        assert "differ" in got["drift"]  # the replicas started at 1.0 and 2.0
