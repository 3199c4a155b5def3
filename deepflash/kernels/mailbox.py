"""Decode steps' results to the host without a copy on the stream.

Each decode step ends with a kernel that writes its result (StepState.result) into a slot of page-locked
host memory, which the GPU addresses directly (unified addressing), tagged with the step's number; the
host reads the slot once the step's event has completed. A device-to-host copy queued after every step
graph instead makes the copy engine wait for the step, and the next step for the copy (under the profiler
the GPU idled ~6 us before the copy and ~20 us after it, per step); against it, posting by this kernel
measured plain decode +0.8% / +2.3% and a spec step's device time -0.8% / -0.9% on the embedded pair (H200,
two rounds), same outputs. Off CUDA the step writes the host slot with torch ops.

Slots are reused in turn; the engine keeps fewer steps in flight than there are slots, so a slot is read
before a later step rewrites it, and the tag makes a step read in the wrong slot an error, not a wrong
token.
"""

from __future__ import annotations

import torch

from .triton_support import require, tl, triton


class Mailbox:
    """`slots` slots of [step number, result...] on the host; `posted` counts the steps posted so far (on
    the device: a step graph advances it, a capture's warm-up puts it back with the other step buffers)."""

    def __init__(self, slots: int, width: int, device: torch.device):
        self.slots, self.width = slots, width
        # on CUDA the device writes the host slots through the kernel (direct); elsewhere the step itself
        self.direct = device.type == "cuda"
        if self.direct:
            require()
        self.host = torch.full((slots, width + 1), -1, dtype=torch.long, pin_memory=self.direct)
        self.posted = torch.zeros((), dtype=torch.long, device=device)

    def post(self, result: torch.Tensor) -> None:
        """Inside a step: result [width] to slot posted % slots, tagged with posted; posted += 1."""
        if self.direct:
            return post_kernel(result, self.posted, self.host)
        row = torch.cat([self.posted.view(1), result[: self.width]])
        self.host.index_copy_(0, (self.posted % self.slots).view(1), row[None])
        self.posted += 1

    def read(self, number: int, count: int) -> list[int]:
        """The first `count` values of step `number`'s result, once the step has completed."""
        row = self.host[number % self.slots].tolist()
        if row[0] != number:
            raise RuntimeError(f"step result slot {number % self.slots} holds step {row[0]}, expected {number}")
        return row[1 : count + 1]


def post_kernel(result: torch.Tensor, posted: torch.Tensor, slots: torch.Tensor) -> None:
    """Mailbox.post's kernel (the tests run it in Triton's interpreter): slots [n, width + 1] where the
    device writes them (page-locked host memory on CUDA)."""
    n, width = slots.shape[0], slots.shape[1] - 1
    _post[(1,)](result, posted, slots, SLOTS=n, WIDTH=width, BLOCK=triton.next_power_of_2(width + 1), num_warps=1)


if triton is not None:

    @triton.jit
    def _post(result, posted, host, SLOTS: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
        number = tl.load(posted)
        i = tl.arange(0, BLOCK)
        values = tl.load(result + i - 1, mask=(i >= 1) & (i <= WIDTH), other=0)
        row = tl.where(i == 0, number, values)
        tl.store(host + (number % SLOTS) * (WIDTH + 1) + i, row, mask=i <= WIDTH)
        tl.store(posted, number + 1)
