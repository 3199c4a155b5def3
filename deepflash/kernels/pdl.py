"""Programmatic dependent launch (Hopper and later) for the decode step's Triton kernels.

A kernel launched as a dependent may start while the kernel before it finishes: its programs are placed
and wait on the device (`gdc_wait`) for the previous kernel's end and writes before they read or write
anything, so only the launch and the programs' start overlap the previous kernel's tail. A decode step
is hundreds of short kernels, and each boundary costs a launch gap. Each kernel that runs so calls
`gdc_launch_dependents` once its main work is done, letting the next one be placed, and only after its
own `gdc_wait` (the chunk and merge kernels rely on it). With the fused projections on an H200 this
raised plain decode from 1072-1080 to 1173-1174 tok/s and spec-on from 1905-1939 to 2045-2049, same
outputs.
"""

from __future__ import annotations

import functools

import torch

from .triton_support import INTERPRETED


@functools.cache
def _hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def dependent(device: torch.device) -> bool:
    """Whether a kernel on `device` launches as a dependent (its GDC constexpr and `launch_pdl`): on Hopper
    and later, not in Triton's interpreter."""
    return not INTERPRETED and _hopper(device)
