"""Penalties and log-probabilities: computed as their definitions say, and speculation changes neither the
output under penalties nor the reported log-probabilities (plain decoding's, token for token)."""

import pytest
import torch
from helpers import drafter_config, oracle, tiny_drafter, tiny_target, tiny_tokenizer

from deepflash.engine.config import EngineConfig
from deepflash.engine.engine import Engine
from deepflash.engine.penalties import TokenCounts, penalize
from deepflash.engine.sampling import SamplingBuffers, SamplingParams
from deepflash.errors import UserError

TARGET = tiny_target()
TOKENIZER = tiny_tokenizer()
PENALTIES = [dict(presence_penalty=1.5), dict(frequency_penalty=0.7), dict(repetition_penalty=1.4),
             dict(repetition_penalty=0.6, presence_penalty=-0.5, frequency_penalty=0.3)]


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(5, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_penalize_follows_the_definitions():
    """Repetition (transformers' rule) on every token of the prompt or the output, then presence and
    frequency (OpenAI's) on the output's, written out per token."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 12, generator=gen) * 3
    generated = torch.randint(0, 3, (3, 12), generator=gen, dtype=torch.int32)
    prompt_ids = torch.tensor([1, 4, 7])
    counts = TokenCounts(12, "cpu")
    counts.reset(prompt_ids)
    params = SamplingParams(presence_penalty=0.4, frequency_penalty=0.25, repetition_penalty=1.3)
    got = penalize(logits, generated, counts.prompt, SamplingBuffers.of(params, "cpu"))
    for row in range(3):
        for token in range(12):
            want = logits[row, token].item()
            if token in prompt_ids.tolist() or generated[row, token] > 0:
                want = want / 1.3 if want > 0 else want * 1.3
            want -= 0.25 * generated[row, token].item() + 0.4 * (generated[row, token].item() > 0)
            assert got[row, token].item() == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_counts_before_each_choice_of_a_block_and_after_its_commit():
    """Row k of a block's counts includes the block's tokens up to k; the commit counts the kept ones."""
    counts = TokenCounts(6, "cpu")
    counts.reset(torch.tensor([0]))
    counts.commit(torch.tensor([2, 2]), 2)
    fed = torch.tensor([3, 2, 5])
    rows = counts.before(fed)
    assert rows.tolist() == [[0, 0, 2, 1, 0, 0], [0, 0, 3, 1, 0, 0], [0, 0, 3, 1, 0, 1]]
    counts.commit(fed, torch.tensor(2))  # the first two kept
    assert counts.generated.tolist() == [0, 0, 3, 1, 0, 0] and counts.before(None).tolist() == [[0, 0, 3, 1, 0, 0]]


@pytest.mark.parametrize("penalties", PENALTIES)
@pytest.mark.parametrize("drafts", ["random", "mostly right"])
def test_greedy_speculative_equals_plain_under_penalties(penalties, drafts, monkeypatch):
    """Each block position chooses with the counts plain decoding has there: drafts that are plain
    decoding's own tokens (now and then spoiled) make long accepted runs whose choices depend on them."""
    ids = prompt(12, seed=1)
    params = SamplingParams(max_new_tokens=40, **penalties)
    plain = Engine(TARGET, TOKENIZER).complete(ids, params)
    assert plain.token_ids != Engine(TARGET, TOKENIZER).complete(ids, SamplingParams(max_new_tokens=40)).token_ids
    if drafts == "mostly right":
        oracle(monkeypatch, plain.token_ids, len(ids), wrong_every=4)
    drafter = tiny_drafter(drafter_config(TARGET.cfg))
    spec = Engine(TARGET, TOKENIZER, drafter, config=EngineConfig(spec="on", block_size=6)).complete(ids, params)
    assert spec.token_ids == plain.token_ids
    if drafts == "mostly right":
        assert max(spec.spec.histogram[2:]) > 0


def test_sampled_speculative_equals_plain_under_penalties(monkeypatch):
    ids = prompt(10, seed=2)
    params = SamplingParams(max_new_tokens=30, temperature=0.9, top_k=20, seed=5, repetition_penalty=1.2,
                            presence_penalty=0.8)
    plain = Engine(TARGET, TOKENIZER).complete(ids, params)
    oracle(monkeypatch, plain.token_ids, len(ids), wrong_every=3)
    drafter = tiny_drafter(drafter_config(TARGET.cfg))
    assert Engine(TARGET, TOKENIZER, drafter, config=EngineConfig(spec="on")).complete(ids, params).token_ids \
        == plain.token_ids


@pytest.mark.parametrize("top", [0, 3])
def test_logprobs_are_the_target_distribution_and_speculation_keeps_them(top, monkeypatch):
    """Each output token's log-probability (and the top alternatives') is the log-softmax of the target's
    logits at its position, the same from speculative and plain decoding."""
    ids = prompt(9, seed=3)
    params = SamplingParams(max_new_tokens=20, logprobs=top, temperature=1.0, seed=7)
    plain = Engine(TARGET, TOKENIZER).complete(ids, params)
    assert len(plain.logprobs) == len(plain.token_ids)
    with torch.no_grad():
        full = ids + plain.token_ids
        logits, _ = TARGET(torch.tensor(full)[None], torch.arange(len(full)), TARGET.new_cache(1, 64))
    reference = logits[0, len(ids) - 1 : -1].float().log_softmax(-1)
    for i, entry in enumerate(plain.logprobs):
        assert entry.token == plain.token_ids[i]
        assert entry.logprob == pytest.approx(reference[i, entry.token].item(), abs=1e-5)
        best = reference[i].topk(top)
        assert [t for t, _ in entry.top] == best.indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(best.values.tolist(), abs=1e-5)
    oracle(monkeypatch, plain.token_ids, len(ids), wrong_every=4)
    drafter = tiny_drafter(drafter_config(TARGET.cfg))
    spec = Engine(TARGET, TOKENIZER, drafter, config=EngineConfig(spec="on")).complete(ids, params)
    assert spec.token_ids == plain.token_ids
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-6)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_chunks_carry_their_tokens_logprobs():
    params = SamplingParams(max_new_tokens=12, logprobs=2)
    chunks = list(Engine(TARGET, TOKENIZER).generate(prompt(6), params))
    assert sum(len(c.logprobs) for c in chunks) == len(chunks[-1].result.token_ids)
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    assert chunks[-1].result.logprobs is not None
    assert Engine(TARGET, TOKENIZER).complete(prompt(6), SamplingParams(max_new_tokens=4)).logprobs is None


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                                 dict(logprobs=21), dict(logprobs=-1)])
def test_out_of_range_values_are_refused(bad):
    with pytest.raises(UserError):
        SamplingParams(**bad).validated()
