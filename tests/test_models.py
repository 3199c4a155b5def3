"""Our target models against transformers on tiny random configs (float32, max abs diff <= 1e-4)."""

import gc
import weakref

import pytest
import torch
from helpers import check_left_padded_batch, drafter_config, llama_config, tiny_drafter, tiny_tokenizer

from deepflash.engine.config import EngineConfig
from deepflash.engine.engine import Engine
from deepflash.engine.sampling import SamplingParams
from deepflash.kernels.config import SHIPPED
from deepflash.loading.targets import build_from_state
from deepflash.models import random_model
from deepflash.models.config import ModelConfig, RopeConfig
from deepflash.models.layers import RMSNorm, rope_frequencies

TOL = 1e-4


def hf_pair(kind: str, **extra):
    """A transformers model with random weights and ours loaded from its state dict."""
    import transformers

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=True, rope_scaling=extra.pop("rope_scaling", None))
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**common)
        cls = transformers.Qwen3ForCausalLM
    else:
        cfg = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                          norm_topk_prob=True, mlp_only_layers=[1])
        cls = transformers.Qwen3MoeForCausalLM
    for key, value in extra.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    hf = cls(cfg).eval()
    with torch.no_grad():  # larger weights than the default init make mismatches visible
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.1)
    ours = build_from_state(ModelConfig.from_hf(cfg.to_dict()), dict(hf.state_dict()), "cpu", torch.float32)
    return hf, ours


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe"])
def test_prefill_and_decode_match_transformers(kind):
    hf, ours = hf_pair(kind)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        cache = ours.new_cache(1, 64)
        logits, feats = ours(ids, torch.arange(24), cache, capture=(0, 2))
        assert (logits - ref.logits).abs().max() <= TOL
        # capture of layer 0 is HF hidden_states[1]; the last layer's is the normed state
        want = torch.cat([ref.hidden_states[1], ref.hidden_states[3]], dim=-1)
        assert (feats - want).abs().max() <= TOL
        # prefill 10 then token by token through the cache
        cache = ours.new_cache(1, 64)
        step_logits = [ours(ids[:, :10], torch.arange(10), cache)[0]]
        for p in range(10, 24):
            step_logits.append(ours(ids[:, p : p + 1], torch.tensor([p]), cache)[0])
        assert (torch.cat(step_logits, dim=1) - ref.logits).abs().max() <= TOL


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_decoding_from_rope_tables_matches_transformers(kind):
    """Engines gather rope rows from tables (Rotary.tabulate) instead of computing them per step: the
    rows equal the computed ones and decoding through them still matches transformers."""
    hf, ours = hf_pair(kind)
    positions = torch.tensor([0, 1, 77, 255])
    computed = ours.rotary(positions, torch.float32)
    ours.rotary.tabulate(256, torch.float32)
    for got, want in zip(ours.rotary(positions, torch.float32), computed):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    ours.rotary.tabulate(256, torch.float32)  # again: kept
    with pytest.raises(ValueError, match="rope tables exist"):
        ours.rotary.tabulate(512, torch.float32)  # replacing them would pull them from under captured graphs
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
        cache = ours.new_cache(1, 64)
        logits = [ours(ids[:, :8], torch.arange(8), cache)[0]]
        logits += [ours(ids[:, p : p + 1], torch.tensor([p]), cache)[0] for p in range(8, 20)]
    assert (torch.cat(logits, dim=1) - ref).abs().max() <= TOL


def test_steps_on_the_triton_kernels_build_no_mask_tensor():
    """The decode-attention kernel masks by position: decode and verify steps get the DECODE marker, not
    a mask tensor (6 kernels a step); prefill chunks, key-masked batches and torch's kernels get masks."""
    from deepflash.models.layers import CAUSAL, DECODE

    _, ours = hf_pair("llama")
    step = torch.arange(40, 56)
    assert isinstance(ours.attention_mask(step, 64, None, torch.float32), torch.Tensor)  # torch's kernels
    ours.kernels = SHIPPED  # as use_kernels("triton") sets it (Triton itself is not needed to choose)
    assert ours.attention_mask(step, 64, None, torch.float32) is DECODE
    assert ours.attention_mask(torch.tensor([40]), 256, None, torch.float32) is DECODE
    assert ours.attention_mask(torch.arange(16), 16, None, torch.float32) == CAUSAL  # a first prefill chunk
    assert isinstance(ours.attention_mask(torch.arange(100, 200), 256, None, torch.float32), torch.Tensor)
    key_mask = torch.ones(2, 64, dtype=torch.bool)
    assert ours.attention_mask(step, 64, key_mask, torch.float32).dim() == 4


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_truncate_and_continue(kind):
    """Rollback: write 8 speculative rows, continue from an earlier length with other tokens."""
    hf, ours = hf_pair(kind)
    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, 128, (1, 12), generator=gen)
    junk = torch.randint(0, 128, (1, 8), generator=gen)
    cont = torch.randint(0, 128, (1, 5), generator=gen)
    with torch.no_grad():
        cache = ours.new_cache(1, 64)
        ours(prefix, torch.arange(12), cache)
        ours(junk, torch.arange(12, 20), cache)
        cache.keep(0)
        logits, _ = ours(cont, torch.arange(12, 17), cache)
        ref = hf(torch.cat([prefix, cont], dim=1)).logits[:, 12:]
    assert (logits - ref).abs().max() <= TOL


def test_left_padded_batch_matches_single_rows():
    _, ours = hf_pair("qwen3")
    check_left_padded_batch(ours, 128, TOL)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16, "mscale": 1.0,
     "mscale_all_dim": 0.5},
])
def test_rope_scaling_matches_transformers(scaling):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256,
                                   rope_theta=5000.0, rope_scaling=scaling)
    ref_freq, ref_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
    ours, scale = rope_frequencies(RopeConfig.from_hf(cfg.to_dict()), 16)
    assert torch.allclose(ours, ref_freq, rtol=1e-6) and abs(scale - ref_scale) < 1e-9
    hf, model = hf_pair("llama", rope_scaling=scaling)
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (model(ids, torch.arange(100), model.new_cache(1, 128))[0] - hf(ids).logits).abs().max() <= TOL


def test_rope_scaling_override_is_the_checkpoints_yarn_and_sets_the_positions():
    """--rope-scaling yarn:4 on a 64-position model is what a checkpoint with YaRN x4 over 64 says: the same
    frequencies and 256 positions; an engine asked for it on a target loaded without it refuses."""
    from helpers import llama_config, tiny_target, tiny_tokenizer

    from deepflash.engine.config import EngineConfig
    from deepflash.engine.engine import Engine
    from deepflash.errors import UserError

    native = llama_config(max_position_embeddings=64)
    checkpoint = llama_config(max_position_embeddings=64, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    scaled = native.with_rope_scaling("yarn:4")
    assert (native.positions, scaled.positions, checkpoint.positions) == (64, 256, 256)
    for a, b in zip(rope_frequencies(scaled.rope, 16), rope_frequencies(checkpoint.rope, 16)):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    with pytest.raises(UserError, match="applied when the target is loaded"):
        Engine(tiny_target(), tiny_tokenizer(), config=EngineConfig(rope_scaling="yarn:4"))


def test_saved_checkpoint_loads(tmp_path):
    """A checkpoint written by transformers' save_pretrained (per-expert names) loads through our loader."""
    from deepflash.loading.targets import load_target

    hf, _ = hf_pair("qwen3_moe")
    hf.save_pretrained(tmp_path)
    ours, _ = load_target(str(tmp_path))
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert (ours(ids, torch.arange(16), ours.new_cache(1, 32))[0] - hf(ids).logits).abs().max() <= TOL


def test_cost_accounting():
    _, ours = hf_pair("qwen3_moe")
    cfg = ours.cfg
    assert ours.kv_bytes_per_token() == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert ours.weight_bytes() == sum(p.numel() * 4 for p in ours.parameters())
    assert ours.decode_weight_bytes() < ours.weight_bytes()  # only routed experts are read


def test_moving_a_fused_model_moves_its_fused_projections():
    """.to() re-fuses q/k/v and gate/up from the moved parameters: a forward after a dtype (or device)
    change runs in the new dtype, gives the same logits, and the parameters stay views of the fused
    tensors (nothing stored twice)."""
    from helpers import tiny_target

    model = tiny_target(torch.float32)
    ids, pos = torch.arange(8)[None], torch.arange(8)
    before = model(ids, pos, model.new_cache(1, 8))[0]
    model.to(torch.float64)
    after = model(ids, pos, model.new_cache(1, 8))[0]
    assert after.dtype == torch.float64
    torch.testing.assert_close(after, before.double(), rtol=1e-5, atol=1e-5)
    attn = model.model.layers[0].self_attn
    fused = attn.qkv[0]
    assert fused.dtype == torch.float64
    assert attn.q_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()


def test_auto_target_kernels_pick_torch_off_cuda_and_refuse_unknown_kinds():
    """'auto' means each target class's measured-faster set on CUDA (LlamaModel: Triton); elsewhere torch."""
    from helpers import llama_config

    from deepflash.errors import UserError
    from deepflash.models import random_model
    from deepflash.models.base import TargetModel
    from deepflash.models.llama import LlamaModel

    assert LlamaModel.auto_kernels == "triton" and TargetModel.auto_kernels == "torch"
    target = random_model(llama_config(), "cpu", torch.float32).use_kernels("auto")
    assert {m.kernels for m in target.modules() if hasattr(m, "kernels")} == {None}  # torch's forms
    with pytest.raises(UserError, match="target kernels must be one of"):
        target.use_kernels("cuda")


@pytest.mark.parametrize("capture", [(0, 2), (0, 1), (1,)])
def test_features_reach_on_features_once_before_the_head(capture):
    """forward hands the tap features to on_features once, before the head runs (steps.Steps.verify
    commits them beside the target's last layers), equal to the features it returns."""
    model = random_model(llama_config(num_hidden_layers=3), "cpu", torch.float32, std=0.2)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))
    seen, head_calls = [], []
    model.lm_head.register_forward_pre_hook(lambda module, args: head_calls.append(len(seen)))
    _, features = model(ids, torch.arange(5), model.new_cache(1, 8), 5, capture=capture,
                        on_features=lambda f: seen.append(f.clone()))
    assert head_calls == [1] and len(seen) == 1 and torch.equal(seen[0], features)


def test_rms_norm_of_bf16_activations_with_float32_gains_takes_the_fused_op():
    """Training's autocast feeds bf16 activations to float32 gains: the norm casts the gain so that
    torch's fused op runs (it warns and writes the op out otherwise), and the result is the float32
    norm's, rounded to bf16."""
    import warnings

    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(8, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = norm(x.bfloat16())
    want = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * norm.weight
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_checkpoint_tensors_that_fusion_replaces_are_freed_while_building():
    hf, _ = hf_pair("qwen3")
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    q = weakref.ref(state["model.layers.0.self_attn.q_proj.weight"])
    model = build_from_state(ModelConfig.from_hf(hf.config.to_dict()), state, "cpu", torch.float32)
    gc.collect()
    assert not state and q() is None  # the fused q/k/v holds the values now, once
    assert model.model.layers[0].self_attn.qkv[0].shape[0] == 128


def over_a_kib(weight: torch.Tensor) -> bool:
    """layers.gemm_layout's rule for these tests: on the CPU too, every weight over 1 KiB (the engine's,
    read_by_torch_gemm: on CUDA, over the projection kernels' max_weight_bytes)."""
    return weight.numel() * weight.element_size() > 1024


def column_major(weight: torch.Tensor) -> bool:
    return weight.stride() == (1, weight.shape[0])


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe"])
def test_large_weights_stored_transposed_keep_the_logits(kind):
    hf, ours = hf_pair(kind)
    ours.fuse_projections(over_a_kib)
    attention, mlp = ours.model.layers[0].self_attn, ours.model.layers[0].mlp
    assert column_major(attention.qkv[0]) and column_major(attention.o_proj.weight)
    # the linears stay views into the fused weight: nothing is stored twice
    assert attention.k_proj.weight.untyped_storage().data_ptr() == attention.qkv[0].untyped_storage().data_ptr()
    if kind != "qwen3_moe":  # its layer 0 routes to experts (fused 3-D tensors, left as they are)
        assert column_major(mlp.gate_up[0]) and column_major(mlp.down_proj.weight)
    embedding = ours.model.embed_tokens.weight
    assert embedding.is_contiguous()  # the table keeps its rows, tied LM head (llama) or not
    assert (ours.lm_head.weight is embedding) if kind == "llama" else column_major(ours.lm_head.weight)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, _ = ours(ids, torch.arange(24), ours.new_cache(1, 64))
        assert (logits - hf(ids).logits).abs().max() <= TOL
    moved = ours.to(torch.float64).model.layers[0].self_attn  # .to() keeps strides and fuses again
    assert column_major(moved.qkv[0]) and column_major(moved.o_proj.weight)


def test_greedy_speculative_equals_plain_with_weights_stored_transposed():
    target = random_model(llama_config(tie_word_embeddings=False), dtype=torch.float64, std=0.2)
    target.fuse_projections(over_a_kib)
    assert column_major(target.model.layers[0].self_attn.qkv[0]) and column_major(target.lm_head.weight)
    drafter = tiny_drafter(drafter_config(target.cfg)).fuse_projections(over_a_kib)
    tokenizer, params = tiny_tokenizer(), SamplingParams(max_new_tokens=30)
    ids = torch.randint(5, 90, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    spec = Engine(target, tokenizer, drafter, config=EngineConfig(spec="on")).complete(ids, params)
    assert spec.token_ids == Engine(target, tokenizer).complete(ids, params).token_ids
