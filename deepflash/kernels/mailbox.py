"""Decode steps' results to the host without a copy on the stream.

Each decode step ends with a kernel that writes its result (StepState.result) into a slot of page-locked
host memory, which the GPU addresses directly (unified addressing), tagged with the step's number; the
host reads the slot once the step's event has completed. Before, the host queued a device-to-host copy
after every step graph: the copy engine waited for the step, and the next step for the copy (under the
profiler the GPU idled ~6 us before the copy and ~20 us after it, per step: profile_step.py --timeline).
Posted by this kernel instead: plain decode +0.8% / +2.3%, a spec step's device time -0.8% / -0.9%, same
outputs (scripts/gpu/kernels_ab.py on the embedded pair, two rounds, forty-fourth session).

Slots are reused in turn; the engine keeps fewer steps in flight than there are slots, so a slot is read
before a later step rewrites it, and the tag makes a step read in the wrong slot an error, not a wrong
token.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch's CPU builds do not bring Triton
    triton = None

# False: the step writes its slot in device memory and the engine copies it to the host after the step,
# as before (scripts/gpu/kernels_ab.py --arm "copy=mailbox.KERNEL:False")
KERNEL = True


class Mailbox:
    """`slots` slots of [step number, result...] on the host; `posted` counts the steps posted so far (on
    the device: a step graph advances it, a capture's warm-up puts it back with the other step buffers)."""

    def __init__(self, slots: int, width: int, device: torch.device):
        self.slots, self.width = slots, width
        cuda = device.type == "cuda"
        self.host = torch.full((slots, width + 1), -1, dtype=torch.long, pin_memory=cuda)
        self.posted = torch.zeros((), dtype=torch.long, device=device)
        self.direct = cuda and KERNEL and triton is not None
        # where a step writes without the kernel: the host slots themselves on the CPU, else device memory
        # copied after the step (send)
        self.staged = self.host if not cuda else torch.full_like(self.host, -1, device=device)

    def post(self, result: torch.Tensor) -> None:
        """Inside a step: result [width] to slot posted % slots, tagged with posted; posted += 1."""
        if self.direct:
            return post_kernel(result, self.posted, self.host)
        row = torch.cat([self.posted.view(1), result[: self.width]])
        self.staged.index_copy_(0, (self.posted % self.slots).view(1).to(self.staged.device), row[None])
        self.posted += 1

    def send(self, number: int) -> None:
        """After step `number` is queued: its slot to the host where the step could not write it there."""
        if not self.direct and self.staged is not self.host:
            slot = number % self.slots
            self.host[slot].copy_(self.staged[slot], non_blocking=True)

    def read(self, number: int, count: int) -> list[int]:
        """The first `count` values of step `number`'s result, once the step (and send) has completed."""
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
