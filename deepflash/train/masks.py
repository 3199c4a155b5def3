"""Attention masks of a packed training forward: A anchor blocks of B tokens over one sequence.

Keys are [context positions 0..L-1, then the A*B block tokens]; queries are the block tokens.
Block a (anchor position p_a) query k sits at position p_a + k. It may see:
  - context position j iff j < p_a (strictly before the anchor), and for sliding layers
    (p_a + k) - j < window;
  - its own block's tokens only (blocks never see each other): all of them in full-attention layers,
    k' <= k in causal (sliding) layers, and |k - k'| < window for sliding layers.
The same rule is given as an explicit boolean mask (SDPA, CPU) and as a flex_attention mask_mod (CUDA).
A batch of sequences gives one row of anchors per sequence, and the masks gain a batch dimension.
"""

from __future__ import annotations

import torch


def query_layout(anchors: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For A anchors: per query its block index, offset k and absolute position ([A*B] each)."""
    a = anchors.shape[0]
    block_id = torch.arange(a, device=anchors.device).repeat_interleave(block)
    offset = torch.arange(block, device=anchors.device).repeat(a)
    return block_id, offset, anchors[block_id] + offset


def training_mask(anchors: torch.Tensor, seq_len: int, block: int, causal: bool, window: int | None) -> torch.Tensor:
    """Boolean [..., A*B, seq_len + A*B] for anchors [..., A] (one row of anchors per sequence): True
    where a query may attend."""
    block_id, offset, _ = query_layout(anchors.new_zeros(anchors.shape[-1]), block)
    anchor = anchors[..., block_id, None]  # [..., A*B, 1]
    ctx_pos = torch.arange(seq_len, device=anchors.device)
    ctx = ctx_pos < anchor
    if window is not None:
        ctx &= anchor + offset[:, None] - ctx_pos < window
    same = block_id[:, None] == block_id[None, :]
    diff = offset[:, None] - offset[None, :]
    own = same & (diff >= 0) if causal else same
    if window is not None:
        own &= diff.abs() < window
    return torch.cat([ctx, own.expand(*ctx.shape[:-1], own.shape[-1])], dim=-1)


def training_mask_mod(anchors: torch.Tensor, seq_len: int, block: int, causal: bool, window: int | None):
    """The same rule as a flex_attention mask_mod(b, h, q, kv), for anchors [A] or [batch, A]."""
    rows = anchors.reshape(-1, anchors.shape[-1])
    block_id, offset, _ = query_layout(rows[0], block)
    seq_len = torch.tensor(seq_len, device=anchors.device)  # a tensor, not a constant of the compiled kernel
    big = 1 << 30
    win = window if window is not None else big

    def mask_mod(b, h, q, kv):
        in_ctx = kv < seq_len
        kb = (kv - seq_len).clamp(min=0)
        anchor = rows[b, block_id[q]]
        ctx_ok = (kv < anchor) & (anchor + offset[q] - kv < win)
        d = offset[q] - offset[kb]
        own_ok = (block_id[q] == block_id[kb]) & (d.abs() < win)
        if causal:
            own_ok = own_ok & (d >= 0)
        return torch.where(in_ctx, ctx_ok, own_ok)

    return mask_mod


def loss_weights(block: int, gamma: float) -> torch.Tensor:
    """Weight of block position k = 1..B-1: exp(-(k-1)/gamma), so k = 1 weighs 1."""
    k = torch.arange(1, block, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def default_gamma(block: int) -> float:
    """The recipe's decay: 7 for B=16, 5 for B=10, 4 for B=8; proportional in between."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block, max(1.0, block * 7 / 16))
