"""CUDA graphs for the decode steps: capture each step variant once, then replay it.

A small model's decode step is hundreds of tiny kernels; launched one by one from Python the launch
overhead dominates. Replaying a captured graph launches them all in one call. A variant is keyed by
what changes its kernels: the step kind, the block size, the attention span (kv_len, bucketed to a
power of two so there are few variants) and the sampling mode (greedy, sampled, filtered: the values
are device buffers, sampling.SamplingBuffers). Off CUDA the steps simply run eagerly.

The variants a long-running server meets are bounded by construction (kinds x block sizes x KV buckets
x 3 modes, prefill sizes x KV buckets x 3 modes), and the cache is bounded too: past `max_graphs` the
least recently replayed graph is dropped (its memory stays in the shared pool for the next capture).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable

import torch

MAX_GRAPHS = 256  # a 64K context has about 100 prefill, plain and spec variants per sampling mode


class StepGraphs:
    """`buffers`: the step's device-resident inputs/outputs (e.g. StepState.buffers()), which a capture's
    warm-up runs advance and which must be put back before the real run."""

    def __init__(self, buffers: list[torch.Tensor], device: torch.device, enabled: bool = True, cache=None,
                 max_graphs: int = MAX_GRAPHS):
        self.buffers = buffers
        self.cache = cache
        self.enabled = enabled and device.type == "cuda"
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple, torch.cuda.CUDAGraph] = OrderedDict()
        self.captures = 0  # graphs captured over the engine's life (evicted ones included)
        self.pool = None
        self.streams = capture_streams(device) if self.enabled else None

    def run(self, key: tuple, fn: Callable[[], None]) -> bool:
        """Run the step; True when this run captured its graph (one-off host and device work)."""
        if not self.enabled:
            fn()
            return False
        graph = self.graphs.get(key)
        captured = graph is None
        if captured:
            if len(self.graphs) >= self.max_graphs:
                self.graphs.popitem(last=False)
            graph = self.graphs[key] = self._capture(fn)
            self.captures += 1
        else:
            self.graphs.move_to_end(key)
        graph.replay()
        return captured

    def _capture(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """Warm up on a side stream (allocator and library handles must exist before capture), undo the
        warm-up's effect on the step buffers and on the cache's recurrent states (cache.volatile()),
        then capture. The warm-up's KV and ring writes land at positions that are not committed yet,
        which every reader masks until they are rewritten."""
        state = self.buffers + (self.cache.volatile() if self.cache is not None else [])
        saved = [t.clone() for t in state]
        side, capture = self.streams
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
                for t, old in zip(state, saved):
                    t.copy_(old)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=capture):
            fn()
        self.pool = graph.pool()
        return graph

    def clear(self) -> None:
        self.graphs.clear()
        self.pool = None


@functools.cache
def _capture_streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    return torch.cuda.Stream(device), torch.cuda.Stream(device)


def capture_streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """The warm-up and capture streams of every capture on `device`, shared by all engines of the
    process: cuBLAS keeps a workspace per stream it has run on (32 MiB on Hopper) until the process
    ends. A fresh warm-up stream per capture would cost 32 MiB per graph variant (~1 GB of a 7.8K-token
    request's peak), and a pair per engine would leave 64 MiB behind every engine built."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capture_streams(torch.device(device.type, index))


def kv_bucket(needed: int, max_ctx: int, window: int | None = None, floor: int = 256) -> int:
    """Attention span for a step that touches positions < needed: the next power of two (few graph
    variants, little wasted attention), never beyond the cache. The drafter's `window` is a bucket end too:
    steps below it get a span within it, where the drafter's ring has not wrapped and drafts on the decode
    kernel (drafter/context.py _on_kernel); a 32K-token context's next power of two is past a 40960 window."""
    span = floor
    while span < needed:
        span *= 2
    if window is not None and needed <= window < span:
        span = window
    return min(span, max_ctx)


def prefill_pieces(n: int, chunk: int, start: int = 0) -> list[tuple[int, int]]:
    """(start, size) pieces covering positions [start, n) in power-of-two sizes up to `chunk` (a power of
    two), so that few graph variants serve every prompt length: whole chunks, then the rest in at most
    two pieces, the last ending at n. A rest that is not a power of two is covered by the smallest
    power of two above it, reaching back over positions already done: running a position again
    rewrites its KV and features with the same values up to rounding (targets with `idempotent_positions`).
    `start` (a prefix-cache restore point) is on the chunk grid: from there the pieces are those a prefill
    from 0 runs, so that each position is computed in the same shapes."""
    assert start % chunk == 0, (start, chunk)
    pieces = [(at, chunk) for at in range(start, n - chunk + 1, chunk)]
    done = pieces[-1][0] + pieces[-1][1] if pieces else start
    if done == 0 and n:  # a short prompt: its largest power of two first
        done = 1 << (n.bit_length() - 1)
        pieces.append((0, done))
    rest = n - done
    if rest:
        size = 1 << (rest - 1).bit_length()  # <= done: the piece starts at or after position 0
        pieces.append((n - size, size))
    return pieces


def chunk_grid(start: int, n: int, chunk: int) -> list[tuple[int, int]]:
    """(start, size) pieces covering [start, n) once each, cut where multiples of `chunk` fall (the
    prefill of targets that cannot run a position twice)."""
    cuts = [start, *range(start - start % chunk + chunk, n, chunk), n]
    return [(lo, hi - lo) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]
