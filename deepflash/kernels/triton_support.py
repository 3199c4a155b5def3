"""Whether Triton's kernels can run, decided in one place.

Torch's CUDA builds bring Triton; its CPU builds do not. On CUDA with Triton the engine's defaults take
the Triton kernels; elsewhere the torch forms beside each kernel run. Importing this module imports
Triton, so the model and engine code import it only where a kernel is about to be used. With
`TRITON_INTERPRET=1` (set before Triton is first imported) the kernels run on the CPU in Triton's
interpreter, which is how the tests check them without a GPU.
"""

from __future__ import annotations

import os

import torch

from ..errors import UserError

try:
    import triton
    import triton.language as tl
except ImportError:  # torch's CPU builds do not bring Triton
    triton = tl = None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MISSING = "Triton kernels need the triton package (it comes with CUDA builds of torch)"


def installed() -> bool:
    return triton is not None


def usable(device: torch.device | str) -> bool:
    """Whether the engine's defaults run Triton kernels on `device`: CUDA with Triton installed."""
    return torch.device(device).type == "cuda" and installed()


def require() -> None:
    """For a choice of Triton kernels the user made: one line naming the fix where Triton is missing."""
    if not installed():
        raise UserError(MISSING)
