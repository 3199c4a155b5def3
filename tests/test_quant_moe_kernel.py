"""The routed experts straight from GGUF-quantized expert weights (kernels/quant_moe.py, on the CPU in Triton's
interpreter: helpers.triton_device): its torch reference against a dense computation from every expert's
dequantized weights, the kernels against the reference for k-quants, Q8_0 and the 32-weight formats (gate and
up of different formats, partial tiles and steps), unrouted experts never read, and a token's result the same
bits whatever the step's other tokens (their number and their routing)."""

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from helpers import triton_device

from deepflash.kernels import quant_moe
from deepflash.quant.gguf_blocks import FORMATS, dequantize, random_blocks

DEVICE = triton_device()
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 10, 11, 12, 13, 14
NUM_EXPERTS, TOP_K = 8, 2


def expert_stacks(formats, hidden, inner, seed=0):
    """gate, up uint8 [E, I, row_bytes(H)] and down [E, H, row_bytes(I)] of random blocks (weights of about
    0.3-1: outputs of about 1)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = ((inner, hidden), (inner, hidden), (hidden, inner))
    return tuple(random_blocks(NUM_EXPERTS * rows, cols, FORMATS[fmt], gen, scale=4.0).view(NUM_EXPERTS, rows, -1)
                 for fmt, (rows, cols) in zip(formats, shapes))


def routing(kind, n, dtype, seed=0):
    """(experts int64, weights in dtype) [n, TOP_K], distinct experts per token. spread: any experts; crowded:
    every token's first choice is expert 2, its second one of the first few; half unused: the lower half only."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(n, NUM_EXPERTS, generator=gen)
    if kind == "crowded":
        scores[:, 2] = 2.0
        scores[:, TOP_K + 2:] = -1.0
    elif kind == "half unused":
        scores[:, NUM_EXPERTS // 2:] = -1.0
    weights, experts = scores.topk(TOP_K, dim=-1)
    weights = weights.abs() / weights.abs().sum(-1, keepdim=True)
    return experts, weights.to(dtype)


def name(value) -> str:
    """Test ids: format names for tuples of ggml types."""
    if isinstance(value, tuple):
        return "-".join(FORMATS[f].name for f in value)
    return str(value).replace("torch.", "")


def tokens(n, hidden, dtype, seed=1):
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


def kernel(x, experts, weights, stacks, formats):
    args = [t.to(DEVICE) for t in (x, experts, weights, *stacks)]
    return quant_moe.routed_experts(*args, formats).cpu()


def dense(x, experts, weights, stacks, formats):
    """Every expert's weights dequantized (gguf_blocks.dequantize, float32, rounded to x's dtype), then each
    token's experts one at a time in float64, rounding the activation to x's dtype as the kernels do."""
    gate, up, down = (dequantize(s, FORMATS[f], x.dtype).double() for s, f in zip(stacks, formats))
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        row = x[t].double()
        for slot in range(experts.shape[1]):
            e = int(experts[t, slot])
            hidden = (F.silu(gate[e] @ row) * (up[e] @ row)).to(x.dtype).double()
            out[t] += float(weights[t, slot]) * (down[e] @ hidden)
    return out


def assert_near(got, want, dtype):
    """float32: within 1e-5 of the largest value; bf16: within a few bf16 roundings (an activation or result
    near a rounding boundary may round the other way)."""
    scale = want.abs().max().item()
    assert scale > 0.05, scale  # not vanishingly small outputs
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-5 * scale)
    else:
        torch.testing.assert_close(got.double(), want.double(), rtol=2 ** -7, atol=2 ** -7 * scale)


def test_api():
    assert quant_moe.fits(torch.zeros(1, 256, dtype=torch.bfloat16))
    assert quant_moe.fits(torch.zeros(16, 256, dtype=torch.float32))
    assert not quant_moe.fits(torch.zeros(17, 256, dtype=torch.bfloat16))
    assert not quant_moe.fits(torch.zeros(4, 256, dtype=torch.float16))
    with pytest.raises(AssertionError):
        kernel(tokens(17, 256, torch.float32), *routing("spread", 17, torch.float32),
               expert_stacks((Q8_0, Q8_0, Q8_0), 256, 256), (Q8_0, Q8_0, Q8_0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("formats, hidden, inner", [
    ((Q4_K, Q4_K, Q6_K), 256, 512), ((Q8_0, Q8_0, Q8_0), 256, 256), ((Q5_1, Q4_0, Q5_0), 288, 352),
    ((Q2_K, Q3_K, Q5_K), 256, 256), ((Q4_K, Q8_0, Q4_1), 256, 320)], ids=name)
def test_reference_matches_every_expert_dequantized(formats, hidden, inner, dtype):
    """The torch reference (each slot's routed experts gathered, then dequantized) against every expert
    dequantized and each token's experts applied one at a time."""
    stacks = expert_stacks(formats, hidden, inner)
    for kind, n in (("spread", 5), ("crowded", 3)):
        x, (experts, weights) = tokens(n, hidden, dtype), routing(kind, n, dtype)
        got = quant_moe.reference(x, experts, weights, *stacks, formats)
        assert got.dtype == dtype and got.shape == (n, hidden)
        assert_near(got, dense(x, experts, weights, stacks, formats).to(dtype), dtype)


CASES = [((Q4_K, Q4_K, Q6_K), 256, 512, torch.bfloat16, "crowded"),
         ((Q4_K, Q4_K, Q6_K), 256, 512, torch.float32, "spread"),
         ((Q8_0, Q8_0, Q8_0), 256, 256, torch.float32, "crowded"),
         ((Q8_0, Q8_0, Q8_0), 256, 256, torch.bfloat16, "spread"),
         # 32-weight formats, gate and up of different formats: 9 and 11 blocks (a step of 8 and a partial one),
         # 288 and 352 rows (partial tiles of weight rows)
         ((Q5_1, Q4_0, Q4_1), 288, 352, torch.float32, "spread"),
         ((Q2_K, Q5_K, Q3_K), 256, 256, torch.bfloat16, "spread"),
         ((Q4_K, Q8_0, Q5_0), 256, 256, torch.float32, "crowded")]


@pytest.mark.parametrize("formats, hidden, inner, dtype, kind", CASES, ids=name)
def test_kernel_matches_reference(formats, hidden, inner, dtype, kind):
    stacks = expert_stacks(formats, hidden, inner, seed=sum(formats))
    x, (experts, weights) = tokens(5, hidden, dtype), routing(kind, 5, dtype)
    got = kernel(x, experts, weights, stacks, formats)
    assert got.dtype == dtype and got.shape == (5, hidden)
    assert_near(got, quant_moe.reference(x, experts, weights, *stacks, formats), dtype)


def test_reference_has_no_host_sync():
    """The reference traces as one graph (dynamo fullgraph, no compiler: a .tolist(), .item() or a shape that
    depends on the routing raises), so that a step running it can be captured as a CUDA graph."""
    torch._dynamo.reset()
    formats = (Q4_K, Q8_0, Q6_K)
    stacks = expert_stacks(formats, 256, 256)
    x, (experts, weights) = tokens(5, 256, torch.float32), routing("crowded", 5, torch.float32)
    traced = torch.compile(lambda *a: quant_moe.reference(*a, *stacks, formats), fullgraph=True, backend="eager")
    assert torch.equal(traced(x, experts, weights), quant_moe.reference(x, experts, weights, *stacks, formats))


def test_unrouted_experts_are_never_read():
    """The upper half of the experts, routed by no token, is all 0xFF bytes (NaN scales): the result is finite
    and as before."""
    formats = (Q4_K, Q4_K, Q6_K)
    stacks = expert_stacks(formats, 256, 256, seed=3)
    x, (experts, weights) = tokens(6, 256, torch.float32), routing("half unused", 6, torch.float32)
    want = kernel(x, experts, weights, stacks, formats)
    for s in stacks:
        s[NUM_EXPERTS // 2:] = 255
    got = kernel(x, experts, weights, stacks, formats)
    assert torch.isfinite(got).all() and torch.equal(got, want)


@pytest.mark.parametrize("formats, dtype", [((Q4_K, Q4_K, Q6_K), torch.bfloat16), ((Q8_0, Q5_1, Q8_0), torch.float32)],
                         ids=["Q4_K-Q6_K-bf16", "Q8_0-Q5_1-f32"])
def test_a_verified_token_is_computed_exactly_as_a_decoded_one(formats, dtype):
    """A 16-token call (a verify step) gives each token the bits a 1-token call (a decode step) gives it, and a
    token's result keeps its bits when the other tokens route elsewhere (crowding its experts or leaving them)."""
    hidden, inner = 256, 512
    stacks = expert_stacks(formats, hidden, inner, seed=7)
    x, (experts, weights) = tokens(16, hidden, dtype), routing("spread", 16, dtype)
    verify = kernel(x, experts, weights, stacks, formats)
    for t in range(16):
        assert torch.equal(kernel(x[t:t + 1], experts[t:t + 1], weights[t:t + 1], stacks, formats), verify[t:t + 1]), t
    kept = torch.tensor([0, 5, 11])
    for kind, seed in (("crowded", 1), ("half unused", 2), ("spread", 3)):
        other_experts, other_weights = routing(kind, 16, dtype, seed)
        other_experts[kept], other_weights[kept] = experts[kept], weights[kept]
        got = kernel(x, other_experts, other_weights, stacks, formats)
        assert torch.equal(got[kept], verify[kept]), kind
