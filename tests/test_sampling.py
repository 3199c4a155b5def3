"""Sampling: validation, reproducibility, allowed sets, and the output distribution of plain and
speculative decoding against the target's exact distribution (chi-square)."""

import math

import pytest
import torch

import deepflash.spec as spec_module
from deepflash.engine import Engine
from deepflash.errors import UserError
from deepflash.sampling import SamplingParams, adjusted_logits, choose, target_probs
from helpers import drafter_config, tiny_drafter, tiny_target, tiny_tokenizer


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


def chi_square_p(counts: dict, probs: torch.Tensor, n: int) -> float:
    """p-value of observed counts against expected probabilities (bins with expectation < 5 merged)."""
    expected = probs * n
    big = expected >= 5
    obs = torch.tensor([counts.get(i, 0) for i in range(len(probs))], dtype=torch.float64)
    o = torch.cat([obs[big], obs[~big].sum()[None]])
    e = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = e > 0
    stat = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty approximation of the chi-square survival function
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("use_drafter", [False, True])
def test_output_distribution_matches_target(use_drafter, monkeypatch):
    """Over many seeds, the third generated token follows the target's exact three-step distribution.
    With a drafter, that token comes from a verify step that may or may not have accepted a draft; the
    drafter always proposes the most likely third token, so drafts are often (not always) accepted."""
    vocab = 10
    target = tiny_target(vocab_size=vocab, std=0.5, seed=3)
    drafter = tiny_drafter(drafter_config(target.cfg, block_size=4), std=0.5) if use_drafter else None
    engine = Engine(target, tiny_tokenizer(vocab), drafter, spec="on")
    engine.stop_ids = frozenset()  # every run yields exactly three tokens
    prompt = [4, 7, 5]
    params = SamplingParams(temperature=0.9, top_k=6, max_new_tokens=3)

    def probs(ids):
        with torch.no_grad():
            logits = target(torch.tensor([ids]), torch.arange(len(ids)), target.new_cache(1, 8))[0][0, -1]
        return target_probs(logits, params).double()

    second = torch.zeros(vocab, dtype=torch.float64)
    third = torch.zeros(vocab, dtype=torch.float64)
    p1 = probs(prompt)
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = probs(prompt + [t1])
        second += p1[t1] * p2
        for t2 in torch.nonzero(p2).flatten().tolist():
            third += p1[t1] * p2[t2] * probs(prompt + [t1, t2])
    if use_drafter:  # propose each position's most likely token
        modes = {len(prompt) + 1: int(second.argmax()), len(prompt) + 2: int(third.argmax())}
        monkeypatch.setattr(spec_module, "propose", lambda d, t, c, last, q_pos: torch.tensor(
            [modes.get(int(q_pos[0]) + k, 0) for k in range(1, q_pos.shape[0])]))
    n = 1200
    counts: dict[int, int] = {}
    accepted = 0
    for seed in range(n):
        out = engine.complete(prompt, SamplingParams(temperature=0.9, top_k=6, max_new_tokens=3, seed=seed))
        counts[out.token_ids[2]] = counts.get(out.token_ids[2], 0) + 1
        accepted += out.spec.accepted_tokens if use_drafter else 0
    assert chi_square_p(counts, third, n) > 1e-3
    if use_drafter:
        assert accepted > 50  # the speculative acceptance path was exercised
