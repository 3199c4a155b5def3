"""The prefix cache's index: blocks of saved per-position state keyed by the token prefix, in two tiers.

A block holds what the engine saved for positions [start, start + block_tokens): the target's KV (and for
hybrid targets, where it was taken, the recurrent states after its last token), and the tap features the
drafter's rings held. Its key hashes its parent's key and its own tokens, so a key names the whole prefix up to
the block's end (the block-hash scheme of vLLM; DESIGN.md says why not a radix tree). A restore may end only at
a block end on the `grid` (the prefill chunk: prefix_reuse.py says why), and for a hybrid target only where the
block carries states.

Memory is bounded by two budgets: blocks past the device budget move to host memory, blocks past the host
budget are dropped, least recently used first, leaves before the blocks they hang from (a parent outlives its
children, which are unreachable without it).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

ROOT = b""


def block_key(parent: bytes, tokens) -> bytes:
    """The key of a block with these tokens after the prefix `parent` names (blake2b, 128 bits)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


@dataclass
class Block:
    key: bytes
    parent: bytes
    start: int
    tokens: tuple[int, ...]
    kv: tuple[torch.Tensor, ...]  # the target cache's span (positions on dim -2; KVCache.save_span)
    features: torch.Tensor | None  # the target ring's rows [len, width]; None: no drafter, or not held when saved
    state: tuple[torch.Tensor, ...] | None = None  # recurrent states after the last token (HybridCache.save_state)
    on_host: bool = False
    children: set[bytes] = field(default_factory=set)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.kv, *([] if self.features is None else [self.features]), *(self.state or ())]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())


@dataclass
class Hit:
    """A lookup's answer: `length` positions can be restored from `blocks` (in position order, the last one
    possibly only in part)."""

    length: int
    blocks: list[Block]


@dataclass
class CacheStats:
    hit_tokens: int = 0  # prompt positions restored instead of computed
    miss_tokens: int = 0  # prompt positions computed
    evictions: int = 0  # blocks dropped
    demotions: int = 0  # blocks moved to host memory


class PrefixCache:
    """grid: restores end at multiples of it; needs_state: a hybrid target, which can resume only where a block
    carries its recurrent states; window: the drafter's feature window (None without a drafter): a restore at m
    needs the features of [m - window, m)."""

    def __init__(self, block_tokens: int, device_bytes: int, host_bytes: int, needs_state: bool,
                 window: int | None, grid: int = 1):
        if block_tokens < 1 or grid < 1:
            raise ValueError(f"block_tokens and grid must be >= 1, got {block_tokens} and {grid}")
        self.block_tokens, self.grid = block_tokens, grid
        self.device_budget, self.host_budget = device_bytes, host_bytes
        self.needs_state, self.window = needs_state, window
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self.device_bytes = self.host_bytes = 0
        self.stats = CacheStats()

    # --- lookup -------------------------------------------------------------------------------------
    def lookup(self, tokens: list[int], limit: int) -> Hit:
        """The longest restorable prefix of `tokens`, at most `limit` positions (the engine keeps one
        prompt token to compute): the deepest block end along the chain of held blocks matching `tokens`
        that lies on the grid, carries states where needed and has its feature window held. Touches the
        blocks it returns."""
        size, path, parent, best = self.block_tokens, [], ROOT, Hit(0, [])
        for start in range(0, limit - size + 1, size):
            block = self.blocks.get(block_key(parent, tokens[start : start + size]))
            if block is None:
                break
            path.append(block)
            parent = block.key
            if block.end % self.grid == 0 and (block.state is not None or not self.needs_state) \
                    and self._features_held(path, block.end):
                best = Hit(block.end, list(path))
        self._touch(best.blocks)
        return best

    def _features_held(self, blocks: list[Block], length: int) -> bool:
        if self.window is None:
            return True
        return all(b.features is not None for b in blocks if b.end > length - self.window and b.start < length)

    # --- insert ---------------------------------------------------------------------------------------
    def has(self, key: bytes) -> bool:
        return key in self.blocks

    def insert(self, block: Block) -> None:
        """Add a block (its parent must be held: a chain never has holes), then keep the budgets."""
        if block.key in self.blocks:
            self._touch([self.blocks[block.key]])
            return
        if block.parent != ROOT and block.parent not in self.blocks:
            return  # its parent was evicted meanwhile: the block could never be reached
        self.blocks[block.key] = block
        if block.parent != ROOT:
            self.blocks[block.parent].children.add(block.key)
        self.device_bytes += block.nbytes
        self._touch([self.blocks[k] for k in self._ancestry(block.key)])
        self._keep_budgets()

    def _ancestry(self, key: bytes) -> list[bytes]:
        keys = []
        while key != ROOT:
            keys.append(key)
            key = self.blocks[key].parent
        return keys

    def _touch(self, blocks: list[Block]) -> None:
        """Most recent last, parents after children: eviction reaches a prefix's deepest blocks first."""
        for block in sorted(blocks, key=lambda b: -b.start):
            self.blocks.move_to_end(block.key)

    def clear(self) -> None:
        """Forget every block and the counts (a benchmark's warm-up must not fill the cache it measures)."""
        self.blocks.clear()
        self.device_bytes = self.host_bytes = 0
        self.stats = CacheStats()

    # --- budgets ------------------------------------------------------------------------------------
    def _keep_budgets(self) -> None:
        while self.device_bytes > self.device_budget:
            block = self._oldest(on_host=False)
            if block.nbytes <= self.host_budget:
                self._demote(block)
            else:
                self._drop(block)
        while self.host_bytes > self.host_budget:
            self._drop(self._oldest(on_host=True))

    def _oldest(self, on_host: bool) -> Block:
        """The least recently used block of a tier, preferring one none of whose children is in the tier:
        a prefix's deepest blocks go first (touches leave a parent more recent than its children)."""
        tier = (b for b in self.blocks.values() if b.on_host == on_host)
        return next(b for b in tier if not any(self.blocks[c].on_host == on_host for c in b.children))

    def _demote(self, block: Block) -> None:
        """To page-locked host memory (asynchronous, ordered after the work that saved it on this stream)."""
        pinned = torch.cuda.is_available()

        def to_host(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned).copy_(t, non_blocking=pinned)

        block.kv = tuple(map(to_host, block.kv))
        block.features = None if block.features is None else to_host(block.features)
        block.state = None if block.state is None else tuple(map(to_host, block.state))
        block.on_host = True
        self.device_bytes -= block.nbytes
        self.host_bytes += block.nbytes
        self.stats.demotions += 1

    def _drop(self, block: Block) -> None:
        """Drop a block and what hangs from it (unreachable without it)."""
        for child in list(block.children):
            self._drop(self.blocks[child])
        if block.parent != ROOT:
            self.blocks[block.parent].children.discard(block.key)
        del self.blocks[block.key]
        if block.on_host:
            self.host_bytes -= block.nbytes
        else:
            self.device_bytes -= block.nbytes
        self.stats.evictions += 1

