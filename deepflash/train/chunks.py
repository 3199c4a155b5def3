"""Packed-block training attention in query chunks (the SDPA path of training).

A training forward's queries are A anchor blocks of B tokens; its keys are [context (L), all A*B block
tokens] (masks.py). Every query sees only B of the A*B block keys, yet a dense masked attention scores
all of them: with A*B = 4096 queries that is 4096 extra keys per query, more than the context itself for
most training sequences, and SDPA's memory-efficient kernel skips no masked tile. Splitting the queries
into chunks of `blocks` anchor blocks, each chunk attending to [context, its own blocks' tokens], leaves
every query's allowed keys (and so the result) unchanged and shrinks the key range to L + blocks * B.
The price is one copy of the context K/V per chunk, bytes where the attention saved FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.layers import attention, fold_mask
from .masks import training_mask


@dataclass(frozen=True)
class ChunkedMask:
    """The training mask of one layer kind, chunked: additive [b * n, 1, G * C, L + C] (fold_mask's
    form) for n chunks of C queries each."""

    folded: torch.Tensor
    chunks: int

    def attend(self, q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """drafter.model.attend for this mask (chunked_attend)."""
        return chunked_attend(q, ctx_k, ctx_v, k, v, self)


def chunked_mask(anchors: torch.Tensor, seq_len: int, block: int, causal: bool, window: int | None,
                 blocks: int, groups: int, dtype: torch.dtype) -> ChunkedMask:
    """For anchors [b, A] with A a multiple of `blocks` (anchor blocks per chunk); `groups` query heads
    per K/V head. Each chunk's mask is training_mask of its own anchors."""
    b, a = anchors.shape
    if a % blocks:
        raise ValueError(f"{a} anchors do not split into chunks of {blocks}")
    mask = training_mask(anchors.view(b, a // blocks, blocks), seq_len, block, causal, window)  # [b, n, C, L + C]
    return ChunkedMask(fold_mask(mask.flatten(0, 1)[:, None], groups, dtype), a // blocks)


def chunked_attend(q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: ChunkedMask) -> torch.Tensor:
    """Block queries q [b, H, Q, D] over context K/V [b, Hkv, L, D] and block K/V [b, Hkv, Q, D], chunk by
    chunk in one SDPA call (the chunks ride in the batch dimension); returns [b, H, Q, D]."""
    b, h, t, d = q.shape
    n = mask.chunks

    def per_chunk(x: torch.Tensor) -> torch.Tensor:  # [b, heads, Q, D] -> [b, n, heads, C, D]
        return x.unflatten(2, (n, t // n)).transpose(1, 2)

    def keys(ctx: torch.Tensor, own: torch.Tensor) -> torch.Tensor:  # [b * n, Hkv, L + C, D]
        return torch.cat([ctx[:, None].expand(-1, n, -1, -1, -1), per_chunk(own)], dim=3).flatten(0, 1)

    out = attention(per_chunk(q).flatten(0, 1), keys(ctx_k, k), keys(ctx_v, v), mask.folded)
    return out.unflatten(0, (b, n)).transpose(1, 2).flatten(2, 3)
