"""Bounded KV residency (--kv-budget): at most `budget` positions of each attention layer's K/V on the device,
every position in host memory, the resident ones chosen by relevance. Lossy: the target attends over what is
resident only, so its output changes past the budget; never on by default.

The device pool (budget slots, pages of PAGE positions):

    [ selected pages, in position order | positions R0, R0 + 1, ... in order ]
      slots 0 .. base - 1                  slots base .. budget - 1 (the recent region)

A position p >= R0 sits in slot p - shift (shift = R0 - base). Attention works on slots, not positions: a query
at p (slot p - shift) sees every selected page (slots below base, positions below R0 <= p) and the recent
positions up to its own, which is the causal mask over slots. So the forward maps positions to slots once
(slots()), ropes with the true positions and runs the attention and its kernels unchanged, over the whole pool;
only a device scalar (shift) and the pool's contents change when the pool is rebuilt, so captured CUDA graphs
stay valid. Until the first rebuild (R0 = base = shift = 0) the pool is the plain cache of the first `budget`
positions: outputs equal full attention's.

Rebuilt (make_room, between steps, on the host) when the committed length reaches rebuild_at, a step's length
before the recent region's end:
- positions [R0, R0') leave the recent region (R0' = the committed length less `recent`, on a page): their K/V
  go to the host copy and their pages get key summaries (the elementwise min and max of each kv head's keys
  over the page, as Quest scores pages);
- each kv head of each layer scores every page below R0' with the queries of the last step (note_query): the
  upper bound of each of its query heads' scores over the page's keys (sum over dims of max(q * kmin, q * kmax)),
  softmaxed over the pages and summed over its query heads, an estimate of the attention mass the page would get;
  page 0 (the attention sink) always stays; the kv head's top `selected` pages, in position order, fill its slots
  [0, base') (heads attend to different things: an induction head's page is not a summarising head's);
- the recent positions [R0', end) move to slots base' onward.
Pages already on the device are moved there; only pages that come back are copied from the host.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from ..errors import UserError
from .kv_cache import KVCache

PAGE = 64  # positions a page: the unit of selection and of host <-> device copies
HOST_SHARE = 0.8  # of the machine's RAM the host copy may take


@dataclass(frozen=True)
class KVBudget:
    """A bounded cache's sizes in positions: `tokens` on the device; `step_tokens`, the most positions one
    forward may write (a prefill chunk, a verify block)."""

    tokens: int
    step_tokens: int

    @property
    def recent(self) -> int:
        """Positions before the committed length that stay resident at a rebuild (the recent window)."""
        return pages_of(self.tokens // 8) * PAGE

    @property
    def growth(self) -> int:
        """Positions the recent region takes after a rebuild: the next one comes a page at least before a
        step could run past it."""
        return pages_of(max(self.tokens // 8, self.step_tokens) + PAGE) * PAGE

    @property
    def selected(self) -> int:
        """Pages chosen by relevance: the rest of the pool (one page of it absorbs R0's rounding)."""
        return (self.tokens - self.recent - self.growth) // PAGE - 1

    def validated(self) -> KVBudget:
        if self.selected < 1:
            least = self.recent + self.growth + 2 * PAGE
            raise UserError(f"--kv-budget {self.tokens} leaves no room for selected pages next to the recent window "
                            f"and a step's growth ({self.growth} positions: the prefill chunk or the steps in "
                            f"flight); use at least {least}, or lower --prefill-chunk")
        return self


def _check_host_memory(nbytes: int, max_len: int) -> None:
    """The host copy must fit in RAM with room to spare (pinned memory cannot be swapped out)."""
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if nbytes > HOST_SHARE * ram:
        raise UserError(f"--kv-budget keeps all {max_len} positions' KV in host memory: {nbytes / 2**30:.1f} GiB, more "
                        f"than {HOST_SHARE:.0%} of this machine's {ram / 2**30:.1f} GiB; lower --max-ctx")


def pages_of(positions: int) -> int:
    """Pages that hold `positions` positions."""
    return -(-positions // PAGE)


class BudgetKVCache(KVCache):
    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int, num_heads: int,
                 dtype: torch.dtype, device: torch.device | str, budget: KVBudget):
        assert batch == 1, "a bounded KV cache holds one sequence"
        budget = budget.validated()
        super().__init__(num_layers, 1, num_kv_heads, budget.tokens, head_dim, dtype, device)
        self.max_len, self.budget = max_len, budget
        pinned = torch.device(device).type == "cuda"
        # every position, written when it leaves the recent region (only those are read back), page by page with
        # every layer's rows of a page together: a rebuild's pages leave in one contiguous copy
        host = (pages_of(max_len), num_layers, num_kv_heads, PAGE, head_dim)
        _check_host_memory(2 * math.prod(host) * dtype.itemsize, max_len)
        self.host_k = torch.empty(host, dtype=dtype, pin_memory=pinned)
        self.host_v = torch.empty(host, dtype=dtype, pin_memory=pinned)
        summaries = (num_layers, num_kv_heads, pages_of(max_len), head_dim)
        self.key_min = torch.zeros(summaries, dtype=dtype, device=device)
        self.key_max = torch.zeros(summaries, dtype=dtype, device=device)
        self.query = torch.zeros((num_layers, num_heads, head_dim), dtype=dtype, device=device)
        self.shift = torch.zeros((), dtype=torch.long, device=device)
        self.reset()

    def reset(self) -> None:
        """A new sequence: no page selected, the recent region from position 0."""
        self.recent_start = 0  # R0
        self.base = 0  # slots of selected pages
        self.written = 0  # positions written at most (the end of the recent region's contents)
        layers, _, kv_heads = self.k.shape[:3]
        self.pages = torch.empty((layers, kv_heads, 0), dtype=torch.long)  # each kv head's selected pages (host)
        self.shift.zero_()
        self.rebuilds = 0

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.key_min.nbytes + self.key_max.nbytes + self.query.nbytes

    @property
    def host_bytes(self) -> int:
        return self.host_k.nbytes + self.host_v.nbytes

    def slots(self, positions: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, int]:
        """The positions' slots in the pool (p - shift), and the whole pool as attention's span."""
        return positions - self.shift, self.k.shape[3]

    def note_query(self, layer: int, q: torch.Tensor) -> None:
        self.query[layer].copy_(q[0, :, -1])  # the step's last query of each head

    def save_span(self, lo, hi):
        raise NotImplementedError("the prefix cache does not run with a KV budget (EngineConfig refuses both)")

    load_span = save_span

    # --- rebuilds (host side, between steps) ------------------------------------------------------------
    @property
    def limit(self) -> int:
        """The first position the recent region cannot hold."""
        return self.recent_start + self.k.shape[3] - self.base

    @property
    def rebuild_at(self) -> int:
        """The committed length at which the pool is rebuilt: a step starting below it fits the recent region.
        Keyed by position, so plain and speculative decoding rebuild at the same length with the same query,
        if speculative steps end there (the engine cuts their blocks): their outputs stay equal."""
        return self.limit - self.budget.step_tokens

    def make_room(self, committed: int, end: int) -> bool:
        """Before a forward writing positions [committed, end) (at most step_tokens) on a committed length
        `committed` (positions below it are final): rebuilds the pool first where that length has reached
        rebuild_at (True then)."""
        rebuild = committed >= self.rebuild_at
        if rebuild:
            self._rebuild(committed)
        assert end <= self.limit, (committed, end, self.limit)
        self.written = max(self.written, end)
        return rebuild

    @torch.no_grad()
    def _rebuild(self, committed: int) -> None:
        start = (committed - self.budget.recent) // PAGE * PAGE
        assert start >= self.recent_start, (committed, start, self.recent_start)
        self._retire(self.recent_start, start)
        pages = self._choose(start // PAGE)
        base = pages.shape[2] * PAGE
        for layer in range(self.k.shape[0]):
            for pool, host in ((self.k, self.host_k), (self.v, self.host_v)):
                self._refill(pool[layer, 0], host[:, layer], self.pages[layer], pages[layer], base, start)
        self.pages, self.base, self.recent_start = pages, base, start
        self.shift.fill_(start - base)
        self.rebuilds += 1

    def _retire(self, lo: int, hi: int) -> None:
        """Positions [lo, hi) leave the recent region: to the host copy, and their pages' key summaries."""
        if hi <= lo:
            return
        slots = slice(lo - self.recent_start + self.base, hi - self.recent_start + self.base)
        for pool, host in ((self.k, self.host_k), (self.v, self.host_v)):
            by_page = pool[:, 0, :, slots].unflatten(2, (-1, PAGE)).permute(2, 0, 1, 3, 4)  # [pages, layers, Hkv, ...]
            host[lo // PAGE : hi // PAGE].copy_(by_page.contiguous())  # one contiguous device-to-host copy
        keys = self.k[:, 0, :, slots].unflatten(2, (-1, PAGE))  # [layers, Hkv, pages, PAGE, D]
        self.key_min[:, :, lo // PAGE : hi // PAGE] = keys.amin(dim=3)
        self.key_max[:, :, lo // PAGE : hi // PAGE] = keys.amax(dim=3)

    def _choose(self, candidates: int) -> torch.Tensor:
        """Each kv head's selected pages among [0, candidates), ascending: [layers, Hkv, n] (host, int64)."""
        n = min(self.budget.selected, candidates)
        layers, _, kv_heads = self.k.shape[:3]
        if n == candidates:
            return torch.arange(n).expand(layers, kv_heads, n).clone()
        chosen = []
        for layer in range(layers):  # a layer at a time: the bounds are [H, pages, D] in float32
            mass = page_mass(self.query[layer], self.key_min[layer, :, :candidates], self.key_max[layer, :, :candidates])
            mass[:, 0] = math.inf  # the attention sink
            chosen.append(mass.topk(n).indices.sort().values)
        return torch.stack(chosen).cpu()

    def _refill(self, pool: torch.Tensor, host: torch.Tensor, old: torch.Tensor, new: torch.Tensor,
                base: int, start: int) -> None:
        """One layer's K or V pool [Hkv, budget, D] rebuilt from it and its host pages [pages, Hkv, PAGE, D]: pages
        `new` in slots [0, base), positions [start, written) from slot base. Pages the pool holds are moved; the
        others come from the host."""
        recent = pool[:, self.base + start - self.recent_start : self.base + self.written - self.recent_start].clone()
        # where each kv head's new pages [Hkv, n] are now: a page slot of its pool, or only on the host (-1)
        unheld = torch.full((old.shape[0], 1), -1)  # a column never matched: the first rebuild holds no page
        same = new[:, :, None] == torch.cat([old, unheld], dim=1)[:, None, :]  # [Hkv, n, old n + 1]
        source = torch.where(same.any(dim=2), same.int().argmax(dim=2), -1)
        in_recent = (new * PAGE >= self.recent_start) & (source < 0)
        source[in_recent] = (new[in_recent] * PAGE - self.recent_start + self.base) // PAGE  # whole pages there
        device = pool.device
        by_page = pool[:, : (pool.shape[1] // PAGE) * PAGE].unflatten(1, (-1, PAGE))  # [Hkv, pages, PAGE, D]
        heads = torch.arange(pool.shape[0])[:, None].expand_as(new)
        gathered = by_page[heads.to(device), source.clamp(min=0).to(device)]  # [Hkv, n, PAGE, D]
        fetch = source < 0
        if bool(fetch.any()):
            gathered[fetch.to(device)] = host[new[fetch], heads[fetch]].to(device)  # [fetched, PAGE, D]
        pool[:, :base] = gathered.flatten(1, 2)
        pool[:, base : base + recent.shape[1]] = recent


def page_mass(query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor) -> torch.Tensor:
    """Estimated attention mass of each page for each kv head: query [H, D], key summaries [Hkv, P, D] -> [Hkv, P]
    float32. Per query head, the upper bound of its scaled score over a page's keys, softmaxed over the pages;
    summed over the kv head's query heads."""
    heads, dim = query.shape
    kv_heads = key_min.shape[0]
    q = query.float().view(kv_heads, heads // kv_heads, 1, dim)
    bound = torch.maximum(q * key_min.float()[:, None], q * key_max.float()[:, None]).sum(-1)  # [Hkv, G, P]
    return (bound / math.sqrt(dim)).softmax(dim=-1).sum(dim=1)
