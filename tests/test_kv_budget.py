"""Bounded KV residency (models/kv_budget.py): the pool holds the selected pages and the recent positions exactly,
the host copy holds every position, pages are scored as the reference does, and below the budget the output is
full attention's."""

import copy
import math

import pytest
import torch
from helpers import drafter_config, hybrid_target, oracle, tiny_drafter, tiny_target, tiny_tokenizer

from deepflash.bench import residency
from deepflash.engine.config import EngineConfig
from deepflash.engine.engine import Engine
from deepflash.engine.memory import plan_memory
from deepflash.engine.sampling import SamplingParams
from deepflash.errors import UserError
from deepflash.models.kv_budget import PAGE, BudgetKVCache, KVBudget, page_mass
from deepflash.models.kv_cache import KVCache

TOKENIZER = tiny_tokenizer()
CONTEXT = 1536


def targets():
    return {"llama": tiny_target(max_position_embeddings=CONTEXT),
            "qwen3.5": hybrid_target("dense", max_position_embeddings=CONTEXT)}


TARGETS = targets()


def run_chunks(target, cache, ids, chunk=32, bounded=None):
    """Logits of ids fed `chunk` tokens a forward; `bounded` (the budget cache) gets make_room first."""
    out = []
    for lo in range(0, ids.shape[1], chunk):
        hi = min(lo + chunk, ids.shape[1])
        if bounded is not None:
            bounded.make_room(lo, hi)
        out.append(target(ids[:, lo:hi], torch.arange(lo, hi), cache, hi)[0])
    return torch.cat(out, dim=1)


def host_rows(host, layer):
    """A layer's rows of the host copy [pages, layers, Hkv, PAGE, D] as [Hkv, positions, D]."""
    return host[:, layer].transpose(0, 1).flatten(1, 2)


def attention_kv(cache):
    return getattr(cache, "kv", cache)


@pytest.mark.parametrize("family", list(TARGETS))
def test_pool_holds_the_selected_pages_and_the_recent_positions(family):
    target = TARGETS[family]
    ids = torch.randint(2, 96, (1, 1400), generator=torch.Generator().manual_seed(0))
    full = target.new_cache(1, CONTEXT)
    cache = target.new_cache(1, CONTEXT, KVBudget(512, 32))
    kv, reference = attention_kv(cache), attention_kv(full)
    assert isinstance(kv, BudgetKVCache)
    ours, theirs = run_chunks(target, cache, ids, bounded=kv), run_chunks(target, full, ids)
    assert kv.rebuilds >= 5 and kv.base == kv.budget.selected * PAGE
    # before the first rebuild (a step's length before the pool's end) full attention's: the same keys, a wider
    # masked span
    torch.testing.assert_close(ours[:, :480], theirs[:, :480], rtol=0, atol=1e-10)
    assert not torch.allclose(ours[:, 1300:], theirs[:, 1300:])  # past it, attention over part of the context
    start, end = kv.recent_start, ids.shape[1]
    # layer 0's K/V depend on the tokens alone: the host copy and the recent region hold the full cache's
    for mine, full_rows in ((kv.host_k, reference.k), (kv.host_v, reference.v)):
        assert torch.equal(host_rows(mine, 0)[:, :start], full_rows[0, 0, :, :start])
    assert torch.equal(kv.k[0, 0, :, kv.base : kv.base + end - start], reference.k[0, 0, :, start:end])
    for layer in range(kv.k.shape[0]):
        for head, pages in enumerate(kv.pages[layer]):
            assert pages[0] == 0 and bool((pages.diff() > 0).all())  # the sink, then ascending
            positions = (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()
            assert torch.equal(kv.k[layer, 0, head, : kv.base], host_rows(kv.host_k, layer)[head, positions])
            assert torch.equal(kv.v[layer, 0, head, : kv.base], host_rows(kv.host_v, layer)[head, positions])
        # every retired page's summaries are its keys' minima and maxima
        pages_retired = torch.arange(start // PAGE)
        keys = host_rows(kv.host_k, layer)[:, :start].unflatten(1, (-1, PAGE))
        assert torch.equal(kv.key_min[layer][:, pages_retired], keys.amin(dim=2))
        assert torch.equal(kv.key_max[layer][:, pages_retired], keys.amax(dim=2))


def test_page_mass_matches_a_loop_over_heads_and_pages():
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(4, 8, generator=gen, dtype=torch.float64)
    low = torch.randn(2, 5, 8, generator=gen, dtype=torch.float64)
    high = low + torch.rand(2, 5, 8, generator=gen, dtype=torch.float64)
    bound = torch.zeros(4, 5, dtype=torch.float64)
    for head in range(4):
        for page in range(5):
            kv_head = head // 2
            bound[head, page] = sum(max(query[head, d] * low[kv_head, page, d], query[head, d] * high[kv_head, page, d])
                                    for d in range(8)) / math.sqrt(8)
    expected = bound.softmax(dim=1).view(2, 2, 5).sum(dim=1)  # per kv head, over its two query heads
    torch.testing.assert_close(page_mass(query, low, high), expected.float())


def test_a_page_of_keys_along_the_query_is_chosen():
    target = TARGETS["llama"]
    kv = target.new_cache(1, CONTEXT, KVBudget(512, 32))
    kv.make_room(0, 512)
    kv.query.zero_()
    kv.query[:, :, 0] = 1.0
    kv.k.zero_()
    kv.k[:, 0, :, 5 * PAGE : 6 * PAGE, 0] = 5.0  # page 5's keys point along every query
    assert kv.make_room(512, 520)  # 7 candidate pages for 5 places
    assert all(5 in pages.tolist() and 0 in pages.tolist() for pages in kv.pages.flatten(0, 1))


def engine(target, budget, drafter=None, **config):
    return Engine(target, TOKENIZER, drafter, EngineConfig(kv_budget=budget, max_ctx=CONTEXT, prefill_chunk=64,
                                                           **config))


def prompt(n, seed=0):
    return torch.randint(5, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("use_drafter", [False, True])
def test_below_the_budget_the_output_is_full_attentions(use_drafter):
    target = TARGETS["llama"]
    drafter = tiny_drafter(drafter_config(target.cfg)) if use_drafter else None
    params = SamplingParams(max_new_tokens=40)
    ids = prompt(300)
    ours = engine(target, 1024, drafter, spec="on" if use_drafter else "off").complete(ids, params)
    theirs = Engine(target, TOKENIZER, drafter, EngineConfig(max_ctx=CONTEXT)).complete(ids, params)
    assert ours.token_ids == theirs.token_ids


@pytest.mark.parametrize("use_drafter", [False, True])
def test_generation_runs_past_the_budget(use_drafter):
    target = TARGETS["llama"]
    drafter = tiny_drafter(drafter_config(target.cfg)) if use_drafter else None
    run = engine(target, 512, drafter, spec="on" if use_drafter else "off")
    out = run.complete(prompt(900), SamplingParams(max_new_tokens=200, temperature=1.0, seed=3))
    assert run.kv.rebuilds >= 3 and 0 < len(out.token_ids) <= 200
    assert run.kv.recent_start + run.kv.k.shape[3] - run.kv.base >= 900 + len(out.token_ids)


@pytest.mark.parametrize("block,wrong_every", [(4, None), (16, None), (16, 0), (16, 7)])
def test_speculative_equals_plain_past_the_budget(monkeypatch, block, wrong_every):
    """The pool is rebuilt at the same committed lengths, with the same query, in both: their outputs are equal
    through several rebuilds (three or more while decoding). Drafts: a random drafter's, or the true continuation (spoiled every few)."""
    target = TARGETS["llama"]
    drafter = tiny_drafter(drafter_config(target.cfg))
    ids = prompt(700, seed=4)
    params = SamplingParams(max_new_tokens=400)
    plain = engine(target, 512)
    spec = engine(target, 512, drafter, spec="on", block_size=block)
    plain.stop_ids = spec.stop_ids = frozenset()  # 400 tokens whatever comes
    want = plain.complete(ids, params).token_ids
    assert plain.kv.rebuilds >= 5 and len(want) == 400
    if wrong_every is not None:
        oracle(monkeypatch, want, len(ids), wrong_every)
    out = spec.complete(ids, params)
    assert out.token_ids == want
    if wrong_every == 0:
        assert out.spec.histogram[-1] > 0  # whole blocks were accepted
    assert spec.kv.rebuilds == plain.kv.rebuilds


def test_settings_are_checked():
    target = TARGETS["llama"]
    with pytest.raises(UserError, match="--kv-budget 96 leaves no room"):
        engine(target, 96)
    with pytest.raises(UserError, match="prefix cache"):
        EngineConfig(kv_budget=4096, prefix_cache=True).validated()
    # a budget the context fits in is the plain cache
    assert not engine(target, CONTEXT).bounded


def test_memory_plan_counts_the_pool_on_the_device_and_the_context_on_the_host():
    target = TARGETS["llama"]
    full = plan_memory(target, None, CONTEXT, EngineConfig(prefill_chunk=64))
    bounded = plan_memory(target, None, CONTEXT, EngineConfig(prefill_chunk=64, kv_budget=512))
    per_token = target.kv_bytes_per_token()
    assert full.parts["target KV cache"] == per_token * CONTEXT and full.host_bytes == 0
    assert bounded.parts["target KV cache"] == per_token * 512
    assert bounded.parts["KV page summaries"] == per_token * CONTEXT // PAGE
    run = engine(target, 512)
    assert bounded.host_bytes == per_token * CONTEXT == run.kv.host_bytes
    assert run.kv.nbytes == bounded.parts["target KV cache"] + bounded.parts["KV page summaries"] + run.kv.query.nbytes


def test_residency_bench_scores_budgets_against_full_attention():
    target = TARGETS["llama"]
    recall = [prompt(900, seed=s) for s in range(2)]
    truths = [p[100:116] for p in recall]
    needles = [(prompt(700, seed=5), "w7")]
    rows = residency.budget_rows(target, TOKENIZER, [None, 512], recall, truths, needles, 16)
    full, bounded = rows
    assert full["kv_budget"] is None and full["exact_match"] == 1.0 and full["agreeing_prefix"] == 1.0
    assert bounded["kv_budget"] == 512 and 0.0 <= bounded["agreeing_prefix"] <= 1.0
    for row in rows:
        assert 0.0 <= row["copy_accuracy"] <= 1.0 and row["needle_accuracy"] in (0.0, 1.0)
        assert len(row["needle_answers"]) == 1
    assert residency.first_difference([1, 2, 3], [1, 2, 4]) == 2 and residency.first_difference([1], [1, 5]) == 1


class ResidentOnly(KVCache):
    """Every position's K/V, but attention reads only what a bounded cache holds for each layer (its selected
    pages, then its recent positions): the computation the pool must reproduce."""

    def __init__(self, bounded: BudgetKVCache, length: int):
        layers, _, kv_heads, _, dim = bounded.k.shape
        super().__init__(layers, 1, kv_heads, length, dim, bounded.k.dtype, "cpu")
        self.bounded = bounded
        recent = slice(bounded.base, bounded.base + bounded.written - bounded.recent_start)
        for mine, host, pool in ((self.k, bounded.host_k, bounded.k), (self.v, bounded.host_v, bounded.v)):
            for layer in range(layers):
                mine[layer, 0, :, : bounded.recent_start] = host_rows(host, layer)[:, : bounded.recent_start]
                mine[layer, 0, :, bounded.recent_start : bounded.written] = pool[layer, 0, :, recent]

    def shift(self) -> int:
        return self.bounded.recent_start - self.bounded.base

    def slots(self, positions, kv_len):
        return positions - self.shift(), int(positions[-1]) + 1 - self.shift()

    def write(self, layer, slots, k, v):  # K/V kept by position here
        super().write(layer, slots + self.shift(), k, v)

    def read(self, layer, kv_len):
        recent = torch.arange(self.bounded.recent_start, self.bounded.recent_start + kv_len - self.bounded.base)
        held = [torch.cat([(pages[:, None] * PAGE + torch.arange(PAGE)).flatten(), recent])
                for pages in self.bounded.pages[layer]]  # each kv head's
        return tuple(torch.stack([rows[layer][:, head, positions] for head, positions in enumerate(held)], dim=1)
                     for rows in (self.k, self.v))


@pytest.mark.parametrize("family", list(TARGETS))
def test_the_pool_attends_exactly_over_its_resident_positions(family):
    target = TARGETS[family]
    ids = torch.randint(2, 96, (1, 1100), generator=torch.Generator().manual_seed(2))
    cache = target.new_cache(1, CONTEXT, KVBudget(512, 32))
    kv = attention_kv(cache)
    run_chunks(target, cache, ids[:, :1088], bounded=kv)
    assert kv.rebuilds >= 3 and kv.base > 0
    for end in (1092, 1100):  # a step of 4 tokens, then one of 8 after a rebuild between them
        lo = end - (4 if end == 1092 else 8)
        kv.make_room(lo, end)
        reference = ResidentOnly(kv, CONTEXT)
        if family == "qwen3.5":  # the recurrent states, as the bounded run left them
            reference = copy.copy(cache)
            reference.kv = ResidentOnly(kv, CONTEXT)
            states = [s.clone() for s in cache.volatile()]
        positions = torch.arange(lo, end)
        theirs = target(ids[:, lo:end], positions, reference, end)[0]
        if family == "qwen3.5":
            for state, saved in zip(cache.volatile(), states):
                state.copy_(saved)
        ours = target(ids[:, lo:end], positions, cache, end)[0]
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
