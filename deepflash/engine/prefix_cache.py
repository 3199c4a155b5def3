"""The prefix cache's index: blocks of saved per-position state keyed by the token prefix, in two tiers.

A block holds what the engine saved for positions [start, start + len(tokens)): the target's KV (and for
hybrid targets, where it was taken, the recurrent states after its last token), and the tap features the
drafter's rings held. Its key hashes its parent's key and its own tokens, so a key names the whole prefix up to
the block's end (the block-hash scheme of vLLM; DESIGN.md says why not a radix tree). Full blocks of
`block_tokens` tokens chain; a shorter block (a prompt's or an output's tail) is a leaf.

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
    """needs_state: a hybrid target, which can resume only where a block carries its recurrent states.
    window: the drafter's feature window (None without a drafter): a restore at m needs the features of
    [m - window, m)."""

    def __init__(self, block_tokens: int, device_bytes: int, host_bytes: int, needs_state: bool,
                 window: int | None):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self.device_budget, self.host_budget = device_bytes, host_bytes
        self.needs_state, self.window = needs_state, window
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self.roots: set[bytes] = set()  # the keys of blocks that start at position 0
        self.device_bytes = self.host_bytes = 0
        self.stats = CacheStats()

    # --- lookup -------------------------------------------------------------------------------------
    def lookup(self, tokens: list[int], limit: int) -> Hit:
        """The longest restorable prefix of `tokens`, at most `limit` positions (the engine keeps one
        prompt token to compute). Touches the blocks it returns."""
        candidates = self._candidates(tokens, limit)
        for length, blocks in sorted(candidates, key=lambda c: -c[0]):
            if self._features_held(blocks, length):
                self._touch(blocks)
                return Hit(length, blocks)
        return Hit(0, [])

    def _candidates(self, tokens: list[int], limit: int) -> list[tuple[int, list[Block]]]:
        """(length, blocks) restore points along the chain of full blocks matching `tokens`: for a hybrid
        target the ends of blocks with states, else any position the matched blocks cover."""
        size, path, parent, out = self.block_tokens, [], ROOT, [(0, [])]
        while True:
            start = len(path) * size
            for child in self._children(parent):
                matched = common_prefix(child.tokens, tokens[start : start + len(child.tokens)])
                if self.needs_state:
                    if child.state is not None and matched == len(child.tokens) and child.end <= limit:
                        out.append((child.end, [*path, child]))
                elif matched:
                    out.append((min(start + matched, limit), [*path, child]))
            key = block_key(parent, tokens[start : start + size]) if start + size <= len(tokens) else None
            if key not in self.blocks or start + size > limit:
                return out
            path.append(self.blocks[key])
            parent = key

    def _children(self, parent: bytes) -> list[Block]:
        keys = self.blocks[parent].children if parent != ROOT else self.roots
        return [self.blocks[k] for k in keys]

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
        self._siblings(block).add(block.key)
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

    # --- budgets ------------------------------------------------------------------------------------
    def _siblings(self, block: Block) -> set[bytes]:
        return self.roots if block.parent == ROOT else self.blocks[block.parent].children

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
        self._siblings(block).discard(block.key)
        del self.blocks[block.key]
        if block.on_host:
            self.host_bytes -= block.nbytes
        else:
            self.device_bytes -= block.nbytes
        self.stats.evictions += 1


def common_prefix(a, b) -> int:
    """How many leading items of a and b are equal."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
