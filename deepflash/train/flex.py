"""flex_attention for packed training blocks on CUDA (the explicit mask serves the CPU).

Compiled with dynamic shapes: training batches come in many lengths (context rounded up to --pad-to,
sequences per part), and compiled for static shapes each was a new compile, until dynamo's recompile
limit (8) sent the rest to the unfused path, which materializes every score: 6.07 s a step against the
explicit mask's 0.65 (H200). The mask_mod (masks.training_mask_mod) reads the
context length from a tensor for the same reason: a Python int would be guarded on."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=None)


def flex_attend(q, k, v, block_mask):
    return _compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=True)


@dataclass(frozen=True)
class FlexMask:
    """A flex_attention BlockMask over keys [context, block], as drafter.model.attend takes masks."""

    block_mask: object

    def attend(self, q, ctx_k, ctx_v, k, v):
        return flex_attend(q, torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2), self.block_mask)


def block_mask_for(mask_mod, q_len: int, kv_len: int, device, batch: int | None = None) -> FlexMask:
    from torch.nn.attention.flex_attention import create_block_mask

    return FlexMask(create_block_mask(mask_mod, B=batch, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=device))
