"""The gated delta rule of Gated DeltaNet: a recurrent form, a chunked form and the state after a prefix.

Per head, with a state S [Dk, Dv], a decay g_t <= 0 (log space) and a write strength beta_t in (0, 1):

    S_t   = exp(g_t) S_{t-1} + k_t delta_t^T,   delta_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)
    out_t = S_t^T q_t

delta_t is what token t writes into the state. Both forms return the deltas (they fall out of the
computation), and with them the state after any prefix of the run has a closed form
(`state_after_prefix`): that is how a verify on these forms is rolled back without re-running it. It
rounds apart from feeding the prefix token by token, as the chunked form does from decode steps; the
Triton path (kernels/delta_rule.py), which must match decode bit for bit, replays the prefix instead.

Tensors here are [B, H, T, D] with q and k already L2-normalised and expanded to the value heads,
q scaled by Dk^-0.5, all in the compute dtype (float32, or float64 for float64 models).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # the Triton kernels of flash-linear-attention (CUDA only); the torch forms below are the reference
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
except ImportError:
    chunk_gated_delta_rule = fused_recurrent_gated_delta_rule = None

CHUNK = 64


def fla_available(device: torch.device) -> bool:
    return chunk_gated_delta_rule is not None and device.type == "cuda"


def recurrent_form(q, k, v, g, beta, state):
    """Token by token. Returns out [B,H,T,Dv], the final state and the deltas."""
    outs, deltas = [], []
    for t in range(q.shape[2]):
        state = state * g[:, :, t, None, None].exp()
        predicted = (k[:, :, t, None, :] @ state).squeeze(2)
        delta = beta[:, :, t, None] * (v[:, :, t] - predicted)
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append((q[:, :, t, None, :] @ state).squeeze(2))
        deltas.append(delta)
    return torch.stack(outs, 2), state, torch.stack(deltas, 2)


def chunked_form(q, k, v, g, beta, state, chunk: int = CHUNK):
    """Chunks of `chunk` tokens: inside a chunk the deltas solve one unit lower-triangular
    system (the WY / UT transform), so a chunk costs a few matmuls instead of `chunk` sequential steps.
    Same returns as `recurrent_form`."""
    b, h, t, _ = k.shape
    chunk = min(chunk, t)  # a short run is one unpadded chunk
    pad = -t % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))  # padded tokens: no decay, no write
    q, k, v = (x.reshape(b, h, -1, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(b, h, -1, chunk) for x in (g, beta))

    cum = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # delta = u - w @ S_chunk_start, from (I + A) delta = beta v - beta exp(cum) k^T S with A strictly lower
    system = (k_beta @ k.transpose(-1, -2) * decay).tril(-1) + torch.eye(chunk, dtype=q.dtype, device=q.device)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    scores = q @ k.transpose(-1, -2) * decay
    q_from_start = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]

    outs, deltas = [], []
    for i in range(q.shape[2]):
        delta = u[:, :, i] - w[:, :, i] @ state
        outs.append(q_from_start[:, :, i] @ state + scores[:, :, i] @ delta)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ delta
        deltas.append(delta)
    out = torch.cat(outs, 2)[:, :, :t]
    return out, state, torch.cat(deltas, 2)[:, :, :t]


def state_after_prefix(k, g, deltas, state, n):
    """The state after the first n tokens of a run that started from `state` with keys k, decays g and the
    deltas it returned: S_n = exp(G_n) S_0 + sum_{j<n} exp(G_n - G_j) k_j delta_j^T with G the inclusive
    cumsum of g. n is an int or a 0-dim device tensor: fixed shapes and no host sync, so CUDA graphs can
    capture it."""
    cum = g.cumsum(-1)
    j = torch.arange(cum.shape[-1], device=cum.device)
    last = torch.where(j == n - 1, cum, 0).sum(-1)  # G_n; 0 for n == 0
    weights = (last[..., None] - cum).masked_fill(j >= n, float("-inf")).exp()
    return state * last.exp()[..., None, None] + (k * weights[..., None]).transpose(-1, -2) @ deltas


def fla_form(q, k, v, g, beta, state, recurrent: bool):
    """The fla Triton kernels on [B, T, H, D] inputs (raw q, k: the kernel normalises them).
    They return no deltas, so a run that must be rolled back by capture uses the torch forms."""
    kernel = fused_recurrent_gated_delta_rule if recurrent else chunk_gated_delta_rule
    out, state = kernel(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
    return out, state
