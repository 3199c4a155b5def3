"""The drafter's per-layer context K/V cache, its masks, and a draft from it."""

from __future__ import annotations

import torch

from ..kernels.argmax import argmax
from ..models.layers import fold_mask
from .model import DFlashDrafter, RingBlock


def block_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor:
    """Visibility of block keys to block queries (both absolute positions): bidirectional, or causal,
    limited to |q - k| < window for sliding layers (the reference's rule)."""
    diff = q_pos[:, None] - k_pos[None, :]
    visible = diff >= 0 if causal else torch.ones_like(diff, dtype=torch.bool)
    if window is not None:
        visible &= diff < window
        if not causal:
            visible &= -diff < window
    return visible


class DrafterContext:
    """Each drafter layer's K/V of the committed context, in a position-tagged ring (slot = pos % cap).

    Full-attention layers see the last `window` committed positions (the feature window), sliding layers
    only their attention window. Rows are appended for every verified position, committed or not (fixed
    shapes, no host sync); `slack` spare slots keep the not-yet-committed rows from evicting visible ones,
    and the masks only admit positions below the block start, so only committed context is ever seen.
    The block's own K/V is computed per draft and never stored.
    """

    def __init__(self, drafter: DFlashDrafter, window: int, slack: int = 0, kernels: str = "torch"):
        """kernels: 'triton' drafts full bidirectional layers on the target's Triton kernels (RingBlock)
        where their ring allows it, and writes the context K/V with them (append), 'torch' always on
        torch's, with SDPA."""
        if kernels == "triton" and not drafter.fused:
            raise ValueError("a drafter drafts on Triton kernels in its fused form (load_drafter's)")
        cfg = drafter.cfg
        self.drafter = drafter
        self.window = window
        self.kernels = kernels
        self.caps = [min(window, cfg.layer_window(i) or window) + slack for i in range(cfg.num_layers)]
        dev, dt = drafter.device, drafter.dtype
        self.k = [torch.zeros((1, cfg.num_kv_heads, cap, cfg.head_dim), device=dev, dtype=dt) for cap in self.caps]
        self.v = [torch.zeros_like(k) for k in self.k]
        # layers of one capacity hold the same positions: they share one tag ring, and their masks
        self.tag_rings = {cap: torch.full((cap,), -1, dtype=torch.int64, device=dev) for cap in self.caps}

    @property
    def tags(self) -> list[torch.Tensor]:
        """Each layer's tag ring (shared by the layers of one capacity)."""
        return [self.tag_rings[cap] for cap in self.caps]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.k, self.v)) + sum(t.nbytes for t in self.tag_rings.values())

    def reset(self) -> None:
        for tags in self.tag_rings.values():
            tags.fill_(-1)

    def append(self, positions: torch.Tensor, features: torch.Tensor) -> None:
        """Features [n, F] of consecutive positions [n] -> fused -> each layer's K/V, scattered to its ring."""
        rows = self.drafter.fuse(features)[None]
        # a run longer than a ring keeps its newest rows
        kept = {cap: positions[-min(positions.shape[0], cap):] for cap in self.tag_rings}
        slots = {cap: run % cap for cap, run in kept.items()}
        if self.kernels == "triton":
            tables = {cap: self.drafter.rotary(run, rows.dtype) for cap, run in kept.items()}
            for i, layer in enumerate(self.drafter.layers):
                cap = self.caps[i]
                layer.self_attn.write_ring(rows[:, -kept[cap].shape[0]:], *tables[cap], slots[cap], self.k[i],
                                           self.v[i])
        else:
            for i, (k, v) in enumerate(self.drafter.context_kv(rows, positions)):
                cap = self.caps[i]
                keep = kept[cap].shape[0]
                self.k[i].index_copy_(2, slots[cap], k[:, :, -keep:])
                self.v[i].index_copy_(2, slots[cap], v[:, :, -keep:])
        for cap, tags in self.tag_rings.items():
            tags.index_copy_(0, slots[cap], kept[cap])

    def rebuild(self, start: int, features: torch.Tensor) -> None:
        """Start over from the mirror's context rows for [start, start + n) (window change, restore,
        drafter swap)."""
        self.reset()
        if features.shape[0]:
            self.append(torch.arange(start, start + features.shape[0], device=self.drafter.device), features)

    def masks(self, q_pos: torch.Tensor, span: int | None = None) -> list[torch.Tensor | RingBlock]:
        """Per layer the attention mask of a block at positions q_pos, folded for `attention` (fold_mask:
        additive, [groups * size, slots + size]): the committed context positions in [start - window,
        start) that the query may see (sliding: q - p < W), then the block's own keys. Layers alike
        (capacity, window, causality) share one mask. slots: see `kv`. With Triton kernels a layer that
        can draft on the decode kernel gets a RingBlock instead (_on_kernel)."""
        cfg = self.drafter.cfg
        groups = cfg.num_heads // cfg.num_kv_heads
        made: dict[tuple, torch.Tensor] = {}
        out = []
        on_kernel = [self._on_kernel(i, span) for i in range(cfg.num_layers)]
        # each query's last visible key, for RingBlock; the kernel reads positions by index: no stride-0 view
        last = q_pos[-1:].repeat(q_pos.shape[0]) if any(on_kernel) else None
        for i, (cap, slots) in enumerate(zip(self.caps, self._slots(span))):
            if on_kernel[i]:
                out.append(RingBlock(self.k[i], self.v[i], q_pos, last, span))
                continue
            key = (cap, cfg.layer_window(i), cfg.layer_is_causal(i))
            if key not in made:
                visible = self._visible(self.tag_rings[cap][:slots], q_pos, *key[1:])
                made[key] = fold_mask(visible, groups, self.drafter.dtype)
            out.append(made[key])
        return out

    def _on_kernel(self, layer: int, span: int | None) -> bool:
        """A RingBlock for this layer: Triton kernels asked for, a bidirectional full-attention layer, and
        a span within the window (below it the ring has not wrapped, so position p sits in slot p, and
        the window holds every position below the block)."""
        cfg = self.drafter.cfg
        return (self.kernels == "triton" and span is not None and span <= self.window
                and cfg.layer_window(layer) is None and not cfg.layer_is_causal(layer))

    def _visible(self, tags: torch.Tensor, q_pos: torch.Tensor, window: int | None, causal: bool) -> torch.Tensor:
        """Boolean [size, slots + size]: the context slots, then the block's own keys (see masks)."""
        start = q_pos[:1]
        ctx = ((tags < start) & (tags >= start - self.window) & (tags >= 0))[None, :].expand(q_pos.shape[0], -1)
        if window is not None:
            ctx = ctx & (q_pos[:, None] - tags[None, :] < window)
        return torch.cat([ctx, block_mask(q_pos, q_pos, causal, window)], dim=1)

    def kv(self, span: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's K/V over its first min(span, cap) slots. span: a bound on the positions ever
        appended since the reset (the engine's KV bucket of the block's end). Below its cap a ring has not
        wrapped, so position p sits in slot p and the slots from span on hold nothing: a short context
        attends over its few slots, not the whole ring (the draft's attention and K/V copies scale with
        it). None: every slot."""
        return [(k[:, :, :n], v[:, :, :n]) for k, v, n in zip(self.k, self.v, self._slots(span))]

    def _slots(self, span: int | None) -> list[int]:
        """Slots each layer attends over: min(span, cap)."""
        return [cap if span is None else min(span, cap) for cap in self.caps]


def drafter_kernels(target_kernels: str, drafter: DFlashDrafter) -> str:
    """The drafter's kernels (DrafterContext): Triton's where the target's are asked to be, and with
    'auto' on CUDA where Triton is installed; torch's for a head dim that is not a power of two, which
    the kernels' tiles cannot take (the target's kernels, which the flag names, are chosen apart)."""
    from ..kernels.triton_support import usable

    dim = drafter.cfg.head_dim
    wanted = target_kernels == "triton" or (target_kernels == "auto" and usable(drafter.device))
    return "triton" if wanted and dim & (dim - 1) == 0 else "torch"


def propose(drafter: DFlashDrafter, target, context: DrafterContext, block: torch.Tensor,
            q_pos: torch.Tensor, span: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Draft tokens for positions q_pos[1:] (argmax) from the block [last, MASK x (size-1)] at q_pos, into
    `out` where given. span: DrafterContext.kv's bound on the context positions."""
    x = drafter.block_embeddings(target.model.embed_tokens, block[None])
    hidden = drafter(x, q_pos, context.kv(span), context.masks(q_pos, span))
    return argmax(drafter.logits(hidden[0, 1:], target.lm_head), out)

