"""Sampling: validation, reproducibility, allowed sets, and the output distribution of plain and
speculative decoding against the target's exact distribution (chi-square)."""

import pytest
import torch
from helpers import drafter_config, third_token_check, tiny_drafter, tiny_target, tiny_tokenizer

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


@pytest.mark.parametrize("use_drafter", [False, True])
def test_output_distribution_matches_target(use_drafter, monkeypatch):
    """Over many seeds, the third generated token follows the target's exact three-step distribution.
    With a drafter, that token comes from a verify step that may or may not have accepted a draft."""
    target = tiny_target(vocab_size=10, std=0.5, seed=3)
    drafter = tiny_drafter(drafter_config(target.cfg, block_size=4), std=0.5) if use_drafter else None
    engine = Engine(target, tiny_tokenizer(10), drafter, spec="on")
    p_value, accepted = third_token_check(engine, monkeypatch, 1200, propose_modes=use_drafter)
    assert p_value > 1e-3
    if use_drafter:
        assert accepted > 50  # the speculative acceptance path was exercised
