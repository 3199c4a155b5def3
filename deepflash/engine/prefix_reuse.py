"""The engine's side of the prefix cache (prefix_cache.py): what a request restores before its prefill, and
what it saves, block by block, once positions are final.

A restore at m writes the cached KV of [0, m) into the target's cache (skipping the positions the cache
already holds for the same tokens: the previous request's), a hybrid target's states at m, the tap features of
[m - window, m) into the rings, and rebuilds the drafter's context K/V from the mirror: after a hit the drafter
sees what it would have seen without the cache, and the prefill continues at m.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..drafter.features import FeatureStore
from .prefix_cache import ROOT, Block, PrefixCache, block_key, common_prefix


class PrefixReuse:
    def __init__(self, index: PrefixCache, cache, features: FeatureStore | None,
                 catch_up: Callable[[int, int], None], chunk: int):
        """cache: the target's (KVCache or HybridCache); catch_up(begin, end): the drafter's context K/V of
        positions the rings hold (steps.Steps.catch_up); chunk: the prefill chunk, whose grid the drafter's
        context is rebuilt on, as a prefill writes it."""
        self.index, self.cache, self.features = index, cache, features
        self.catch_up, self.chunk = catch_up, chunk
        self.size = index.block_tokens
        self.live: list[int] = []  # tokens whose KV sits at their positions in `cache` now
        self._keys: list[bytes] = []  # the request's full blocks' keys
        self._saved = 0  # full blocks of the request saved (or found cached)

    def restore(self, tokens: list[int]) -> int:
        """Before a prefill of `tokens`: restore its longest cached prefix, at most all but its last token
        (whose logits the prefill computes); return the prefix's length."""
        live, self.live = self.live, []
        hit = self.index.lookup(tokens, len(tokens) - 1)
        m = hit.length
        same = common_prefix(live[:m], tokens)
        for block in hit.blocks:
            lo, hi = max(block.start, same), min(block.end, m)
            if hi > lo:
                self.cache.load_span(lo, tuple(t[..., lo - block.start : hi - block.start, :] for t in block.kv))
        if self.cache.has_state and m:
            self.cache.load_state(hit.blocks[-1].state)
        if self.features is not None and m:
            self._restore_features(hit.blocks, m)
        self.index.stats.hit_tokens += m
        self.index.stats.miss_tokens += len(tokens) - m
        self._keys = chain_keys(tokens, self.size)
        self._saved = m // self.size
        self.live = tokens[:m]
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

    def save_prefill(self, tokens: list[int], done: int, final: bool) -> None:
        """After a prefill piece that leaves [0, done) computed: save the full blocks now complete, and on the
        prompt's last piece its tail; a hybrid target's states where a block ends at `done`."""
        self.live = tokens[:done]
        ends_block = final or done % self.size == 0
        states = self.cache.has_state and ends_block
        self._save_blocks(tokens, done // self.size, done, states)
        if final and done % self.size:
            self._save_tail(tokens, done, done, states)

    def save_output(self, tokens: list[int], processed: int, written: int) -> None:
        """After a request: the blocks its output completed, and the tail. `processed`: positions whose KV is
        final; `written`: the positions steps still in flight may reach (they evict older ring rows). A hybrid
        target's states after an output are not kept (steps ran past its end): it resumes only where a
        prefill left states, and output blocks past that are of no use to it."""
        end = min(processed, len(tokens))
        self.live = tokens[:end]
        if self.cache.has_state:
            return
        self._keys = chain_keys(tokens[:end], self.size)
        self._save_blocks(tokens, end // self.size, written, False)
        if end % self.size:
            self._save_tail(tokens, end, written, False)

    def _save_blocks(self, tokens: list[int], count: int, newest: int, states: bool) -> None:
        """Full blocks [_saved, count); with `states`, the block ending at `newest` (if one does) takes the
        cache's states, copied only for a block not held yet."""
        for i in range(self._saved, count):
            lo, hi = i * self.size, (i + 1) * self.size
            parent = self._keys[i - 1] if i else ROOT
            if not self.index.has(self._keys[i]):
                state = self.cache.save_state() if states and hi == newest else None
                self.index.insert(Block(self._keys[i], parent, lo, tuple(tokens[lo:hi]), self.cache.save_span(lo, hi),
                                        self._rows(lo, hi, newest), state))
        self._saved = max(self._saved, count)

    def _save_tail(self, tokens: list[int], end: int, newest: int, states: bool) -> None:
        """The partial block [end - end % size, end), a leaf."""
        lo = end - end % self.size
        parent = self._keys[lo // self.size - 1] if lo else ROOT
        tail = tuple(tokens[lo:end])
        key = block_key(parent, tail)
        if not self.index.has(key):
            self.index.insert(Block(key, parent, lo, tail, self.cache.save_span(lo, end), self._rows(lo, end, newest),
                                    self.cache.save_state() if states else None))

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

