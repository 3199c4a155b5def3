"""kernels/delta_inputs.py, the DeltaNet step's conv, norms and gates in one kernel, against the torch form of
models/gated_deltanet.py, and a verify's tokens computed bit for bit as decode steps compute them (on the CPU in
Triton's interpreter: helpers.triton_device)."""

import pytest
import torch
import torch.nn.functional as F
from helpers import triton_device

from deepflash.kernels.delta_inputs import delta_inputs
from deepflash.models.gated_deltanet import depthwise_conv, l2_normalize

DEVICE = triton_device()
HEADS, WIDTH = (2, 4), 3  # key and value heads (each key head serves two value heads); the conv keeps 3 inputs


def step(tokens: int, dims=(16, 8), seed=0):
    """A step's inputs: qkv, b and a as slices of one wider projection output (as the fused projection gives
    them), a conv state, the conv weight and the gates' parameters."""
    gen = torch.Generator().manual_seed(seed)
    (hk, hv), (dk, dv) = HEADS, dims
    channels = 2 * hk * dk + hv * dv
    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE)

    proj = rand(2, tokens, channels + 5 + 2 * hv)  # 5 columns of another projection between qkv and b
    qkv, b, a = proj[..., :channels], proj[..., channels + 5 : channels + 5 + hv], proj[..., channels + 5 + hv :]
    return dict(qkv=qkv, b=b, a=a, conv=rand(2, channels, WIDTH), conv_weight=rand(channels, 1, WIDTH + 1),
                a_log=0.5 * rand(hv), dt_bias=rand(hv))


def reference(inputs, fresh: bool, dims):
    """GatedDeltaNet's torch form of the same computation: (q, k, v, g, beta, window) in the kernel's layouts."""
    (hk, hv), (dk, dv) = HEADS, dims
    qkv, conv = inputs["qkv"], inputs["conv"]
    batch, tokens, _ = qkv.shape
    window = torch.cat([torch.zeros_like(conv) if fresh else conv, qkv.transpose(1, 2)], dim=-1)
    mixed = F.silu(depthwise_conv(window, inputs["conv_weight"])).transpose(1, 2)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q = l2_normalize(q.reshape(batch, tokens, hk, dk)) / dk**0.5
    k = l2_normalize(k.reshape(batch, tokens, hk, dk))
    v = v.reshape(batch, tokens, hv, dv)
    g = -inputs["a_log"].exp() * F.softplus(inputs["a"] + inputs["dt_bias"])
    if fresh:
        g[:, 0] = float("-inf")
    beta = inputs["b"].sigmoid()
    return tuple(x.transpose(1, 2) for x in (q, k, v, g, beta)) + (window,)


def run(inputs, fresh: bool, dims, window: bool = True):
    """The kernel on copies of the inputs: (q, k, v, g, beta, window) and the conv state it leaves."""
    conv = inputs["conv"].clone()
    tokens = inputs["qkv"].shape[1]
    out = torch.empty(2, conv.shape[1], WIDTH + tokens, device=DEVICE) if window else None
    flag = torch.tensor([fresh], device=DEVICE)
    got = delta_inputs(inputs["qkv"], inputs["b"], inputs["a"], conv, inputs["conv_weight"], flag, inputs["a_log"],
                       inputs["dt_bias"], HEADS, dims, out)
    return got + (out,), conv


@pytest.mark.parametrize("dims", [(16, 8), (12, 20)])  # Dk != Dv; head widths padded to a power of two
@pytest.mark.parametrize("tokens", [1, 2, 16])  # fewer and more tokens than the conv keeps
@pytest.mark.parametrize("fresh", [False, True])
def test_kernel_matches_the_torch_form(tokens, fresh, dims):
    inputs = step(tokens, dims, seed=tokens)
    got, conv = run(inputs, fresh, dims)
    want = reference(inputs, fresh, dims)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "window"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(conv, want[-1][..., -WIDTH:], rtol=0, atol=0)  # the last inputs, as stored


def test_a_verified_token_is_computed_exactly_as_a_decoded_one():
    """16 one-token steps, each from the conv state the last left (decode steps), give the bits of one 16-token
    step, and leave its conv state."""
    dims = (16, 8)
    inputs = step(16, dims)
    block, block_conv = run(inputs, False, dims, window=False)
    conv = inputs["conv"]
    for t in range(16):
        token = dict(inputs, qkv=inputs["qkv"][:, t : t + 1], b=inputs["b"][:, t : t + 1], a=inputs["a"][:, t : t + 1],
                     conv=conv)
        alone, conv = run(token, False, dims, window=False)
        for name, a, b in zip(("q", "k", "v", "g", "beta"), alone, block):
            assert torch.equal(a[:, :, 0], b[:, :, t]), (name, t)
    assert torch.equal(conv, block_conv)
