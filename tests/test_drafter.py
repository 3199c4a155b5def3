"""The drafter against a naive reference with explicit masks, its context cache, and checkpoints."""

import json

import pytest
import torch
from helpers import drafter_config, tiny_drafter, tiny_target
from safetensors.torch import save_file

from deepflash.drafter.checkpoint import load_drafter, save_drafter, validate_pair
from deepflash.drafter.config import DrafterConfig
from deepflash.drafter.context import DrafterContext, drafter_kernels
from deepflash.errors import UserError


def rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, dim, theta=10000.0):
    """x [..., D] at integer position pos, rotate-half convention."""
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = torch.cat([pos * inv, pos * inv])
    half = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1)
    return x * ang.cos() + half * ang.sin()


def naive_drafter(drafter, embed, features, block, start):
    """Straight from REFERENCE 1, one query and one key at a time."""
    cfg = drafter.cfg
    sd = {k: v.double() for k, v in drafter.state_dict().items()}
    n_ctx, size, d = features.shape[0], block.shape[0], cfg.head_dim
    ctx_pos = list(range(start - n_ctx, start))
    q_pos = list(range(start, start + size))
    ctx = rms(features.double() @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    x = embed[block].double()
    group = cfg.num_heads // cfg.num_kv_heads
    for li in range(cfg.num_layers):
        p = f"layers.{li}."
        sliding = cfg.layer_types[li] == "sliding_attention"  # REFERENCE 1: sliding layers are causal
        w, causal = (cfg.sliding_window, True) if sliding else (None, False)
        h = rms(x, sd[p + "input_layernorm.weight"])
        out = torch.zeros(size, cfg.num_heads * d, dtype=torch.float64)
        for head in range(cfg.num_heads):
            kv = head // group
            wq = sd[p + "self_attn.q_proj.weight"][head * d : (head + 1) * d]
            wk = sd[p + "self_attn.k_proj.weight"][kv * d : (kv + 1) * d]
            wv = sd[p + "self_attn.v_proj.weight"][kv * d : (kv + 1) * d]

            def key(row, pos):
                return rope(rms(row @ wk.T, sd[p + "self_attn.k_norm.weight"]), pos, d)

            for i, qp in enumerate(q_pos):
                q = rope(rms(h[i] @ wq.T, sd[p + "self_attn.q_norm.weight"]), qp, d)
                keys, vals = [], []
                for j, kp in enumerate(ctx_pos):  # context: strictly before the block
                    if w is None or qp - kp < w:
                        keys.append(key(ctx[j], kp)), vals.append(ctx[j] @ wv.T)
                for j, kp in enumerate(q_pos):  # the block itself
                    if (not causal or kp <= qp) and (w is None or abs(qp - kp) < w):
                        keys.append(key(h[j], kp)), vals.append(h[j] @ wv.T)
                att = torch.softmax(torch.stack(keys) @ q / d**0.5, 0)
                out[i, head * d : (head + 1) * d] = att @ torch.stack(vals)
        x = x + out @ sd[p + "self_attn.o_proj.weight"].T
        h = rms(x, sd[p + "post_attention_layernorm.weight"])
        gate = h @ sd[p + "mlp.gate_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * (h @ sd[p + "mlp.up_proj.weight"].T)) @ sd[p + "mlp.down_proj.weight"].T
    return rms(x, sd["norm.weight"])


@pytest.mark.parametrize("sliding,window,ring", [(False, 4, 64), (True, 4, 64), (True, 3, 64), (False, 4, 6),
                                                 (True, 5, 7)])
def test_drafter_matches_naive_reference(sliding, window, ring):
    """Full layers bidirectional over the block and all context in the feature window; sliding layers
    causal in the block with context inside their window (edges included); `ring` < context length
    checks that only the newest `ring` positions stay visible."""
    target = tiny_target()
    drafter = tiny_drafter(drafter_config(target.cfg, layers=3, sliding=sliding, window=window, block_size=6))
    n_ctx, size = 11, 6
    feats = torch.randn(n_ctx, 2 * 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    block = torch.tensor([7] + [drafter.cfg.mask_token_id] * (size - 1))
    context = DrafterContext(drafter, ring, slack=size)
    context.append(torch.arange(0, 5), feats[:5])
    context.append(torch.arange(5, n_ctx), feats[5:])  # appended in two runs, as committed steps do
    context.append(torch.arange(n_ctx, n_ctx + 3), torch.randn(3, 128, dtype=torch.float64))  # not committed
    x = drafter.block_embeddings(target.model.embed_tokens, block[None])
    q_pos = torch.arange(n_ctx, n_ctx + size)
    ours = drafter(x, q_pos, context.kv(), context.masks(q_pos))[0]
    visible = min(n_ctx, ring)
    ref = naive_drafter(drafter, target.model.embed_tokens.weight, feats[n_ctx - visible :], block, n_ctx)
    assert (ours - ref).abs().max() < 1e-5  # rope tables are float32, as in transformers


@pytest.mark.parametrize("sliding", [False, True])
def test_a_span_past_every_held_position_drafts_as_the_whole_ring(sliding):
    """The engine's draft attends over the first `span` slots of each ring (its KV bucket): with every
    held position below span, that is the same attention as over the whole ring."""
    target = tiny_target()
    drafter = tiny_drafter(drafter_config(target.cfg, layers=2, sliding=sliding, window=4, block_size=6))
    context = DrafterContext(drafter, 64, slack=6)
    context.append(torch.arange(0, 13), torch.randn(13, 128, dtype=torch.float64))
    block = torch.tensor([[7] + [drafter.cfg.mask_token_id] * 5])
    x = drafter.block_embeddings(target.model.embed_tokens, block)
    q_pos = torch.arange(10, 16)  # positions 10-12 were appended by an unaccepted verify: masked
    whole = drafter(x, q_pos, context.kv(), context.masks(q_pos))
    spanned = drafter(x, q_pos, context.kv(16), context.masks(q_pos, 16))
    slots = [min(16, cap) for cap in context.caps]  # sliding layers' rings (window + slack) are smaller
    assert [k.shape[2] for k, _ in context.kv(16)] == slots
    groups = drafter.cfg.num_heads // drafter.cfg.num_kv_heads  # masks come folded for attention
    assert [m.shape for m in context.masks(q_pos, 16)] == [(groups * 6, n + 6) for n in slots]
    assert 16 < max(context.caps)
    torch.testing.assert_close(spanned, whole, rtol=0, atol=1e-12)


def test_context_cache_never_holds_the_block_and_rebuild_equals_incremental():
    target = tiny_target()
    drafter = tiny_drafter(drafter_config(target.cfg, sliding=True, window=4))
    feats = torch.randn(30, 128, dtype=torch.float64)
    inc = DrafterContext(drafter, 9)
    for lo, hi in [(0, 13), (13, 14), (14, 20), (20, 30)]:
        inc.append(torch.arange(lo, hi), feats[lo:hi])
    assert all(int(t.max()) == 29 for t in inc.tags)
    rebuilt = DrafterContext(drafter, 9)
    rebuilt.rebuild(21, feats[21:30])
    for a, b, ta, tb in zip(inc.k, rebuilt.k, inc.tags, rebuilt.tags):
        keep_a, keep_b = ta >= 21, tb >= 21  # the rings may also hold older rows; only the window counts
        order_a, order_b = ta[keep_a].argsort(), tb[keep_b].argsort()
        assert torch.equal(ta[keep_a][order_a], tb[keep_b][order_b])
        assert torch.allclose(a[:, :, keep_a][:, :, order_a], b[:, :, keep_b][:, :, order_b])


def test_fused_projections_draft_as_the_unfused_ones_and_survive_a_move():
    """Inference drafters run q/k/v and gate/up as one GEMM each; training ones do not. Same drafts, same
    context K/V; .to() keeps the fusion (its tensors follow the parameters)."""
    target = tiny_target()
    cfg = drafter_config(target.cfg, layers=2, block_size=6)
    plain, fused = tiny_drafter(cfg, fused=False), tiny_drafter(cfg)
    assert plain.layers[0].self_attn.qkv is None and fused.layers[0].self_attn.qkv is not None
    feats = torch.randn(9, 2 * 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    q_pos = torch.arange(9, 15)
    block = torch.tensor([[7] + [cfg.mask_token_id] * 5])

    def draft_and_context(drafter):
        context = DrafterContext(drafter, 32, slack=6)
        context.append(torch.arange(9), feats)
        x = drafter.block_embeddings(target.model.embed_tokens, block)
        return drafter(x, q_pos, context.kv(), context.masks(q_pos)), context.k[1][:, :, :9]

    want = draft_and_context(plain)
    for got, ref in zip(draft_and_context(fused), want):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    fused.to(torch.float32)  # in place: the fused tensors must follow, or the GEMMs would mix dtypes
    assert {layer.self_attn.qkv[0].dtype for layer in fused.layers} == {torch.float32}
    assert {layer.mlp.gate_up[0].dtype for layer in fused.layers} == {torch.float32}
    for got, ref in zip(draft_and_context(fused), want):
        torch.testing.assert_close(got, ref.float(), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="fused form"):  # RingBlock layers run the fused projections
        DrafterContext(plain, 32, slack=6, kernels="triton")


def test_drafter_kernels_follow_the_targets_where_the_head_dim_allows():
    """Triton's where the target's are asked for (on the CPU 'auto' means torch's); a head dim that is not
    a power of two, which the kernels' tiles cannot take, keeps torch's."""
    target = tiny_target()
    fits, odd = (tiny_drafter(drafter_config(target.cfg, head_dim=dim)) for dim in (16, 24))
    assert [drafter_kernels(k, fits) for k in ("triton", "auto", "torch")] == ["triton", "torch", "torch"]
    assert drafter_kernels("triton", odd) == "torch"


def test_save_load_round_trip(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(drafter_config(target.cfg, sliding=True), dtype=torch.float32)
    save_drafter(drafter, tmp_path, dtype=torch.float32)
    loaded = load_drafter(tmp_path)
    assert loaded.cfg == drafter.cfg and loaded.fused
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and "trained_context_length" in raw["dflash_config"]


def test_int8_storage_round_trip(tmp_path):
    """Matrices come back within half a step of their row's int8 grid; vectors exactly; half the bytes of
    bf16 (plus a float32 scale per row)."""
    drafter = tiny_drafter(drafter_config(tiny_target().cfg), dtype=torch.float32)
    save_drafter(drafter, tmp_path / "int8", dtype=torch.float32, storage="int8")
    save_drafter(drafter, tmp_path / "bf16", dtype=torch.bfloat16)
    loaded = load_drafter(tmp_path / "int8")
    for (name, want), (_, got) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        if want.dim() == 2:
            step = want.abs().amax(1, keepdim=True) / 127
            assert ((got - want).abs() <= step / 2 + 1e-7).all(), name
        else:
            assert torch.equal(got, want), name
    raw = json.loads((tmp_path / "int8" / "config.json").read_text())
    assert raw["quantization_config"] == {"quant_method": "int8-rows"}
    sizes = [(tmp_path / kind / "model.safetensors").stat().st_size for kind in ("int8", "bf16")]
    assert sizes[0] < 0.65 * sizes[1]


def test_unknown_weight_storage_is_refused(tmp_path):
    drafter = tiny_drafter(drafter_config(tiny_target().cfg), dtype=torch.float32)
    with pytest.raises(UserError, match="storage must be one of"):
        save_drafter(drafter, tmp_path, storage="int4")
    save_drafter(drafter, tmp_path, storage="int8")
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(UserError, match="'gptq' is not supported"):
        load_drafter(tmp_path)
    del raw["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UserError, match="integer tensors without scales"):
        load_drafter(tmp_path)


def test_hand_written_reference_checkpoint_loads(tmp_path):
    """A checkpoint made from the REFERENCE format alone (names, config fields, unknown extras)."""
    h, inter, heads, kv, d, layers = 64, 80, 4, 2, 16, 2
    tensors = {"fc.weight": torch.randn(h, 3 * h), "hidden_norm.weight": torch.ones(h), "norm.weight": torch.ones(h)}
    for i in range(layers):
        p = f"layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": torch.randn(heads * d, h), p + "self_attn.k_proj.weight": torch.randn(kv * d, h),
            p + "self_attn.v_proj.weight": torch.randn(kv * d, h), p + "self_attn.o_proj.weight": torch.randn(h, heads * d),
            p + "self_attn.q_norm.weight": torch.ones(d), p + "self_attn.k_norm.weight": torch.ones(d),
            p + "mlp.gate_proj.weight": torch.randn(inter, h), p + "mlp.up_proj.weight": torch.randn(inter, h),
            p + "mlp.down_proj.weight": torch.randn(h, inter)})
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    config = {"architectures": ["DFlashDraftModel"], "block_size": 16, "num_target_layers": 4,
              "dflash_config": {"mask_token_id": 95, "target_layer_ids": [0, 1, 2], "some_future_field": 1},
              "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 2048,
              "rope_theta": 1000000.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                       "original_max_position_embeddings": 32768},
              "hidden_size": h, "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
              "head_dim": d, "num_hidden_layers": layers, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
              "vocab_size": 96, "tie_word_embeddings": True, "an_unknown_field": [1, 2]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    drafter = load_drafter(tmp_path)
    assert drafter.cfg.rope.kind == "yarn" and drafter.cfg.trained_context_length == 131072
    assert drafter.cfg.layer_is_causal(0) and not drafter.cfg.layer_is_causal(1)
    assert torch.equal(drafter.fc.weight, tensors["fc.weight"].to(torch.bfloat16).float())
    validate_pair(drafter.cfg, tiny_target().cfg)


@pytest.mark.parametrize("change,message", [
    (dict(hidden_size=32), "hidden size"),
    (dict(dflash_config={"mask_token_id": 5, "target_layer_ids": [0, 9]}), "target_layer_ids"),
    (dict(dflash_config={"mask_token_id": 500, "target_layer_ids": [0]}), "mask token"),
    (dict(num_target_layers=30), "30-layer target"),
    (dict(vocab_size=1000), "vocab size"),
])
def test_mismatched_drafter_is_refused(change, message):
    target = tiny_target()
    cfg = drafter_config(target.cfg, **change)
    with pytest.raises(UserError, match=message):
        validate_pair(cfg, target.cfg)


def test_block_size_flag_is_checked():
    target = tiny_target()
    with pytest.raises(UserError, match="block-size"):
        validate_pair(drafter_config(target.cfg, block_size=8), target.cfg, block_size=16)


def test_other_drafter_architectures_are_refused():
    with pytest.raises(UserError, match="DFlash2DraftModel"):
        DrafterConfig.from_hf({"architectures": ["DFlash2DraftModel"], "dflash_config": {}})


def test_shipped_drafter_fits_the_repo_and_its_target():
    """The embedded default's drafter: at most 25 MB (issue 6), DFlash block 16, trained on the
    target's whole 8192-token context, and shaped for SmolLM2-135M (30 layers, hidden 576)."""
    from deepflash.engine.runtime import DEFAULT_DRAFTER

    assert (DEFAULT_DRAFTER / "model.safetensors").stat().st_size <= 25_000_000
    cfg = DrafterConfig.from_hf(json.loads((DEFAULT_DRAFTER / "config.json").read_text()))
    assert cfg.block_size == 16 and cfg.trained_context_length == 8192
    assert cfg.num_target_layers == 30 and cfg.hidden_size == 576 and max(cfg.target_layer_ids) < 30


@pytest.mark.parametrize("fields,causal,windows", [
    ({}, [True, True, False], [8, 8, None]),  # sliding layers causal inside the block, full ones bidirectional
    ({"is_causal": False}, [False, False, False], [8, 8, None]),
    ({"is_causal": True}, [True, True, True], [8, 8, None]),
    ({"dflash_config": {"causal": True}}, [True, True, True], [8, 8, None]),
    ({"dflash_config": {"causal": False}, "is_causal": True}, [True, True, True], [8, 8, None]),  # is_causal first
    ({"use_sliding_window": False}, [False, False, False], [None, None, None]),
])
def test_attention_semantics_follow_the_checkpoints_overrides(fields, causal, windows):
    """What each drafter layer sees inside the block and over the context, from its config.json."""
    base = drafter_config(tiny_target().cfg, layers=3, sliding=True, window=8).raw
    raw = {**base, **{k: v for k, v in fields.items() if k != "dflash_config"}}
    raw["dflash_config"] = {**base["dflash_config"], **fields.get("dflash_config", {})}
    cfg = DrafterConfig.from_hf(raw)
    assert [cfg.layer_is_causal(i) for i in range(3)] == causal
    assert [cfg.layer_window(i) for i in range(3)] == windows
    assert DrafterConfig.from_hf(cfg.to_hf()).layer_types == cfg.layer_types  # a saved drafter reads back alike
