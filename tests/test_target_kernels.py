"""The target's Triton kernels (kernels/rope.py, kernels/attention.py, kernels/layer_ops.py) compute what
the torch forms do (on the CPU in Triton's interpreter: helpers.triton_device)."""

from collections import Counter
from dataclasses import replace

import pytest
import torch
from helpers import llama_config, triton_device
from torch.overrides import TorchFunctionMode

from deepflash.engine.config import EngineConfig
from deepflash.models import random_model

DEVICE = triton_device()


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("rope_tokens", [1, 4])
def test_triton_kernels_match_torch_in_the_model(qk_norm, partial, rope_tokens):
    """Prefill then decode steps with the kernels on and off: same logits, the same features at a middle
    tap (read from the next norm's kernel: layers.tap) and the last, and the same cache rows."""
    from deepflash.kernels.config import KernelConfig

    cfg = llama_config(model_type="qwen3" if qk_norm else "llama", partial_rotary_factor=partial,
                       num_hidden_layers=3)
    assert cfg.qk_norm == qk_norm
    models = [random_model(cfg, DEVICE, torch.float32, std=0.2) for _ in range(2)]
    models[1].use_kernels("triton", KernelConfig(rope_tokens=rope_tokens))  # 12 prefill tokens: three tiles of 4
    caches = [m.new_cache(2, 32) for m in models]
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    outs = [m(ids, torch.arange(12, device=DEVICE), c, 12, capture=(0, 2)) for m, c in zip(models, caches)]
    for pos in range(12, 15):
        step = ids[:, pos - 12 : pos - 11]
        positions = torch.tensor([pos], device=DEVICE)
        outs += [m(step, positions, c, 16, capture=() if pos == 13 else (0, 2)) for m, c in zip(models, caches)]
    for (torch_logits, torch_features), (triton_logits, triton_features) in zip(outs[::2], outs[1::2]):
        torch.testing.assert_close(triton_logits, torch_logits, rtol=1e-4, atol=1e-4)
        if torch_features is not None:
            torch.testing.assert_close(triton_features, torch_features, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(caches[1].k[:, :, :, :15], caches[0].k[:, :, :, :15], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[1].v[:, :, :, :15], caches[0].v[:, :, :, :15])


def test_feature_taps_change_no_kernel_output():
    """A forward that captures features returns the same logits, bit for bit, as one that does not, on
    Triton's kernels: a tap reads the sum the next norm's kernel writes anyway (layers.tap), so a
    speculative step's target forward rounds as a plain one."""
    cfg = llama_config(num_hidden_layers=4)
    model = random_model(cfg, DEVICE, torch.bfloat16, std=0.2)
    model.use_kernels("triton")
    ids = torch.randint(0, cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    runs, calls = [], []
    for capture in [(), (0, 1, 3), (2,)]:
        with TorchCalls() as seen:
            runs.append(model(ids, torch.arange(6, device=DEVICE), model.new_cache(1, 16), 8, capture=capture))
        calls.append(seen.counts)
    assert all(torch.equal(logits, runs[0][0]) for logits, _ in runs)
    # the taps cost only their concatenation: no add of their own, no other torch call
    assert calls[1] - calls[0] == calls[2] - calls[0] == Counter({"cat": 1}) and not calls[0] - calls[1]


class TorchCalls(TorchFunctionMode):
    """Counts the torch functions called inside the block, by name."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.counts[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("groups,dim", [(3, 64), (4, 128), (1, 16)])
@pytest.mark.parametrize("position,tokens,kv_len", [(0, 1, 8), (70, 1, 80), (300, 1, 512), (599, 1, 600),
                                                    (70, 5, 80), (290, 16, 320)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_sdpa(groups, dim, position, tokens, kv_len, dtype):
    """Queries at positions position.. over keys 0..their position of a cache span kv_len (the rest of a
    CUDA-graph bucket is masked), against SDPA in float32 on the same inputs."""
    from deepflash.kernels.attention import decode_attention

    gen = torch.Generator().manual_seed(position)
    kv_heads, slots = 2, 640
    q = torch.randn(1, kv_heads * groups, tokens, dim, generator=gen).to(DEVICE, dtype)
    k, v = (torch.randn(1, kv_heads, slots, dim, generator=gen).to(DEVICE, dtype) for _ in range(2))
    positions = torch.arange(position, position + tokens, device=DEVICE)
    got = decode_attention(q, k, v, positions, kv_len)
    end = position + tokens
    keys, values = (c[:, :, :end].float().repeat_interleave(groups, dim=1) for c in (k, v))
    visible = torch.arange(end, device=DEVICE)[None, :] <= positions[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), keys, values, attn_mask=visible)
    close = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: its output's rounding, the weights' in bf16
    torch.testing.assert_close(got.float(), want, rtol=close, atol=close)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verified_token_is_computed_exactly_as_a_decoded_one(dtype):
    """Each query of a multi-token step equals, bit for bit, a one-token step at its position, whatever
    the cache span (CUDA-graph buckets differ between the two): what keeps greedy speculative decoding
    equal to plain decoding under bf16 rounding."""
    from deepflash.kernels.attention import CHUNK, MERGE_TILES, decode_attention

    gen = torch.Generator().manual_seed(7)
    narrow, middle, wide = (CHUNK * tile for tile in MERGE_TILES)  # the keys of each merge tile width
    kv_heads, groups, dim, slots = 1, 3, 16, wide * 2 + 64  # spans of one and of several widest tiles
    k, v = (torch.randn(1, kv_heads, slots, dim, generator=gen).to(DEVICE, dtype) for _ in range(2))
    # tiles of attention.ROWS query rows start at multiples of 4 positions (3 heads padded to 4):
    # blocks across 5 tiles (16 tokens from 5) and part-filled ones (7 from 37); blocks whose rows take
    # two merge tile widths
    for first, tokens, span in [(5, 16, 32), (37, 7, 64), (narrow - 8, 16, narrow + 64), (middle - 3, 6, middle + 40),
                                (wide - 2, 4, slots)]:
        q = torch.randn(1, kv_heads * groups, tokens, dim, generator=gen).to(DEVICE, dtype)
        block = decode_attention(q, k, v, torch.arange(first, first + tokens, device=DEVICE), span)
        for i in range(tokens):
            alone = decode_attention(q[:, :, i : i + 1].contiguous(), k, v,
                                     torch.tensor([first + i], device=DEVICE), first + i + 1 + 7 * i)
            assert torch.equal(block[:, :, i : i + 1], alone), (first, i)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_a_rope_tile_computes_each_token_alone(qk_norm):
    """rope_and_write over 7 tokens in tiles of 4 (one part-filled) writes, bit for bit, what 7 one-token
    calls write: q, and k and v at their cache slots (a verify step's tokens as decode steps')."""
    from deepflash.kernels.rope import rope_and_write

    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, tokens, slots = 3, 1, 16, 7, 32
    qkv = torch.randn(2, tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE, torch.bfloat16)
    cos, sin = (torch.randn(tokens, dim, generator=gen).to(DEVICE) for _ in range(2))
    positions = torch.arange(9, 9 + tokens, device=DEVICE)
    gains = [torch.randn(dim, generator=gen).to(DEVICE, torch.bfloat16) if qk_norm else None for _ in range(2)]
    caches = [torch.zeros(2, kv_heads, slots, dim, dtype=torch.bfloat16, device=DEVICE) for _ in range(4)]
    block = rope_and_write(qkv, cos, sin, positions, caches[0], caches[1], heads, kv_heads, *gains, 1e-6, tokens=4)
    for i in range(tokens):
        alone = rope_and_write(qkv[:, i : i + 1].contiguous(), cos[i : i + 1], sin[i : i + 1], positions[i : i + 1],
                               caches[2], caches[3], heads, kv_heads, *gains, 1e-6, tokens=4)
        assert torch.equal(block[:, :, i : i + 1], alone), i
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0][:, :, 9 : 9 + tokens].abs().sum() > 0


def projection_inputs(rows: int, dtype: torch.dtype, seed: int = 0) -> dict:
    """A layer's input pair, norm gain and a projection (widths off the kernels' blocks: 72 in, 40 out)."""
    gen = torch.Generator().manual_seed(seed)
    width, out = 72, 40

    def make(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)

    return dict(x=make(rows, width), delta=make(rows, width), gain=make(width, scale=0.3) + 1,
                weight=make(out, width, scale=0.2), bias=make(out), gate_up=make(rows, 2 * width))


# programs per SM for gemv_kernel's split of the reduction: on the CPU (1 "SM") the tests' 3 reduction
# steps over two column blocks (40 outputs, BLOCK_N 32) take 1, 2 and 3 slices
WAVES = [0, 3, 64]


def tiling_of(waves: int, kind: str):
    """The projections' split at `waves`; "large": the tests' weights take the large weights' path, a 32x32
    weight-first tiling with the tiles through TMA where the GPU has it (a dependent launch on Hopper)."""
    from deepflash.kernels.config import ProjectionTiling

    if kind == "large":
        return ProjectionTiling(waves=waves, small_weight_bytes=0, large=((None, None, (32, 32, 4, 2, True, 1, True)),))
    return ProjectionTiling(waves=waves)


@pytest.mark.parametrize("rows", [1, 7, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("waves", WAVES)
@pytest.mark.parametrize("tiling", ["small", "large"])
def test_projections_with_their_prologue_match_the_separate_kernels(rows, dtype, waves, tiling):
    """gemv.py's add + norm + projection and silu * up + projection against layer_ops.py's separate
    kernels and a float32 GEMM on their output, and its projection without a prologue against the GEMM,
    with the reduction whole or split, in the small and the large weights' tilings; the sum is written where
    it is asked for."""
    from deepflash.kernels import gemv
    from deepflash.kernels.layer_ops import add_rms_norm, silu_mul

    tiled = dict(tiling=tiling_of(waves, tiling))
    a = projection_inputs(rows, dtype)

    def linear(h, bias=None):
        return torch.nn.functional.linear(h.float(), a["weight"].float(), None if bias is None else bias.float())

    close = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=4e-2)  # bf16 rounding
    total = torch.full_like(a["x"], float("nan"))
    summed, out = gemv.norm_linear(a["x"], a["delta"], a["gain"], 1e-6, a["weight"], a["bias"], total, **tiled)
    want_sum, normed = add_rms_norm(a["x"], a["delta"], a["gain"], 1e-6)
    assert summed is total and torch.equal(total, want_sum)
    torch.testing.assert_close(out.float(), linear(normed, a["bias"]), **close)
    summed, out = gemv.norm_linear(a["x"], None, a["gain"], 1e-6, a["weight"], **tiled)
    assert summed is a["x"]
    torch.testing.assert_close(out.float(), linear(add_rms_norm(a["x"], None, a["gain"], 1e-6)[1]), **close)
    torch.testing.assert_close(gemv.silu_linear(a["gate_up"], a["weight"], **tiled).float(),
                               linear(silu_mul(a["gate_up"])), **close)
    torch.testing.assert_close(gemv.linear(a["x"], a["weight"], a["bias"], **tiled).float(),
                               linear(a["x"], a["bias"]), **close)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("waves", WAVES)
@pytest.mark.parametrize("tiling", ["small", "large"])
def test_a_projected_row_does_not_depend_on_the_other_rows(dtype, waves, tiling):
    """Each row of a 16-row projection equals, bit for bit, the same row projected alone or among 5: a
    verify step's projections compute each token exactly as a one-token decode step's, whole or split, in
    the small and the large weights' tilings."""
    from deepflash.kernels import gemv

    tiled = dict(tiling=tiling_of(waves, tiling))
    a = projection_inputs(16, dtype, seed=3)
    calls = {"add + norm": lambda sl: gemv.norm_linear(a["x"][sl], a["delta"][sl], a["gain"], 1e-6, a["weight"],
                                                       a["bias"], **tiled)[1],
             "norm": lambda sl: gemv.norm_linear(a["x"][sl], None, a["gain"], 1e-6, a["weight"], **tiled)[1],
             "silu": lambda sl: gemv.silu_linear(a["gate_up"][sl], a["weight"], **tiled),
             "plain": lambda sl: gemv.linear(a["x"][sl], a["weight"], a["bias"], **tiled)}
    for name, call in calls.items():
        block = call(slice(0, 16))
        assert torch.equal(call(slice(4, 9)), block[4:9]), name
        for i in (0, 9, 15):
            assert torch.equal(call(slice(i, i + 1)), block[i : i + 1]), (name, i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_unrolled_reduction_adds_the_same_sums(dtype):
    """ProjectionTiling.unroll_from changes only how the last slice's loop over the parked sums is compiled:
    a split projection gives the same bits rolled and unrolled, at 1 row and at 16."""
    from deepflash.kernels import gemv
    from deepflash.kernels.config import ProjectionTiling

    a = projection_inputs(16, dtype, seed=5)
    outputs = {}
    for unroll in (None, 2):
        tiling = ProjectionTiling(waves=64, unroll_from=unroll)  # 64: the most slices the tests' reductions take
        outputs[unroll] = [call(sl) for sl in (slice(0, 1), slice(0, 16)) for call in (
            lambda sl: gemv.norm_linear(a["x"][sl], a["delta"][sl], a["gain"], 1e-6, a["weight"], a["bias"],
                                        tiling=tiling)[1],
            lambda sl: gemv.silu_linear(a["gate_up"][sl], a["weight"], tiling=tiling))]
    assert all(torch.equal(rolled, unrolled) for rolled, unrolled in zip(outputs[None], outputs[2]))


def test_large_projections_split_into_one_round_of_programs():
    """The large weights' splits of Qwen3-8B's projections on an H200's 132 SMs: every program resident at
    once (a second round cost the Qwen3-8B-shaped MBU 0.846 -> 0.709), filling at least 90% of the places
    (q/k/v's 288 programs of 396 places, two on most SMs and three on others, cost 0.844 -> 0.832). Places
    an SM: its 227 KB of shared memory over a program's stages of weight tile and rows, bf16."""
    from deepflash.kernels import gemv

    sms = 132
    for outputs, width in [(6144, 4096), (24576, 4096), (4096, 12288), (4096, 4096)]:  # q/k/v, gate/up, down, o
        block_n, block_k, _, stages, _, waves, _ = gemv.config(width, outputs, outputs * width * 2)
        blocks, steps = -(-outputs // block_n), -(-width // block_k)
        slices, per = gemv.split(blocks, steps, sms, waves)
        resident = 227 * 1024 // (stages * (block_n + 16) * block_k * 2)
        assert 0.9 * resident * sms <= blocks * slices <= resident * sms, (outputs, width, slices)
        assert (slices - 1) * per < steps <= slices * per


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_with_triton_attention_kernels_keeps_the_greedy_contract(dtype):
    """Greedy speculative == greedy plain with the target on its Triton kernels (on the GPU also under
    CUDA graphs), against plain decode on the same kernels; in float32 also on torch's kernels (in bf16
    the two kernel sets may round apart: that is why verify and decode share one attention kernel)."""
    from helpers import drafter_config, tiny_drafter, tiny_tokenizer

    from deepflash.engine.engine import Engine
    from deepflash.engine.sampling import SamplingParams
    from deepflash.models import materialize

    target = random_model(llama_config(), DEVICE, dtype, std=0.2)
    drafter = materialize(tiny_drafter(drafter_config(target.cfg), dtype=dtype).to(DEVICE), DEVICE)
    tokenizer = tiny_tokenizer()
    ids = torch.randint(5, 90, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(max_new_tokens=16)
    # blocks of 4: Triton's interpreter runs every program of every step in Python on the CPU
    spec = Engine(target, tokenizer, drafter, config=EngineConfig(spec="on", target_kernels="triton", block_size=4)).complete(ids, params)
    plain = Engine(target, tokenizer, config=EngineConfig(target_kernels="triton")).complete(ids, params)
    assert spec.token_ids == plain.token_ids
    if dtype == torch.float32:
        torch_plain = Engine(target, tokenizer, config=EngineConfig(target_kernels="torch")).complete(ids, params)
        assert target.model.layers[0].kernels is None  # torch's: the last request's engine set it
        assert torch_plain.token_ids == plain.token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalties_and_logprobs_keep_the_contract_on_the_kernels(dtype, monkeypatch):
    """With penalties and log-probabilities (their own step graphs on the GPU), speculative decoding with
    mostly-right drafts emits plain decoding's tokens and log-probabilities, on the Triton kernels (the
    latter to rounding: the LM head is torch's GEMM, whose sums may follow the number of rows)."""
    from helpers import drafter_config, oracle, tiny_drafter, tiny_tokenizer

    from deepflash.engine.engine import Engine
    from deepflash.engine.sampling import SamplingParams
    from deepflash.models import materialize

    target = random_model(llama_config(), DEVICE, dtype, std=0.2)
    drafter = materialize(tiny_drafter(drafter_config(target.cfg), dtype=dtype).to(DEVICE), DEVICE)
    tokenizer = tiny_tokenizer()
    ids = torch.randint(5, 90, (20,), generator=torch.Generator().manual_seed(6)).tolist()
    params = SamplingParams(max_new_tokens=16, logprobs=2, presence_penalty=0.8, repetition_penalty=1.3)
    kernels = EngineConfig(target_kernels="triton")
    plain = Engine(target, tokenizer, config=kernels).complete(ids, params)
    spec_config = replace(kernels, spec="on", block_size=4)
    # the drafter's own proposals, inside the captured step graphs (on a GPU)
    graphed = Engine(target, tokenizer, drafter, config=spec_config).complete(ids, params)
    assert graphed.token_ids == plain.token_ids
    # mostly-right proposals from the host: the oracle reads positions on the host, which a graph cannot
    oracle(monkeypatch, plain.token_ids, len(ids), wrong_every=3)
    spec = Engine(target, tokenizer, drafter, config=replace(spec_config, cuda_graphs=False)).complete(ids, params)
    assert spec.token_ids == plain.token_ids and max(spec.spec.histogram[1:]) > 0
    for run in (graphed, spec):
        assert [e.logprob for e in run.logprobs] == pytest.approx([e.logprob for e in plain.logprobs], abs=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_kernels_match_torch(dtype):
    """add_rms_norm and silu_mul against the torch forms, on widths that are not powers of two."""
    from deepflash.kernels.layer_ops import add_rms_norm, silu_mul

    gen = torch.Generator().manual_seed(5)
    x, y = (torch.randn(3, 2, 576, generator=gen).to(DEVICE, dtype) for _ in range(2))
    weight = (torch.rand(576, generator=gen) + 0.5).to(DEVICE, dtype)
    total, normed = add_rms_norm(x, y, weight, 1e-5)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(total, x + y)
    torch.testing.assert_close(normed, torch.nn.functional.rms_norm(x + y, (576,), weight, 1e-5), **tol)
    same, same_normed = add_rms_norm(total, None, weight, 1e-5)  # no add (layer 0): the same rounding
    assert same is total and torch.equal(same_normed, normed)
    gate_up = torch.randn(4, 2 * 1536, generator=gen).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(gate_up), torch.nn.functional.silu(gate) * up, **tol)


@pytest.mark.parametrize("sliding", [False, True])
def test_a_draft_on_the_decode_kernel_equals_the_masked_one(sliding):
    """Bidirectional full layers draft on the decode kernel (RingBlock: the block's K/V in the ring's
    spare slots) where the span is within the window; sliding layers keep their masks. Positions 10-12
    were appended by an unaccepted verify: the block overwrites them."""
    from helpers import drafter_config, tiny_drafter, tiny_target

    from deepflash.drafter.context import DrafterContext
    from deepflash.drafter.model import RingBlock

    target = tiny_target()
    drafter = tiny_drafter(drafter_config(target.cfg, layers=2, sliding=sliding, window=4, block_size=6),
                           dtype=torch.float32).to(DEVICE)
    feats = torch.randn(13, drafter.fc.in_features, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    block = torch.tensor([[7] + [drafter.cfg.mask_token_id] * 5], device=DEVICE)
    q_pos = torch.arange(10, 16, device=DEVICE)
    drafts, kinds = {}, {}
    for kernels in ("torch", "triton"):
        context = DrafterContext(drafter, 64, slack=6, kernels=kernels)
        context.append(torch.arange(13, device=DEVICE), feats)
        masks = context.masks(q_pos, 32)
        kinds[kernels] = [isinstance(m, RingBlock) for m in masks]
        x = drafter.block_embeddings(target.model.embed_tokens.to(DEVICE), block)
        drafts[kernels] = drafter(x, q_pos, context.kv(32), masks)
    cfg = drafter.cfg
    full = [cfg.layer_window(i) is None and not cfg.layer_is_causal(i) for i in range(cfg.num_layers)]
    assert kinds == {"torch": [False, False], "triton": full} and any(full)
    torch.testing.assert_close(drafts["triton"], drafts["torch"], rtol=1e-4, atol=1e-4)
    narrow = DrafterContext(drafter, 16, slack=6, kernels="triton")  # a span past the window: masks only
    assert not any(isinstance(m, RingBlock) for m in narrow.masks(q_pos, 32))


@pytest.mark.parametrize("sliding", [False, True])
def test_context_rows_written_on_the_kernel_equal_torchs(sliding):
    """DrafterContext.append on the Triton kernel (rope_and_write with no query heads) fills the rings as
    torch's form does: runs that wrap the rings, a run longer than a ring (its newest rows kept), and
    sliding layers' smaller rings."""
    from helpers import drafter_config, tiny_drafter, tiny_target

    from deepflash.drafter.context import DrafterContext

    target = tiny_target()
    drafter = tiny_drafter(drafter_config(target.cfg, layers=2, sliding=sliding, window=4, block_size=6),
                           dtype=torch.float32).to(DEVICE)
    feats = torch.randn(40, drafter.fc.in_features, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    contexts = [DrafterContext(drafter, 12, slack=6, kernels=kernels) for kernels in ("torch", "triton")]
    for lo, hi in [(0, 9), (9, 15), (15, 21), (21, 40)]:  # the last run is longer than every ring
        for context in contexts:
            context.append(torch.arange(lo, hi, device=DEVICE), feats[lo:hi])
        for mine, theirs in zip(contexts[1].k + contexts[1].v + contexts[1].tags,
                                contexts[0].k + contexts[0].v + contexts[0].tags):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
