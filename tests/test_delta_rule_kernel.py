"""The Triton gated delta rule (kernels/delta_rule.py) against the torch recurrence, a verify's tokens computed
bit for bit as decode steps compute them, its replay rolling a run back to the bits of decode steps (alone
and in a hybrid target's cache), and the greedy contract of a hybrid target on the Triton kernels (on the
CPU in Triton's interpreter: helpers.triton_device)."""

import pytest
import torch
from helpers import (
    drafter_config,
    hybrid_target,
    oracle,
    tiny_drafter,
    tiny_tokenizer,
    triton_device,
)

from deepflash.engine.config import EngineConfig
from deepflash.engine.engine import Engine
from deepflash.engine.sampling import SamplingParams
from deepflash.kernels import delta_rule
from deepflash.models.delta_rule import recurrent_form
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
    for name, a, b in zip(("out", "state"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_a_verified_token_is_computed_exactly_as_a_decoded_one():
    """16 one-token runs, each from the state the last left (decode steps), give the bits of one 16-token run."""
    inputs, start = run_inputs(16)
    out, final = delta_rule.recurrent(*inputs, start)
    state = start
    for t in range(16):
        step_out, state = delta_rule.recurrent(*tokens_of(inputs, t, t + 1), state)
        assert torch.equal(step_out[:, :, 0], out[:, :, t]), t
    assert torch.equal(state, final)


def test_a_sequences_first_token_forgets_the_state():
    """Decode's first token has g = -inf (GatedDeltaNet.forward): from any state it computes what it does
    from an empty one."""
    (q, k, v, g, beta), start = run_inputs(1)
    forgetting = delta_rule.recurrent(q, k, v, torch.full_like(g, float("-inf")), beta, start)
    empty = delta_rule.recurrent(q, k, v, torch.zeros_like(g), beta, torch.zeros_like(start))
    assert all(torch.equal(a, b) for a, b in zip(forgetting, empty))


def decoded_states(inputs, start):
    """The states after each prefix of a run, fed as one-token runs (decode steps): [start, after 1, ...]."""
    states = [start]
    for t in range(inputs[0].shape[2]):
        states.append(delta_rule.recurrent(*tokens_of(inputs, t, t + 1), states[-1])[1])
    return states


@pytest.mark.parametrize("tokens", range(2, 17))
def test_replay_rolls_a_run_back_to_the_bits_of_decode_steps(tokens):
    """state_after (the capture rollback on the kernel path) at every n of a T-token run, n an int or a 0-dim
    tensor read on the device, is bit for bit the state n decode steps leave."""
    inputs, start = run_inputs(tokens, seed=tokens)
    _, k, v, g, beta = inputs
    for n, decoded in enumerate(decoded_states(inputs, start)):
        for count in (n, torch.tensor(n, device=DEVICE)):
            assert torch.equal(delta_rule.state_after(k, v, g, beta, start, count), decoded), (n, type(count))


@pytest.mark.parametrize("tokens", [2, 16])
def test_keep_leaves_a_hybrid_targets_states_as_decode_steps_do(monkeypatch, tokens):
    """A hybrid target's verify of T tokens through the kernel, then keep(n) for every n (odd n an int, even n
    a 0-dim tensor as the engine passes it, n = T included): each DeltaNet layer's state is bit for bit what
    n decode steps' kernel runs leave on that verify's inputs (a decode forward would compute those inputs
    with one-row projections, which round apart on the CPU: the kernel's part is what must be exact)."""
    target = hybrid_target("dense", dtype=torch.float32).to(DEVICE).use_kernels("triton")
    prompt, block = (torch.randint(5, 90, (1, size), generator=torch.Generator().manual_seed(size)).to(DEVICE)
                     for size in (12, tokens))
    cache = target.new_cache(1, 64)
    with torch.no_grad():
        target(prompt, torch.arange(12, device=DEVICE), cache)
        before = cache.save_state()
        def verify():
            cache.load_state(before)
            target(block, torch.arange(12, 12 + tokens, device=DEVICE), cache)

        runs = []  # each DeltaNet layer's kernel inputs and start state, in layer order
        kernel = delta_rule.recurrent
        def recorded(*inputs, **options):
            runs.append((inputs[:5], inputs[5].clone()))  # the start: the cache's buffer, updated in place
            return kernel(*inputs, **options)

        monkeypatch.setattr(delta_rule, "recurrent", recorded)
        verify()
        monkeypatch.undo()
        decoded = [decoded_states(inputs, start) for inputs, start in runs]
        assert len(decoded) == target.linear_layer_count()
        for n in range(tokens + 1):
            verify()
            cache.keep(n if n % 2 else torch.tensor(n, device=DEVICE))
            for slot, states in enumerate(decoded):
                assert torch.equal(cache.state[slot], states[n]), (n, slot)


def test_fits_only_float32_states_and_short_runs():
    state = torch.zeros(1, 2, 128, 128)
    assert delta_rule.fits(state, 1) and delta_rule.fits(state, 16)
    assert not delta_rule.fits(state, 17)  # a prefill chunk: the chunked forms
    assert not delta_rule.fits(state.double(), 1)  # float64 models keep the torch forms
    assert not delta_rule.fits(torch.zeros(1, 2, 512, 128), 1)  # wider than the register tile


def test_greedy_speculative_equals_plain_on_the_kernel(monkeypatch):
    """A hybrid target on the Triton kernels: decode and verify both run the kernel, and every rollback
    replays it. A random drafter's blocks of 4 are mostly rejected; the true continuation spoiled now and
    then (helpers.oracle) in blocks of 6 accepts longer prefixes."""
    target = hybrid_target("dense", dtype=torch.float32).to(DEVICE)
    drafter = tiny_drafter(drafter_config(target.cfg, taps=(1, 3)), dtype=torch.float32).to(DEVICE)
    runs, kept = [], []
    recurrent, state_after = delta_rule.recurrent, delta_rule.state_after
    def counted(q, *rest, **options):
        runs.append(q.shape[2])
        return recurrent(q, *rest, **options)

    def replayed(*inputs):
        kept.append(inputs[-1])
        return state_after(*inputs)

    monkeypatch.setattr(delta_rule, "recurrent", counted)
    monkeypatch.setattr(delta_rule, "state_after", replayed)
    prompt = torch.randint(5, 90, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_new_tokens=10)
    def greedy(drafter=None, block=None, graphs=True):
        config = EngineConfig(spec="on", target_kernels="triton", block_size=block, cuda_graphs=graphs)
        engine = Engine(target, tiny_tokenizer(), drafter, config)
        engine.stop_ids = frozenset()  # end tokens do not stop it
        return engine.complete(prompt, params)

    plain = greedy()
    assert 1 in runs and 4 not in runs and not kept
    assert len(set(plain.token_ids)) > 3
    spec = greedy(drafter, 4)
    assert spec.token_ids == plain.token_ids
    assert 4 in runs and sum(spec.spec.histogram[:3]) > 0  # verify blocks ran on the kernel, some rolled back
    oracle(monkeypatch, plain.token_ids, len(prompt), wrong_every=4)
    spec = greedy(drafter, 6, graphs=False)  # the oracle reads positions on the host, which a graph cannot
    assert spec.token_ids == plain.token_ids
    assert sum(spec.spec.histogram[1:5]) > 0  # drafts accepted, the block's rest rolled back
    assert kept and all(isinstance(n, torch.Tensor) for n in kept)  # rollbacks read n on the device
