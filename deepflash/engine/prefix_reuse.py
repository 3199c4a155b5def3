"""The engine's side of the prefix cache (prefix_cache.py): what a request restores before its prefill, and
what it saves, block by block, as its prefill computes them.

Outputs never depend on the cache, to the bit: a restore puts back the values a prefill without the cache
would have computed. A position's values depend on the shapes of the forward that computed it (GEMM and
attention kernels sum in orders that follow the row count), so only positions computed by whole prefill chunks
on the chunk grid are saved, and a restore ends on that grid: the prefill then goes on in the pieces a prefill
from 0 runs there (graphs.prefill_pieces, graphs.chunk_grid). Positions a decode or verify step computed (an
output, which the next turn's prompt repeats) and a prompt's last partial chunk are computed again.

A restore at m writes the cached KV of [0, m) into the target's cache, a hybrid target's states at m, the tap
features of [m - window, m) into the rings, and rebuilds the drafter's context K/V from the mirror in the
prefill's pieces: after a hit the drafter sees what it would have seen without the cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..drafter.features import FeatureStore
from .prefix_cache import ROOT, Block, PrefixCache, block_key


class PrefixReuse:
    def __init__(self, index: PrefixCache, cache, features: FeatureStore | None,
                 catch_up: Callable[[int, int], None], chunk: int):
        """cache: the target's (KVCache or HybridCache); catch_up(begin, end): the drafter's context K/V of
        positions the rings hold (steps.Steps.catch_up); chunk: the prefill chunk, whose grid restores end on
        (index.grid)."""
        self.index, self.cache, self.features = index, cache, features
        self.catch_up, self.chunk = catch_up, chunk
        self.size = index.block_tokens
        self._keys: list[bytes] = []  # the request's full blocks' keys
        self._saved = 0  # full blocks of the request saved (or found cached)

    def restore(self, tokens: list[int]) -> int:
        """Before a prefill of `tokens`: restore its longest cached prefix, at most all but its last token
        (whose logits the prefill computes); return the prefix's length."""
        hit = self.index.lookup(tokens, len(tokens) - 1)
        m = hit.length
        for block in hit.blocks:
            self.cache.load_span(block.start, block.kv)
        if self.cache.has_state and m:
            self.cache.load_state(hit.blocks[-1].state)
        if self.features is not None and m:
            self._restore_features(hit.blocks, m)
        self.index.stats.hit_tokens += m
        self.index.stats.miss_tokens += len(tokens) - m
        self._keys = chain_keys(tokens, self.size)
        self._saved = m // self.size
        return m

    def _restore_features(self, blocks: list[Block], m: int) -> None:
        """The rings' rows of [m - window, m), then the drafter's context K/V from the mirror in the prefill
        chunk's grid (a prefill appends them a piece at a time: the same GEMM shapes give the same rows)."""
        begin = max(0, m - self.features.window)
        device = self.features.ring.data.device
        for block in blocks:
            lo, hi = max(block.start, begin), min(block.end, m)
            if hi > lo:
                rows = block.features[lo - block.start : hi - block.start].to(device, non_blocking=True)
                self.features.store(torch.arange(lo, hi, device=device), rows)
        for lo in range(begin - begin % self.chunk, m, self.chunk):
            self.catch_up(max(lo, begin), min(lo + self.chunk, m))

    def save_prefill(self, tokens: list[int], done: int) -> None:
        """After a prefill piece that leaves [0, done) computed: save the full blocks before the last grid
        point (whole chunks computed them; the piece after the last whole chunk may run positions before it
        again, in another shape), and a hybrid target's states where a block ends at `done` on the grid."""
        whole = done - done % self.chunk
        count = whole // self.size
        states = self.cache.has_state and whole == done and done % self.size == 0
        for i in range(self._saved, count):
            lo, hi = i * self.size, (i + 1) * self.size
            if not self.index.has(self._keys[i]):
                state = self.cache.save_state() if states and hi == done else None
                self.index.insert(Block(self._keys[i], self._keys[i - 1] if i else ROOT, lo, tuple(tokens[lo:hi]),
                                        self.cache.save_span(lo, hi), self._rows(lo, hi, done), state))
        self._saved = max(self._saved, count)

    def _rows(self, lo: int, hi: int, newest: int) -> torch.Tensor | None:
        """The target ring's rows of [lo, hi), where it still holds them: newer positions, up to `newest`,
        have evicted those before newest - window."""
        if self.features is None or lo < newest - self.features.window:
            return None
        ring = self.features.ring
        return ring.data[torch.arange(lo, hi, device=ring.data.device) % ring.capacity]


def chain_keys(tokens: list[int], size: int) -> list[bytes]:
    """The keys of the full blocks of `tokens`."""
    keys, parent = [], ROOT
    for lo in range(0, len(tokens) - size + 1, size):
        parent = block_key(parent, tokens[lo : lo + size])
        keys.append(parent)
    return keys
