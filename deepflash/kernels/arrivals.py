"""Arrival counters of the split reductions (kernels/gemv.py, argmax.py, quant_gemv.py, moe.py): per output,
how many of its programs have finished. Each program adds 1 when its part is stored; the last to arrive
combines the parts in a fixed order and sets the counter back to 0, so one zeroed array per kernel and
device serves every call. One per device suffices because a device's steps run one after another on
its stream (a dependent launch waits for the kernel before it to end, pdl.py)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def arrival_counters(kernel: str, size: int, device: torch.device) -> torch.Tensor:
    """`kernel`'s counters on `device`: `size` zeros (int32)."""
    return torch.zeros(size, dtype=torch.int32, device=device)
