"""The kernels that end a decode step, the verify's acceptance and the result's post to the host, against
their torch forms (Triton's interpreter on the CPU)."""

import pytest
import torch
from helpers import triton_device

from deepflash.kernels.accept import accept_kernel, accept_torch
from deepflash.kernels.mailbox import Mailbox, post_kernel

DEVICE = triton_device()


def outputs(fn, drafts, choices, start):
    state = [torch.full((choices.shape[0] + 3,), -7), torch.zeros(1, dtype=torch.long),
             torch.tensor(start), torch.zeros((), dtype=torch.long)]
    state = [t.to(DEVICE) for t in state]
    fn(drafts.to(DEVICE), choices.to(DEVICE), *state)
    return [t.cpu() for t in state]


@pytest.mark.parametrize("size", [2, 5, 16])
def test_accept_kernel_writes_what_the_torch_form_writes(size):
    gen = torch.Generator().manual_seed(size)
    choices = torch.randint(0, 50_000, (size,), generator=gen)
    for matched in range(size):  # every accepted length, from none to all drafts
        drafts = choices[:-1].clone()
        if matched < size - 1:
            drafts[matched] += 1
            drafts[matched + 1 :] = torch.randint(0, 3, (size - 2 - matched,), generator=gen)  # later matches count not
        got = outputs(accept_kernel, drafts, choices, 1000 + size)
        want = outputs(accept_torch, drafts, choices, 1000 + size)
        for a, b in zip(got, want):
            assert torch.equal(a, b), (matched, got, want)
        result, last, start, kept = got
        assert int(result[0]) == matched and int(kept) == matched + 1 and int(start) == 1000 + size + matched + 1
        assert int(last) == int(choices[matched]) and int(result[-1]) == -7  # nothing past the block


def test_post_kernel_writes_what_the_torch_form_writes():
    width, slots = 17, 3
    box = Mailbox(slots, width, torch.device("cpu"))
    host = torch.full((slots, width + 1), -1, dtype=torch.long, device=DEVICE)
    posted = torch.zeros((), dtype=torch.long, device=DEVICE)
    gen = torch.Generator().manual_seed(0)
    for number in range(5):
        result = torch.randint(0, 50_000, (width + 2,), generator=gen)  # longer than the slot: its head is posted
        box.post(result)
        post_kernel(result.to(DEVICE), posted, host)
        assert torch.equal(host.cpu(), box.host) and int(posted) == number + 1


@pytest.mark.parametrize("size", [3, 16])
def test_accept_kernel_posts_what_the_post_after_it_would(size):
    """The acceptance kernel with the mailbox writes the step's slot and count as
    the torch acceptance followed by Mailbox.post does, over more steps than slots."""
    gen = torch.Generator().manual_seed(size)
    box = Mailbox(3, size + 1, torch.device("cpu"))
    host = torch.full_like(box.host, -1, device=DEVICE)
    posted = torch.zeros((), dtype=torch.long, device=DEVICE)
    for number in range(5):
        choices = torch.randint(0, 50_000, (size,), generator=gen)
        drafts = choices[:-1].clone()
        drafts[number % (size - 1)] += 1
        got = outputs(lambda *args: accept_kernel(*args, mailbox=(posted, host)), drafts, choices, 10)
        want = outputs(accept_torch, drafts, choices, 10)
        box.post(want[0])
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)
        assert torch.equal(host.cpu(), box.host) and int(posted) == number + 1
