"""Static, preallocated KV cache for attention layers.

Slot == absolute position. A forward at positions [p, p+T) writes slots p..p+T-1 and attends with a
causal mask over slots < kv_len, so whatever sits past the newest position is never read. Rolling
back to length n is therefore free: the caller simply continues at position n. That is what lets a
verify forward write B speculative rows and keep only the accepted prefix.
"""

from __future__ import annotations

import torch


class KVCache:
    has_state = False  # per-sequence state besides KV (hybrid_cache.HybridCache)

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [B, Hkv, T, D] for the T given positions."""
        self.k[layer].index_copy_(2, positions, k)
        self.v[layer].index_copy_(2, positions, v)

    def slots(self, positions: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, int]:
        """Where the positions' K/V sit and how many slots attention spans: the positions themselves and
        kv_len here; a bounded cache (kv_budget.py) maps them into its pool."""
        return positions, kv_len

    def note_query(self, layer: int, q: torch.Tensor) -> None:
        """A step's queries q [B, H, T, D] of `layer`: a bounded cache scores its pages with them."""

    def read(self, layer: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer, :, :, :kv_len], self.v[layer, :, :, :kv_len]

    def save_span(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of positions [lo, hi) of the first sequence: K and V [layers, Hkv, hi - lo, D] (the prefix
        cache's block data)."""
        return self.k[:, 0, :, lo:hi].clone(), self.v[:, 0, :, lo:hi].clone()

    def load_span(self, lo: int, span: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Write save_span's K and V back at positions [lo, lo + n) (host tensors copy asynchronously)."""
        n = span[0].shape[-2]
        self.k[:, 0, :, lo : lo + n].copy_(span[0], non_blocking=True)
        self.v[:, 0, :, lo : lo + n].copy_(span[1], non_blocking=True)

    def volatile(self) -> list[torch.Tensor]:
        """Buffers a discarded forward (a graph warm-up) would corrupt: none, rows past the committed
        length are never read (see module doc). Recurrent caches return their states."""
        return []

    def keep(self, kept: int) -> None:
        """Of the last forward's tokens keep the first `kept`. Attention rows need nothing (see module doc);
        recurrent caches of hybrid models override this."""


def hidden_keys(positions: torch.Tensor, kv_len: int, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The causal mask's complement, True where a query must not look: boolean [T, kv_len], or
    [B, 1, T, kv_len] with a per-row key mask for left-padded batches. Complement because masked_fill
    takes it so (layers.fold_hidden): negating a mask costs a temporary of its size. Real tokens never
    see padding; padding queries see the causal prefix so that no row is fully masked (a fully masked
    row would turn into NaN and poison the cache)."""
    hidden = torch.arange(kv_len, device=positions.device)[None, :] > positions[:, None]
    if key_mask is None:
        return hidden
    padding = ~key_mask[:, None, :kv_len]
    real_query = key_mask[:, positions, None]
    return (hidden[None] | (padding & real_query))[:, None]
