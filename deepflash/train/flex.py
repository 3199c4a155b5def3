"""flex_attention for packed training blocks on CUDA (compiled once; the explicit mask serves the CPU)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_attend(q, k, v, block_mask):
    return _compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=True)


def block_mask_for(mask_mod, q_len: int, kv_len: int, device, batch: int | None = None):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(mask_mod, B=batch, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=device)
