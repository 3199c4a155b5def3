"""The Triton gated delta rule (kernels/delta_rule.py) against the torch recurrence, a verify's tokens computed
bit for bit as decode steps compute them, its deltas rolling a run back, and the greedy contract of a hybrid
target on the Triton kernels (on the CPU in Triton's interpreter: helpers.triton_device)."""

import pytest
import torch
from helpers import (
    drafter_config,
    hybrid_target,
    tiny_drafter,
    tiny_tokenizer,
    triton_device,
)

from deepflash.engine.config import EngineConfig
from deepflash.engine.engine import Engine
from deepflash.engine.sampling import SamplingParams
from deepflash.kernels import delta_rule
from deepflash.models.delta_rule import recurrent_form, state_after_prefix
from deepflash.models.gated_deltanet import l2_normalize

DEVICE = triton_device()


def run_inputs(tokens: int, key_dim: int = 16, value_dim: int = 8, batch: int = 2, heads: int = 3, seed: int = 0):
    """q, k, v, g, beta of a run and a random start state, as GatedDeltaNet hands them to the delta rule."""
    gen = torch.Generator().manual_seed(seed)
    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE)

    q = l2_normalize(rand(batch, heads, tokens, key_dim)) / key_dim**0.5
    k = l2_normalize(rand(batch, heads, tokens, key_dim))
    v = rand(batch, heads, tokens, value_dim)
    g = -torch.rand(batch, heads, tokens, generator=gen).to(DEVICE)  # log-space decays in (-1, 0]
    beta = torch.rand(batch, heads, tokens, generator=gen).to(DEVICE)
    return (q, k, v, g, beta), rand(batch, heads, key_dim, value_dim)


def tokens_of(inputs, lo: int, hi: int):
    """Tokens lo..hi-1 of a run's inputs, in tensors of their own as a step of that many tokens has them."""
    return tuple(x[:, :, lo:hi].contiguous() for x in inputs)


# Dk 12 / Dv 20: rows padded to a power of two, and column blocks of which the last is partly outside
@pytest.mark.parametrize("key_dim, value_dim", [(16, 8), (12, 20)])
@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_kernel_matches_the_recurrent_form(tokens, key_dim, value_dim):
    inputs, start = run_inputs(tokens, key_dim, value_dim)
    got = delta_rule.recurrent(*inputs, start)
    want = recurrent_form(*inputs, start)
    for name, a, b in zip(("out", "state", "deltas"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_a_verified_token_is_computed_exactly_as_a_decoded_one():
    """16 one-token runs, each from the state the last left (decode steps), give the bits of one 16-token run."""
    inputs, start = run_inputs(16)
    out, final, deltas = delta_rule.recurrent(*inputs, start)
    state = start
    for t in range(16):
        step_out, state, step_delta = delta_rule.recurrent(*tokens_of(inputs, t, t + 1), state)
        assert torch.equal(step_out[:, :, 0], out[:, :, t]) and torch.equal(step_delta[:, :, 0], deltas[:, :, t]), t
    assert torch.equal(state, final)


def test_a_sequences_first_token_forgets_the_state():
    """Decode's first token has g = -inf (GatedDeltaNet.forward): from any state it computes what it does
    from an empty one."""
    (q, k, v, g, beta), start = run_inputs(1)
    forgetting = delta_rule.recurrent(q, k, v, torch.full_like(g, float("-inf")), beta, start)
    empty = delta_rule.recurrent(q, k, v, torch.zeros_like(g), beta, torch.zeros_like(start))
    assert all(torch.equal(a, b) for a, b in zip(forgetting, empty))


def test_deltas_roll_a_run_back_to_any_prefix():
    """state_after_prefix (the capture rollback) on the kernel's deltas is the state of the kernel run on the prefix."""
    inputs, start = run_inputs(16)
    _, _, deltas = delta_rule.recurrent(*inputs, start)
    _, k, _, g, _ = inputs
    for n in range(17):
        rebuilt = state_after_prefix(start, k, g.cumsum(-1), deltas, n)
        prefix = delta_rule.recurrent(*tokens_of(inputs, 0, n), start)[1] if n else start
        torch.testing.assert_close(rebuilt, prefix, rtol=1e-5, atol=1e-5, msg=f"n = {n}")


def test_fits_only_float32_states_and_short_runs():
    state = torch.zeros(1, 2, 128, 128)
    assert delta_rule.fits(state, 1) and delta_rule.fits(state, 16)
    assert not delta_rule.fits(state, 17)  # a prefill chunk: the chunked forms
    assert not delta_rule.fits(state.double(), 1)  # float64 models keep the torch forms
    assert not delta_rule.fits(torch.zeros(1, 2, 512, 128), 1)  # wider than the register tile


def test_greedy_speculative_equals_plain_on_the_kernel(monkeypatch):
    """A hybrid target on the Triton kernels: a random drafter's blocks of 4 are mostly rejected, so the
    capture rollback rebuilds the states from the kernel's deltas; decode and verify both run the kernel."""
    target = hybrid_target("dense", dtype=torch.float32).to(DEVICE)
    drafter = tiny_drafter(drafter_config(target.cfg, taps=(1, 3)), dtype=torch.float32).to(DEVICE)
    runs = []
    kernel = delta_rule.recurrent
    def counted(q, *rest):
        runs.append(q.shape[2])
        return kernel(q, *rest)

    monkeypatch.setattr(delta_rule, "recurrent", counted)
    prompt = torch.randint(5, 90, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_new_tokens=10)
    def greedy(drafter=None):
        config = EngineConfig(spec="on", target_kernels="triton", block_size=4 if drafter else None)
        engine = Engine(target, tiny_tokenizer(), drafter, config)
        engine.stop_ids = frozenset()  # end tokens do not stop it
        return engine.complete(prompt, params)

    plain = greedy()
    assert 1 in runs and 4 not in runs
    runs.clear()
    spec = greedy(drafter)
    assert spec.token_ids == plain.token_ids and len(set(plain.token_ids)) > 3
    assert 4 in runs and sum(spec.spec.histogram[:3]) > 0  # verify blocks ran on the kernel, some rolled back
