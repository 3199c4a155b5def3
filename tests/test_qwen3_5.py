"""Qwen3.5 / Qwen3.6 hybrid targets (Gated DeltaNet + gated attention, dense and MoE): parity with
transformers, the two delta-rule forms, exact rollback of the recurrent states (capture and replay),
the speculative contract on hybrid targets, and loading saved checkpoints."""

import pytest
import torch
from helpers import (
    VOCAB,
    check_left_padded_batch,
    drafter_config,
    hf_qwen35,
    hybrid_target,
    oracle,
    sampled_distribution_check,
    tiny_drafter,
    tiny_tokenizer,
)

from deepflash.engine.config import EngineConfig
from deepflash.engine.engine import Engine
from deepflash.engine.sampling import SamplingParams
from deepflash.errors import UserError
from deepflash.loading.targets import build_from_state, load_target
from deepflash.models.config import ModelConfig
from deepflash.models.delta_rule import chunked_form, recurrent_form, state_after_prefix
from deepflash.models.gated_deltanet import l2_normalize

TOL = 1e-4
def hf_pair(kind: str, **overrides):
    """A transformers model with random weights (norm offsets included) and ours loaded from its state dict."""
    hf = hf_qwen35(kind, **overrides)
    ours = build_from_state(ModelConfig.from_hf(hf.config.to_dict()), dict(hf.state_dict()), "cpu", torch.float32)
    return hf, ours


def ids(n: int, seed: int, high: int = 128) -> torch.Tensor:
    return torch.randint(5, high, (1, n), generator=torch.Generator().manual_seed(seed))


def run_chunks(model, tokens, sizes, cache):
    """Feed tokens in chunks of the given sizes; returns the logits of all positions."""
    out, p = [], 0
    for size in sizes:
        out.append(model(tokens[:, p : p + size], torch.arange(p, p + size), cache)[0])
        p += size
    return torch.cat(out, dim=1)


# --- parity with transformers --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_logits_and_features_match_transformers(kind):
    hf, ours = hf_pair(kind)
    tokens = ids(80, 1)  # 80 > 64: the chunked form runs over two chunks
    with torch.no_grad():
        ref = hf(tokens, output_hidden_states=True)
        logits, feats = ours(tokens, torch.arange(80), ours.new_cache(1, 128), capture=(1, 2, 4))
        assert (logits - ref.logits).abs().max() <= TOL
        # a DeltaNet and an attention layer tap (HF hidden_states[i+1]); the last layer's is the normed state
        want = torch.cat([ref.hidden_states[2], ref.hidden_states[3], ref.hidden_states[5]], dim=-1)
        assert (feats - want).abs().max() <= TOL
        decode = run_chunks(ours, tokens, [10] + [1] * 30, ours.new_cache(1, 128))
        assert (decode - ref.logits[:, :40]).abs().max() <= TOL
        mixed = run_chunks(ours, tokens, [7, 3, 1, 5, 16, 2, 20, 26], ours.new_cache(1, 128))
        assert (mixed - ref.logits).abs().max() <= TOL


def test_forms_agree():
    """Recurrent and chunked forms (several chunks, a ragged tail) and the closed-form prefix state."""
    gen = torch.Generator().manual_seed(0)
    b, h, t, dk, dv = 2, 3, 21, 8, 5

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = l2_normalize(randn(b, h, t, dk)) / dk**0.5, l2_normalize(randn(b, h, t, dk)), randn(b, h, t, dv)
    g = -2 * torch.rand(b, h, t, generator=gen, dtype=torch.float64)
    beta = torch.rand(b, h, t, generator=gen, dtype=torch.float64)
    start = randn(b, h, dk, dv)
    rec = recurrent_form(q, k, v, g, beta, start)
    chunked = chunked_form(q, k, v, g, beta, start, chunk=8)
    for a, c in zip(rec, chunked):
        assert (a - c).abs().max() < 1e-12
    assert torch.equal(state_after_prefix(k, g, rec[2], start, 0), start)
    for n in range(1, t + 1):
        fed = recurrent_form(q[:, :, :n], k[:, :, :n], v[:, :, :n], g[:, :, :n], beta[:, :, :n], start)[1]
        assert (state_after_prefix(k, g, rec[2], start, n) - fed).abs().max() < 1e-12


@pytest.mark.parametrize("cuda", [False, True])
def test_auto_kernels_are_triton_on_cuda(monkeypatch, cuda):
    """Under "auto" every layer with a Triton form takes it on CUDA (a verify and its rollback compute each
    token as decode does) and none on the CPU."""
    from deepflash.kernels import triton_support

    monkeypatch.setattr(triton_support, "usable", lambda device: cuda)  # as on a CUDA device with Triton
    monkeypatch.setattr(triton_support, "require", lambda: None)  # CI's torch has no Triton
    target = hybrid_target("moe").use_kernels("auto")
    chosen = {(type(m).__name__, m.kernels is not None) for m in target.modules() if hasattr(m, "kernels")}
    names = {"GatedDeltaNet", "MLP", "Experts", "Qwen35Model", "GatedAttention", "SharedExpertMoe", "OffsetRMSNorm",
             "GatedRMSNorm", "DecoderLayer"}
    assert chosen == {(name, cuda) for name in names}


# --- exact rollback --------------------------------------------------------------------------------------
@pytest.mark.parametrize("rollback", ["capture", "replay"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_keep_equals_feeding_the_kept_tokens(kind, rollback):
    """verify over 9 tokens, keep(n): conv and recurrent states equal a cache fed exactly the n tokens,
    and the next forward's logits agree."""
    _, ours = hf_pair(kind)
    prefix, block, cont = ids(12, 2), ids(9, 3), ids(4, 4)
    with torch.no_grad():
        for n in (0, 1, 4, 8, 9):
            cache = ours.new_cache(1, 64, rollback=rollback)
            ours(prefix, torch.arange(12), cache)
            ours(block, torch.arange(12, 21), cache)
            cache.keep(n)
            fed = ours.new_cache(1, 64)
            run_chunks(ours, torch.cat([prefix, block[:, :n]], dim=1), [12] + [1] * n, fed)
            for mine, want in zip(cache.conv + cache.state, fed.conv + fed.state):
                assert (mine - want).abs().max() <= 1e-5
            after = ours(cont, torch.arange(12 + n, 16 + n), cache)[0]
            assert (after - ours(cont, torch.arange(12 + n, 16 + n), fed)[0]).abs().max() <= TOL


def test_position_zero_starts_a_new_sequence():
    """Like KV slots, DeltaNet states need no reset between sequences: a forward at position 0 starts
    from zero states, on a cache used before (one-token prompts take a different path than longer ones)."""
    _, ours = hf_pair("dense")
    used = ours.new_cache(1, 64)
    with torch.no_grad():
        for sizes in ([1] * 6, [3, 1, 2]):
            ours(ids(20, 1), torch.arange(20), used)
            again = run_chunks(ours, ids(6, 2), sizes, used)
            fresh = run_chunks(ours, ids(6, 2), sizes, ours.new_cache(1, 64))
            assert (again - fresh).abs().max() <= 1e-6


def test_keep_refuses_what_it_cannot_roll_back():
    _, ours = hf_pair("dense")
    cache = ours.new_cache(1, 64, rollback_tokens=8)
    with torch.no_grad():
        ours(ids(12, 1), torch.arange(12), cache)  # longer than rollback_tokens: not recorded
        with pytest.raises(RuntimeError):
            cache.keep(3)
        ours(ids(1, 2), torch.tensor([12]), cache)  # a decode step
        cache.keep(1)  # keeping everything is always fine
        with pytest.raises(RuntimeError):
            cache.keep(0)
        ours(ids(4, 3), torch.arange(13, 17), cache)
        with pytest.raises(ValueError):
            cache.keep(5)
    with pytest.raises(UserError):
        ours.new_cache(1, 64, rollback="rewind")


# --- the speculative contract on hybrid targets -------------------------------------------------------------
TOKENIZER = tiny_tokenizer()


def greedy(target, prompt: list[int], new_tokens: int, drafter=None, block: int = 1, rollback="capture"):
    """Greedy token ids of a plain (no drafter) or speculative engine; end tokens do not stop it."""
    engine = Engine(target, TOKENIZER, drafter, config=EngineConfig(block_size=block if drafter else None, spec="on"))
    engine.stop_ids = frozenset()
    if drafter is not None:
        engine.cache = engine.steps.cache = target.new_cache(1, engine.max_ctx, rollback=rollback)
    return engine.complete(prompt, SamplingParams(max_new_tokens=new_tokens))


@pytest.mark.parametrize("rollback", ["capture", "replay"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_speculative_equals_plain(kind, rollback):
    """A random drafter at every block size 2..16 (its drafts are mostly rejected)."""
    target = hybrid_target(kind)
    drafter = tiny_drafter(drafter_config(target.cfg, taps=(1, 3)))
    prompt = ids(19, 19, high=90)[0].tolist()
    want = greedy(target, prompt, 10).token_ids
    assert len(set(want)) > 5  # a non-degenerate continuation
    for block in range(2, 17):
        assert greedy(target, prompt, 10, drafter, block, rollback).token_ids == want, block


@pytest.mark.parametrize("rollback", ["capture", "replay"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_every_accepted_length_rolls_back_exactly(monkeypatch, kind, rollback):
    target = hybrid_target(kind)
    drafter = tiny_drafter(drafter_config(target.cfg, taps=(1, 3)))
    prompt = ids(9, 9, high=90)[0].tolist()
    want = greedy(target, prompt, 60).token_ids
    accepted = set()
    for block, wrong_every in ((16, 0), (16, 11), (16, 13), (16, 17), (5, 3)):
        oracle(monkeypatch, want, len(prompt), wrong_every)
        got = greedy(target, prompt, 60, drafter, block, rollback)
        assert got.token_ids == want, (block, wrong_every)
        accepted |= {n for n, steps in enumerate(got.spec.histogram) if steps}
    assert accepted == set(range(16))  # every keep(n + 1) of a 16-block, full rejection included


def test_sampled_output_distribution_matches_target(monkeypatch):
    """As tests/test_sampling.py: over 200 seeds the first four sampled tokens follow the target's exact
    distribution when the drafter proposes the most likely tokens, so that the first verify step accepts
    none, one, two or all three drafts (a recurrent state left holding a rejected draft would change the
    tokens after it)."""
    target = hybrid_target("dense", vocab_size=10, std=0.5, seed=3)
    engine = Engine(target, tiny_tokenizer(10), tiny_drafter(drafter_config(target.cfg, block_size=4)),
                    EngineConfig(spec="on"))
    params = SamplingParams(temperature=1.5, top_k=6, top_p=0.9)
    check = sampled_distribution_check(engine, monkeypatch, params, 200, propose_modes=True)
    assert check.p_value > 1e-4, check
    assert all(check.accepted.count(n) >= 5 for n in range(4)), check.accepted


def test_left_padded_batch_matches_single_rows():
    _, ours = hf_pair("moe")
    check_left_padded_batch(ours, VOCAB, TOL)


# --- checkpoints -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_saved_checkpoint_generates_like_transformers(tmp_path, kind):
    """save_pretrained -> load_target; greedy plain and speculative output == transformers' generate."""
    hf, _ = hf_pair(kind, vocab_size=VOCAB)
    hf.save_pretrained(tmp_path)
    target, _ = load_target(str(tmp_path))
    prompt = ids(9, 7, high=90)
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    want = ref[0, 9:].tolist()
    engine = Engine(target, TOKENIZER)
    engine.stop_ids = frozenset()
    assert engine.complete(prompt[0].tolist(), SamplingParams(max_new_tokens=20)).token_ids == want
    spec = Engine(target, TOKENIZER, tiny_drafter(drafter_config(target.cfg), dtype=torch.float32), config=EngineConfig(block_size=5, spec="on"))
    spec.stop_ids = frozenset()
    assert spec.complete(prompt[0].tolist(), SamplingParams(max_new_tokens=20)).token_ids == want


def test_multimodal_checkpoint_names():
    """A ForConditionalGeneration checkpoint: nested text_config, model.language_model.* names, vision tower
    and multi-token-prediction weights that the target does not use."""
    hf, ours = hf_pair("dense")
    state = {k.replace("model.", "model.language_model.", 1): v for k, v in hf.state_dict().items()}
    state["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    state["mtp.fc.weight"] = torch.zeros(3, 3)
    text = hf.config.to_dict()
    cfg = ModelConfig.from_hf({"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": False})
    loaded = build_from_state(cfg, state, "cpu", torch.float32)
    tokens = ids(12, 8)
    with torch.no_grad():
        assert torch.equal(loaded(tokens, torch.arange(12), loaded.new_cache(1, 16))[0],
                           ours(tokens, torch.arange(12), ours.new_cache(1, 16))[0])


def test_cost_accounting():
    _, ours = hf_pair("moe")
    cfg = ours.cfg
    assert ours.attention_layer_count() == 2
    assert ours.kv_bytes_per_token() == 2 * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    # per DeltaNet layer: conv state (K-1 inputs of q, k, v channels) + recurrent state (Hv x Dk x Dv),
    # and their copy from the start of the last verify
    assert ours.state_bytes(2) == 2 * 3 * 2 * ((2 * 2 * 16 + 4 * 8) * 3 + 4 * 16 * 8) * 4
    cache = ours.new_cache(2, 32)
    assert cache.nbytes == ours.kv_bytes_per_token() * 32 * 2 + ours.state_bytes(2)
    assert ours.decode_weight_bytes() < ours.weight_bytes()  # only routed experts are read


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fla kernels run on CUDA only")
def test_fla_kernels_agree_with_the_torch_forms():
    """The flash-linear-attention Triton kernels against our chunked and recurrent forms (GPU run:
    carry the fla-core wheel, see scripts/gpu/wheels.sh)."""
    from deepflash.models.delta_rule import fla_available, fla_form

    device = torch.device("cuda")
    if not fla_available(device):
        pytest.skip("flash-linear-attention (fla-core) is not installed")
    gen = torch.Generator(device="cpu").manual_seed(0)
    b, t, h, dk, dv = 1, 37, 4, 64, 64
    q, k = (torch.randn(b, t, h, dk, generator=gen).to(device) for _ in range(2))
    v = torch.randn(b, t, h, dv, generator=gen).to(device)
    g = -torch.rand(b, t, h, generator=gen).to(device)
    beta = torch.rand(b, t, h, generator=gen).to(device)
    state = torch.randn(b, h, dk, dv, generator=gen).to(device) * 0.1
    qt, kt, vt, gt, bt = (x.transpose(1, 2) for x in (q, k, v, g, beta))
    qn = l2_normalize(qt) / dk**0.5
    kn = l2_normalize(kt)
    for recurrent, form in ((False, chunked_form), (True, recurrent_form)):
        out, final = fla_form(q, k, v, g, beta, state.clone(), recurrent=recurrent)
        ref_out, ref_final, _ = form(qn, kn, vt, gt, bt, state.clone())
        assert (out.transpose(1, 2) - ref_out).abs().max() < 2e-3
        assert (final - ref_final).abs().max() < 2e-3
