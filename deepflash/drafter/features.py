"""Feature rings: the target's tap-layer features of committed positions, as the drafter sees them.

One rule sizes every ring (`drafter_window`). A ring slot is position % window and carries a position
tag, so a read can only return the features of the position asked for; reading an evicted or never
written position raises instead of silently returning another position's row (the aliasing bug of the
4096-slot ring this project starts from).
"""

from __future__ import annotations

import functools

import torch

from ..errors import UserError
from ..kernels.row_formats import RowFormat, row_format


class FeatureReadError(LookupError):
    """A read asked for a position the ring does not hold."""


def drafter_window(max_ctx: int, trained_ctx: int, cap: int | None = None) -> int:
    """The feature window for every ring and mirror: min(max_ctx, trained_ctx), lowered by the memory
    valve `cap` (EngineConfig.feat_ring_cap: --feat-ring-cap or DEEPFLASH_FEAT_RING_CAP). A cap that is
    unset, <= 0 or above the trained window means "the trained window"."""
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
                 kernels: str = "torch", channel_scale: torch.Tensor | None = None, shape=None):
        """kernels: "torch" or "triton" (store_and_decode); shape: the Triton kernels' cut of the work
        (kernels.rings.Shape, their shipped one when None: bench rings times others)."""
        self.window, self.width, self.fmt = window, width, fmt
        self.capacity = window + slack
        self.data = torch.zeros((self.capacity, *fmt.row_shape(width)), dtype=fmt.storage_dtype(), device=device)
        self.tags = torch.full((self.capacity,), -1, dtype=torch.int64, device=device)
        # rows are stored times a per-channel scale and read back times its inverse (storage_scale:
        # powers of two, so both multiplications are exact and only the format's own rounding remains),
        # both held in bf16, exact for powers of two: the Triton kernels load them for every row they
        # encode or decode (in float32 the scaled q4_0 write fell to 0.68 of the copy bandwidth, H200)
        self.scale = self.inverse = None
        if channel_scale is not None:
            exact = channel_scale.to(device, torch.float32)
            self.scale = exact.to(torch.bfloat16)
            if not torch.equal(self.scale.float(), exact):
                raise ValueError("a ring's channel scales must be exact in bfloat16, as storage_scale's powers "
                                 "of two are")
            self.inverse = self.scale.reciprocal()
        self._store, self._decode = store_and_decode(kernels, shape)

    @property
    def nbytes(self) -> int:
        scales = 0 if self.scale is None else self.scale.nbytes + self.inverse.nbytes
        return self.data.nbytes + self.tags.nbytes + scales

    def reset(self) -> None:
        self.tags.fill_(-1)

    def write(self, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Rows for `positions` (consecutive, on the ring's device), stored by `_store`. A run longer than
        the ring keeps its newest `capacity` rows (not `window`: a verify block longer than the window
        must keep its first, committed rows). Returns the positions actually stored."""
        if rows.shape[0] > self.capacity:
            positions, rows = positions[-self.capacity :], rows[-self.capacity :]
        self._store(self.fmt, self.data, self.tags, positions, rows.to(self.data.device), self.scale)
        return positions

    def decode(self, stored: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Stored rows (of self.data) -> their values, one call for the run."""
        return self._decode(self.fmt, stored, dtype, self.inverse)

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
                 target_device, drafter_device, slack: int = 0, kernels: str = "torch",
                 channel_scale: torch.Tensor | None = None):
        """channel_scale (storage_scale): applied where the mirror is a block format, whose error is
        relative to each block's largest value; plain formats keep their relative precision at any size."""
        self.window = window
        target_fmt = _plain_format(target_dtype)
        self.ring = FeatureRing(window, width, target_fmt, target_device, slack, kernels)
        mirror_fmt = mirror_format(feature_dtype, target_dtype)
        same = mirror_fmt == target_fmt and torch.device(target_device) == torch.device(drafter_device)
        scale = channel_scale if mirror_fmt.dtype is None else None
        self.mirror = self.ring if same else FeatureRing(window, width, mirror_fmt, drafter_device, slack, kernels,
                                                         scale)

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


def storage_scale(fc_weight: torch.Tensor) -> torch.Tensor:
    """Per feature channel, the power of two nearest to the norm of the drafter's `fc` column over the
    columns' median: what a block format stores the features times.

    A target's residual stream has a few massive channels (SmolLM2-135M: RMS ~790 where the median
    channel's is 4.8). In a 32-value block holding one, q4_0's step is that value / 8 and the block's
    other 31 values round to almost nothing. The drafter reads features only through `fc`, and a
    trained fc's column norm goes as 1 / RMS of its channel (training feeds fc features over their
    RMS and export folds that into fc, trainer.py; the logs correlate at 0.97 for the shipped
    drafter), so the scaled features are of a like size. Measured on a 1K-token prompt with the
    shipped drafter, the relative error of fc's output: q4_0 0.150 unscaled, 0.055 scaled; q8_0 0.037
    and 0.0035 (BENCHMARKS.md). Clamped to 2^+-10: a column of zeros must not make an infinite inverse."""
    norms = fc_weight.detach().float().norm(dim=0)
    ratio = norms / norms.median().clamp_min(torch.finfo(torch.float32).tiny)
    return torch.exp2(ratio.clamp(2.0**-10, 2.0**10).log2().round())


RING_KERNELS = ("auto", "torch", "triton")


def pick_ring_kernels(kind: str, device: torch.device | str) -> str:
    """auto: Triton on CUDA (one pass each way, BENCHMARKS.md), else eager torch. Any other kind is taken
    as asked (store_and_decode checks it)."""
    if kind != "auto":
        return kind
    from ..kernels.triton_support import usable

    return "triton" if usable(device) else "torch"


def store_and_decode(kind: str, shape=None):
    """The (store, decode) functions of a ring.
    torch: row_formats.py's vectorized forms, eager (q4_0 encode is about 15 small kernels).
    triton: one hand-written pass each way (kernels/rings.py), the same bytes; `shape` cuts its work."""
    if kind == "triton":
        from ..kernels import rings
        from ..kernels.triton_support import require

        require()
        return functools.partial(rings.write, shape=shape), functools.partial(rings.decode, shape=shape)
    if kind != "torch":
        raise UserError(f"ring kernels must be one of {', '.join(RING_KERNELS)}, got {kind!r}")
    return _store, _decode


def _store(fmt: RowFormat, data: torch.Tensor, tags: torch.Tensor, positions: torch.Tensor,
           rows: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """Encode rows (times `scale`, per channel) in one call and scatter them to slot = position %
    capacity in one kernel, so a run that wraps needs no special case and no write goes past a row."""
    slots = positions % data.shape[0]
    data.index_copy_(0, slots, fmt.encode(rows if scale is None else rows.float() * scale))
    tags.index_copy_(0, slots, positions)


def _decode(fmt: RowFormat, data: torch.Tensor, dtype: torch.dtype = torch.float32,
            inverse: torch.Tensor | None = None) -> torch.Tensor:
    """Stored rows -> values (times `inverse`, per channel) in dtype."""
    if inverse is None:
        return fmt.decode(data, dtype)
    return (fmt.decode(data) * inverse).to(dtype)


def mirror_format(name: str, target_dtype: torch.dtype) -> RowFormat:
    """The mirror's storage format: 'auto' is the target's own dtype, the cheapest lossless one (the ring holds
    the captured rows in it, so a wider mirror would hold the same values in more bytes; on the target's
    device the mirror is then the ring itself)."""
    return _plain_format(target_dtype) if name == "auto" else row_format(name)


def _plain_format(dtype: torch.dtype) -> RowFormat:
    """The target ring keeps rows exactly as captured, in the target's dtype."""
    named = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
    return row_format(named[dtype]) if dtype in named else RowFormat(str(dtype), dtype)
