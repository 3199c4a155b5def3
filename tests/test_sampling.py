"""Sampling: validation, reproducibility, allowed sets, and the output distribution of plain and
speculative decoding against the target's exact distribution (helpers.sampled_distribution_check)."""

from dataclasses import replace

import pytest
import torch
from helpers import (
    DistributionCheck,
    drafter_config,
    reference_probs,
    sampled_distribution_check,
    sequence_probs,
    tiny_drafter,
    tiny_target,
    tiny_tokenizer,
)

from deepflash.engine.config import EngineConfig
from deepflash.engine.engine import Engine
from deepflash.engine.sampling import SamplingParams, adjusted_logits, choose
from deepflash.errors import UserError


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(temperature=float("nan")), dict(top_p=0),
                                 dict(top_p=1.5), dict(top_k=-1), dict(max_new_tokens=0), dict(seed=-3),
                                 dict(stop=("",))])
def test_invalid_values_are_refused(bad):
    with pytest.raises(UserError):
        SamplingParams(**bad).validated()


def test_seeded_choice_is_reproducible_and_seed_dependent():
    logits = torch.randn(6, 50)
    pos = torch.arange(10, 16)
    p = SamplingParams(temperature=1.0, seed=7)
    assert torch.equal(choose(logits, pos, p), choose(logits, pos, p))
    draws = {tuple(choose(logits, pos, SamplingParams(temperature=1.0, seed=s)).tolist()) for s in range(20)}
    assert len(draws) > 10


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.3), (8, 0.6)])
def test_samples_stay_in_the_allowed_set(top_k, top_p):
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(0)) * 3
    params = SamplingParams(temperature=1.3, top_k=top_k, top_p=top_p)
    allowed = torch.isfinite(adjusted_logits(logits, params))[0]
    if top_k:
        assert allowed.sum() <= top_k
    for seed in range(300):
        tok = choose(logits, torch.tensor([3]), SamplingParams(temperature=1.3, top_k=top_k, top_p=top_p, seed=seed))
        assert allowed[tok]


def test_top_p_keeps_the_crossing_token():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    allowed = torch.isfinite(adjusted_logits(logits, SamplingParams(temperature=1.0, top_p=0.7)))[0]
    assert allowed.tolist() == [True, True, False, False]


# temperature above 1, a top-k and a top-p cut that each drop mass: a sampler that ignores any of them
# fails the distribution checks (DistributionCheck in tests/helpers.py)
SAMPLED = SamplingParams(temperature=1.5, top_k=6, top_p=0.9)


def test_choices_follow_the_reference_distribution():
    """choose over 4096 positions x 5 seeds of one row of logits: the tokens follow reference_probs, and
    pairs of tokens at neighbouring positions, and under neighbouring seeds, follow the product
    distribution: noise hashed from (seed, position, token) acts as fresh noise for each. (A temperature
    5% off fails it.)"""
    logits = torch.randn(16, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 4
    probs = reference_probs(logits, SAMPLED).tolist()
    positions = torch.arange(4096)
    draws = torch.stack([choose(logits.expand(4096, 16), positions, replace(SAMPLED, seed=s)) for s in range(5)])
    single = {(a,): p for a, p in enumerate(probs)}
    pairs = {(a, b): p * q for a, p in enumerate(probs) for b, q in enumerate(probs)}
    checks = [DistributionCheck([(a,) for a in draws.flatten().tolist()], single),
              DistributionCheck(list(zip(draws[:, :-1].flatten().tolist(), draws[:, 1:].flatten().tolist())), pairs),
              DistributionCheck(list(zip(draws[:-1].flatten().tolist(), draws[1:].flatten().tolist())), pairs)]
    for check in checks:
        assert check.p_value > 1e-4, check


def test_distribution_check_rejects_wrong_samplers():
    """The engine tests' check at their sample size: 300 draws of four tokens from the exact distribution
    pass it; 300 from a sampler 15% too cold, one without its top-p cut, or one blind to the tokens
    before it (each position drawn from its marginal) fail it."""
    target = tiny_target(vocab_size=10, std=0.5, seed=3)
    prompt = [4, 7, 5]
    exact = sequence_probs(target, prompt, 4, SAMPLED)
    marginals = [{} for _ in range(4)]
    for seq, p in exact.items():
        for k, token in enumerate(seq):
            marginals[k][token] = marginals[k].get(token, 0.0) + p
    blind = {(): 1.0}
    for marginal in marginals:
        blind = {seq + (t,): p * q for seq, p in blind.items() for t, q in marginal.items()}

    def draws(probs: dict) -> list[tuple[int, ...]]:
        cells = list(probs)
        picks = torch.multinomial(torch.tensor([probs[c] for c in cells]), 300, replacement=True,
                                  generator=torch.Generator().manual_seed(0))
        return [cells[i] for i in picks.tolist()]

    assert DistributionCheck(draws(exact), exact).p_value > 1e-4
    for wrong in (sequence_probs(target, prompt, 4, replace(SAMPLED, temperature=1.5 * 0.85), margin=0),
                  sequence_probs(target, prompt, 4, replace(SAMPLED, top_p=1.0), margin=0), blind):
        check = DistributionCheck(draws(wrong), exact)
        assert check.p_value <= 1e-4, check


@pytest.mark.parametrize("use_drafter", [False, True])
def test_output_distribution_matches_target(use_drafter, monkeypatch):
    """Over 300 seeds, the first four generated tokens follow the target's exact distribution (computed
    apart from the engine's sampling code). With a drafter proposing the most likely tokens, the first
    verify step accepts none, one, two or all three of its drafts, and later tokens come from the steps
    after it."""
    target = tiny_target(vocab_size=10, std=0.5, seed=3)
    drafter = tiny_drafter(drafter_config(target.cfg, block_size=4), std=0.5) if use_drafter else None
    engine = Engine(target, tiny_tokenizer(10), drafter, config=EngineConfig(spec="on"))
    check = sampled_distribution_check(engine, monkeypatch, SAMPLED, 300, propose_modes=use_drafter)
    assert check.p_value > 1e-4, check
    if use_drafter:  # every acceptance length ran
        assert all(check.accepted.count(n) >= 20 for n in range(4)), check.accepted
