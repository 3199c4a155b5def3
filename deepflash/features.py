"""Feature rings: the target's tap-layer features of committed positions, as the drafter sees them.

One rule sizes every ring (`drafter_window`). A ring slot is position % window and carries a position
tag, so a read can only return the features of the position asked for; reading an evicted or never
written position raises instead of silently returning another position's row (the aliasing bug of the
4096-slot ring this project starts from).
"""

from __future__ import annotations

import functools
import os

import torch

from .errors import UserError
from .quant import RowFormat, row_format

RING_CAP_ENV = "DEEPFLASH_FEAT_RING_CAP"


class FeatureReadError(LookupError):
    """A read asked for a position the ring does not hold."""


def ring_cap_from_env() -> int | None:
    value = os.environ.get(RING_CAP_ENV, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"{RING_CAP_ENV} must be an integer, got {value!r}") from None


def drafter_window(max_ctx: int, trained_ctx: int, cap: int | None = None) -> int:
    """The feature window for every ring and mirror: min(max_ctx, trained_ctx), lowered by the memory
    valve `cap` (--feat-ring-cap, else DEEPFLASH_FEAT_RING_CAP). A cap that is unset, <= 0 or above the
    trained window means "the trained window"."""
    if cap is None:
        cap = ring_cap_from_env()
    window = min(max_ctx, trained_ctx)
    if cap is not None and 0 < cap < trained_ctx:
        window = min(window, cap)
    return window


class FeatureRing:
    """Position-tagged rows of `width` features in a storage format, on one device.

    It holds `window` positions plus `slack` spare slots: a verify step writes the features of its whole
    block before knowing how many positions it commits, and the spare slots keep those not-yet-committed
    rows from evicting positions still inside the window (they stay invisible until committed, because
    readers only accept positions below the committed length, and are overwritten when committed).
    """

    def __init__(self, window: int, width: int, fmt: RowFormat, device: torch.device | str, slack: int = 0,
                 kernels: str = "torch"):
        self.window, self.width, self.fmt = window, width, fmt
        self.capacity = window + slack
        self.data = torch.zeros((self.capacity, *fmt.row_shape(width)), dtype=fmt.storage_dtype(), device=device)
        self.tags = torch.full((self.capacity,), -1, dtype=torch.int64, device=device)
        self._store, self.decode = store_and_decode(kernels, fmt)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.tags.nbytes

    def reset(self) -> None:
        self.tags.fill_(-1)

    def write(self, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Rows for `positions` (consecutive, on the ring's device), stored by `_store`. A run longer than
        the ring keeps its newest `capacity` rows (not `window`: a verify block longer than the window
        must keep its first, committed rows). Returns the positions actually stored."""
        if rows.shape[0] > self.capacity:
            positions, rows = positions[-self.capacity :], rows[-self.capacity :]
        self._store(self.fmt, self.data, self.tags, positions, rows.to(self.data.device))
        return positions

    def read(self, start: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decoded rows for positions [start, start + n), one decode call for the run; raises
        FeatureReadError if any position is not held (evicted, never written, or out of range)."""
        want = torch.arange(start, start + n, device=self.tags.device)
        if n > self.capacity or start < 0:
            raise FeatureReadError(f"positions {start}..{start + n - 1} cannot all be in a ring of {self.capacity}")
        slots = want % self.capacity
        tags = self.tags[slots]
        if not torch.equal(tags, want):
            bad = int(want[tags != want][0])
            raise FeatureReadError(f"position {bad} is not in the feature ring (window {self.window})")
        return self.decode(self.data[slots], dtype)


class FeatureStore:
    """The target ring (target device, target dtype) and the drafter mirror (drafter device, storage
    format). Where both would hold the same bytes on the same device the mirror is the ring itself."""

    def __init__(self, window: int, width: int, feature_dtype: str, target_dtype: torch.dtype,
                 target_device, drafter_device, slack: int = 0, kernels: str = "torch"):
        self.window = window
        target_fmt = _plain_format(target_dtype)
        self.ring = FeatureRing(window, width, target_fmt, target_device, slack, kernels)
        mirror_fmt = row_format(feature_dtype)
        same = mirror_fmt == target_fmt and torch.device(target_device) == torch.device(drafter_device)
        self.mirror = self.ring if same else FeatureRing(window, width, mirror_fmt, drafter_device, slack, kernels)

    @property
    def nbytes(self) -> int:
        return self.ring.nbytes + (0 if self.mirror is self.ring else self.mirror.nbytes)

    def reset(self) -> None:
        self.ring.reset()
        self.mirror.reset()

    def commit(self, positions: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the features of `positions`; return what the drafter should append: the positions kept
        and their rows decoded from the mirror, i.e. exactly what storage holds. No host sync."""
        kept = self.store(positions, rows)
        return kept, self.mirror.decode(self.mirror.data[kept % self.mirror.capacity])

    def store(self, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Store the features of `positions` in the ring and the mirror; return the positions kept."""
        kept = self.ring.write(positions, rows)
        if self.mirror is not self.ring:
            kept = self.mirror.write(positions.to(self.mirror.data.device), rows)
        return kept

    def context(self, end: int) -> tuple[int, torch.Tensor]:
        """The drafter's whole context before position `end`: min(end, window) positions, no floor."""
        n = min(end, self.window)
        return end - n, self.mirror.read(end - n, n)


RING_KERNELS = ("auto", "torch", "compile", "triton")


def pick_ring_kernels(kind: str, device: torch.device | str, compile: bool) -> str:
    """auto: Triton on CUDA (one pass each way; BENCHMARKS.md), else the compiled torch forms under
    --compile, else eager torch. Any other kind is taken as asked (store_and_decode checks it)."""
    if kind != "auto":
        return kind
    from . import ring_kernels as triton_kernels

    if torch.device(device).type == "cuda" and triton_kernels.available():
        return "triton"
    return "compile" if compile else "torch"


def store_and_decode(kind: str, fmt: RowFormat):
    """The (store, decode) functions of a ring.
    torch: quant.py's vectorized forms, eager (q4_0 encode is about 15 small kernels).
    compile: the same through torch.compile, for the block formats only (on an H200, BENCHMARKS.md:
      3x faster writes, 1.4-2.6x faster dequantize; plain dtypes wrote slower compiled than eager);
      dynamic, so one kernel serves every run length.
    triton: one hand-written pass each way (ring_kernels.py), same bytes."""
    if kind == "triton":
        from . import ring_kernels as triton_kernels

        if not triton_kernels.available():
            raise UserError("ring kernels 'triton' need the triton package (it comes with CUDA builds of torch)")
        return triton_kernels.write, functools.partial(triton_kernels.decode, fmt)
    if kind not in RING_KERNELS[1:]:
        raise UserError(f"ring kernels must be one of {', '.join(RING_KERNELS[1:])}, got {kind!r}")
    if kind == "compile" and fmt.dtype is None:
        return torch.compile(_store, dynamic=True), torch.compile(fmt.decode, dynamic=True)
    return _store, fmt.decode


def _store(fmt: RowFormat, data: torch.Tensor, tags: torch.Tensor, positions: torch.Tensor,
           rows: torch.Tensor) -> None:
    """Encode rows in one call and scatter them to slot = position % capacity in one kernel, so a run
    that wraps needs no special case and no write goes past a row."""
    slots = positions % data.shape[0]
    data.index_copy_(0, slots, fmt.encode(rows))
    tags.index_copy_(0, slots, positions)


def _plain_format(dtype: torch.dtype) -> RowFormat:
    """The target ring keeps rows exactly as captured, in the target's dtype."""
    named = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
    return row_format(named[dtype]) if dtype in named else RowFormat(str(dtype), dtype)
