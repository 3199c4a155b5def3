"""Decode steps' results to the host (mailbox.py): slots taken in turn, tagged with the step's number (the
kernel's test: test_accept_kernel.py)."""

import pytest
import torch

from deepflash.kernels.mailbox import Mailbox


def test_slots_in_turn_and_tagged():
    box = Mailbox(3, 5, torch.device("cpu"))
    for number in range(7):
        box.post(torch.arange(5) + 10 * number)
        assert box.read(number, 3) == [10 * number, 10 * number + 1, 10 * number + 2]
    assert int(box.posted) == 7


def test_reading_a_slot_a_later_step_rewrote_is_an_error():
    box = Mailbox(2, 4, torch.device("cpu"))
    for number in range(3):  # step 2 reuses step 0's slot
        box.post(torch.full((4,), number))
    assert box.read(2, 4) == [2, 2, 2, 2]
    with pytest.raises(RuntimeError, match="holds step 2, expected 0"):
        box.read(0, 4)

