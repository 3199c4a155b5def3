"""The routed experts (layers.Experts): the torch forms and the Triton kernels (kernels/moe.py, on the CPU
in Triton's interpreter: helpers.triton_device) compute what gathering each token's experts' weights does,
and no form syncs with the host (a step is captured as a CUDA graph)."""

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from helpers import llama_config, triton_device

from deepflash.kernels.config import SHIPPED
from deepflash.models import random_model
from deepflash.models.layers import SparseMoe

DEVICE = triton_device()
ROUTINGS = ["spread", "crowded", "half unused"]


def gathered(x, experts, weights, gate_up, down):
    """The former decode path: each (token, slot) pair's expert weights gathered, a [N, k, 2I, H] copy."""
    gate, up = torch.einsum("nh,nkih->nki", x, gate_up[experts]).chunk(2, dim=-1)
    out = torch.einsum("nki,nkhi->nkh", F.silu(gate) * up, down[experts])
    return (out * weights[..., None].to(out.dtype)).sum(1)


def routing(kind: str, n: int, num_experts: int, top_k: int, dtype, seed: int = 0):
    """(experts, weights) [n, top_k] as the router gives them, distinct experts per token. spread: any
    experts; crowded: every token's first choice is expert 2, the rest from the first few; half unused:
    nobody picks the upper half."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(n, num_experts, generator=gen)
    if kind == "crowded":
        scores[:, 2] = 2.0
        scores[:, top_k + 2 :] = -1.0
    elif kind == "half unused":
        scores[:, num_experts // 2 :] = -1.0
    weights, experts = scores.topk(top_k, dim=-1)
    weights = weights.abs() / weights.abs().sum(-1, keepdim=True)
    return experts, weights.to(dtype)


def moe_layer(dtype, num_experts=8, hidden=32, inner=24, top_k=3, device="cpu", seed=0) -> SparseMoe:
    gen = torch.Generator().manual_seed(seed)
    moe = SparseMoe(hidden, inner, num_experts, top_k, normalize=True)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return moe.to(device, dtype).requires_grad_(False)


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("n", [1, 2, 5, 16, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_torch_forms_match_the_gathered_experts(dtype, n, kind):
    """The dense form (what forward runs off Hopper GPUs) and the grouped one (F.grouped_mm, run here by
    torch's CPU fallback: it refuses float64)."""
    moe = moe_layer(dtype)
    experts, weights = routing(kind, n, 8, 3, dtype)
    x = torch.randn(n, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    module = moe.experts
    want = gathered(x, experts, weights, module.gate_up_proj, module.down_proj)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(module(x, experts, weights), want, **tol)
    torch.testing.assert_close(module._dense(x, experts, weights), want, **tol)
    if dtype == torch.float32:
        torch.testing.assert_close(module._grouped(x, experts, weights), want, **tol)


@pytest.mark.parametrize("n", [1, 16, 64])
def test_moe_forward_has_no_host_sync(n):
    """The layer traces as one graph (dynamo fullgraph, no compiler: a .tolist(), .item() or an output
    shape that depends on the routing raises), so it can be captured as a CUDA graph: the dense form in
    float32, and the grouped form in bfloat16, the one dtype that dynamo traces F.grouped_mm in."""
    torch._dynamo.reset()
    x = torch.randn(1, n, 32, generator=torch.Generator().manual_seed(2))
    moe = moe_layer(torch.float32)
    torch.testing.assert_close(torch.compile(moe, fullgraph=True, backend="eager")(x), moe(x))
    experts, weights = routing("crowded", n, 8, 3, torch.bfloat16)
    grouped = moe_layer(torch.bfloat16).experts
    args = (x[0].bfloat16(), experts, weights)
    torch.testing.assert_close(torch.compile(grouped._grouped, fullgraph=True, backend="eager")(*args),
                               grouped._grouped(*args))


# the kernels' shapes: partial column blocks and reduction steps, a top-k that is not a power of two
EXPERTS, HIDDEN, INNER, TOP_K = 6, 48, 40, 3


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("n", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_torch(dtype, n, kind):
    from deepflash.kernels.moe import routed_experts, routed_experts_torch

    module = moe_layer(dtype, EXPERTS, HIDDEN, INNER, TOP_K, DEVICE).experts
    experts, weights = (t.to(DEVICE) for t in routing(kind, n, EXPERTS, TOP_K, dtype, seed=n))
    x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    args = (x, experts, weights, module.gate_up_proj, module.down_proj)
    got = routed_experts(*args)
    assert got.dtype == dtype and got.shape == x.shape
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, routed_experts_torch(*args), **tol)
    # the former path in float32, against whose rounding bfloat16 differs by more
    want = gathered(*(t.float() if t.is_floating_point() else t for t in args)).to(dtype)
    torch.testing.assert_close(got, want, **(tol if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_computes_a_token_as_alone(dtype):
    """Bit for bit, a token of a verify step's block comes out as in a decode step of its own, whatever the
    block's other tokens route to (here all of them share expert 2)."""
    from deepflash.kernels.moe import routed_experts

    module = moe_layer(dtype, EXPERTS, HIDDEN, INNER, TOP_K, DEVICE).experts
    experts, weights = (t.to(DEVICE) for t in routing("crowded", 5, EXPERTS, TOP_K, dtype))
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    block = routed_experts(x, experts, weights, module.gate_up_proj, module.down_proj)
    for i in range(5):
        alone = routed_experts(x[i : i + 1], experts[i : i + 1], weights[i : i + 1], module.gate_up_proj,
                               module.down_proj)
        assert torch.equal(block[i : i + 1], alone), i


def test_kernels_in_the_model():
    """A Qwen3-MoE target on the Triton kernels (use_kernels): prefill (more rows than the kernels take:
    the torch form) then decode steps (the kernels) give the torch kernels' logits."""
    cfg = llama_config(model_type="qwen3_moe", num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                       moe_intermediate_size=INNER, norm_topk_prob=True, num_hidden_layers=2)
    models = [random_model(cfg, DEVICE, torch.float32, std=0.2) for _ in range(2)]
    models[1].use_kernels("triton")
    blocks = [m for m in models[1].modules() if isinstance(m, SparseMoe)]
    assert [m.kernels for m in blocks] == [m.experts.kernels for m in blocks] == [SHIPPED] * 2
    caches = [m.new_cache(1, 32) for m in models]
    ids = torch.randint(0, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    outs = [m(ids, torch.arange(20, device=DEVICE), c, 20)[0] for m, c in zip(models, caches)]
    for pos in (20, 21):
        step, positions = ids[:, pos - 20 : pos - 19], torch.tensor([pos], device=DEVICE)
        outs += [m(step, positions, c, 24)[0] for m, c in zip(models, caches)]
    for torch_logits, triton_logits in zip(outs[::2], outs[1::2]):
        torch.testing.assert_close(triton_logits, torch_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("count, top_k", [(128, 8), (60, 4)])  # Qwen3-30B-A3B's router; a width padded in the kernel
def test_router_kernel_chooses_what_torch_does(count, top_k, normalize):
    from deepflash.kernels import router

    logits = torch.randn(16, count, generator=torch.Generator().manual_seed(count)).to(DEVICE)
    torch_router = SparseMoe(8, 8, count, top_k, normalize).gate
    want = torch_router.choose(logits, torch.bfloat16)
    got = router.route(logits, top_k, normalize, torch.bfloat16)
    assert torch.equal(got[0], want[0])  # the same experts, in decreasing probability
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


def test_a_blocks_rows_route_as_one_row():
    """With the kernels on, 16 rows route each row with the bits one row gets (the logits on kernels/gemv.py, the
    rest in kernels/router.py): a verify step's tokens take a decode step's experts and weights."""
    moe = moe_layer(torch.float32, 64, 96, 16, 8, DEVICE)
    moe.kernels = SHIPPED
    x = torch.randn(16, 96, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    experts, weights = moe._route(x)
    for i in range(16):
        alone = moe._route(x[i : i + 1])
        assert torch.equal(alone[0], experts[i : i + 1]) and torch.equal(alone[1], weights[i : i + 1]), i


@pytest.mark.parametrize("form", ["_dense", "_grouped"])
def test_qwen3_5_moe_block_rounds_no_worse_than_transformers(form):
    """In bfloat16 the Qwen3.5-MoE block (routed and shared experts) strays from transformers' block in float32
    no further than transformers' own bfloat16 block does, on rows whose routing bfloat16 leaves as in float32
    (a row routed otherwise is off by whole experts, in both). Run on the torch forms: the kernels' bfloat16
    results are truncated in Triton's interpreter, which rounds to nearest on the GPU."""
    import transformers
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    from deepflash.bench.families import family_shape
    from deepflash.models.config import ModelConfig
    from deepflash.models.qwen3_5 import SharedExpertMoe
    from deepflash.quant.experts import add_shared

    shape = family_shape("qwen3.5-moe", "tiny")
    config = transformers.Qwen3_5MoeTextConfig(**{k: v for k, v in shape.items() if k != "model_type"})
    theirs = Qwen3_5MoeSparseMoeBlock(config).requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    for p in theirs.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    ours = SharedExpertMoe(ModelConfig.from_hf(config.to_dict()))
    ours.load_state_dict(theirs.state_dict())
    ours = ours.bfloat16().requires_grad_(False)
    torch_form = getattr(ours.experts, form)
    ours.experts.forward = lambda x, experts, weights, shared: add_shared(torch_form(x, experts, weights), shared)
    x = torch.randn(1, 300, config.hidden_size, generator=torch.Generator().manual_seed(1))
    want, routed = theirs(x)[0], theirs.gate(x)[2].sort(-1).values
    theirs.bfloat16()
    kept = (theirs.gate(x.bfloat16())[2].sort(-1).values == routed).all(-1)
    assert kept.sum() > 250

    def error(block: torch.nn.Module) -> float:
        return float((block(x.bfloat16())[0].float() - want)[kept].norm())

    assert error(ours) <= 1.02 * error(theirs)
