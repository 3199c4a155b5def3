"""Feature rings: the target's tap-layer features of committed positions, as the drafter sees them.

One rule sizes every ring (`drafter_window`). A ring slot is position % window and carries a position
tag, so a read can only return the features of the position asked for; reading an evicted or never
written position raises instead of silently returning another position's row (the aliasing bug of the
4096-slot ring this project starts from).
"""

from __future__ import annotations

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


def ring_runs(start: int, n: int, cap: int):
    """Contiguous slot ranges (lo, hi, offset into the run) of positions [start, start + n), n <= cap,
    in a ring of `cap` slots: one range, or two where the run wraps."""
    lo = start % cap
    head = min(n, cap - lo)
    yield lo, lo + head, 0
    if head < n:
        yield 0, n - head, head


class FeatureRing:
    """`window` position-tagged rows of `width` features in a storage format, on one device."""

    def __init__(self, window: int, width: int, fmt: RowFormat, device: torch.device | str):
        self.window, self.width, self.fmt = window, width, fmt
        self.data = torch.zeros((window, *fmt.row_shape(width)), dtype=fmt.storage_dtype(), device=device)
        self.tags = torch.full((window,), -1, dtype=torch.int64, device=device)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.tags.nbytes

    def reset(self) -> None:
        self.tags.fill_(-1)

    def write(self, start: int, rows: torch.Tensor) -> torch.Tensor:
        """Rows for positions [start, start + n). A run longer than the ring keeps its last `window` rows;
        the run is encoded in one call and stored as at most two slices. Returns the stored encoding."""
        n = rows.shape[0]
        if n > self.window:
            rows, start, n = rows[n - self.window :], start + n - self.window, self.window
        encoded = self.fmt.encode(rows.to(self.data.device))
        positions = torch.arange(start, start + n, device=self.data.device)
        for lo, hi, src in ring_runs(start, n, self.window):
            self.data[lo:hi] = encoded[src : src + hi - lo]
            self.tags[lo:hi] = positions[src : src + hi - lo]
        return encoded

    def read(self, start: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decoded rows for positions [start, start + n); raises FeatureReadError if any is not held."""
        if n > self.window:
            raise FeatureReadError(f"cannot read {n} positions from a ring of {self.window}")
        runs = list(ring_runs(start, n, self.window))
        tags = torch.cat([self.tags[lo:hi] for lo, hi, _ in runs])
        want = torch.arange(start, start + n, device=tags.device)
        if not torch.equal(tags, want):
            bad = int(want[tags != want][0])
            raise FeatureReadError(f"position {bad} is not in the feature ring (window {self.window})")
        return torch.cat([self.fmt.decode(self.data[lo:hi], dtype) for lo, hi, _ in runs])


class FeatureStore:
    """The target ring (target device, target dtype) and the drafter mirror (drafter device, storage
    format). Where both would hold the same bytes on the same device the mirror is the ring itself."""

    def __init__(self, window: int, width: int, feature_dtype: str, target_dtype: torch.dtype,
                 target_device, drafter_device):
        self.window = window
        target_fmt = _plain_format(target_dtype)
        self.ring = FeatureRing(window, width, target_fmt, target_device)
        mirror_fmt = row_format(feature_dtype)
        same = mirror_fmt == target_fmt and torch.device(target_device) == torch.device(drafter_device)
        self.mirror = self.ring if same else FeatureRing(window, width, mirror_fmt, drafter_device)

    @property
    def nbytes(self) -> int:
        return self.ring.nbytes + (0 if self.mirror is self.ring else self.mirror.nbytes)

    def reset(self) -> None:
        self.ring.reset()
        self.mirror.reset()

    def commit(self, start: int, rows: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Store the features of committed positions [start, start + n); return the run the drafter should
        append (its first position and rows decoded from the mirror, i.e. exactly what storage holds)."""
        stored = self.ring.write(start, rows)
        if self.mirror is not self.ring:
            stored = self.mirror.write(start, rows)
        first = start + rows.shape[0] - stored.shape[0]
        return first, self.mirror.fmt.decode(stored)

    def context(self, end: int) -> tuple[int, torch.Tensor]:
        """The drafter's whole context before position `end`: min(end, window) positions, no floor."""
        n = min(end, self.window)
        return end - n, self.mirror.read(end - n, n)


def _plain_format(dtype: torch.dtype) -> RowFormat:
    """The target ring keeps rows exactly as captured, in the target's dtype."""
    named = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
    return row_format(named[dtype]) if dtype in named else RowFormat(str(dtype), dtype)
