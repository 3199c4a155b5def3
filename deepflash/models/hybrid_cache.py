"""The cache of a hybrid model: KV for the full-attention layers, conv and recurrent states for the
Gated DeltaNet layers, and what `keep` needs to roll those states back exactly.

Attention KV rolls back for free (models/kv_cache.py). Recurrent states do not: after a verify forward over T tokens
they have absorbed all T, and keep(n) must leave them exactly as if only the first n had been fed.
A recorded forward first copies the states into `start_conv_all` / `start_state_all`; then, by `rollback`:

- "capture" (default): the forward also records, per DeltaNet layer, its conv window and a function of
  (start state, n) for the state after its first n tokens, given by the delta-rule path the layer ran
  (gated_deltanet.py); keep(n) slices the window and calls the function on `start_state_all`. n may be a
  device tensor (no host sync, fixed shapes: CUDA-graph safe). One mechanism per path:
  - the Triton kernel (decode and verify steps with the kernels on; Qwen3.5's default on CUDA): a replay
    of the first n tokens from the start state on the kernel's recorded inputs (k, v, g, beta), by the
    decode steps' own kernel binary with n read on the device (kernels/delta_rule.py state_after): bit
    for bit the state of n decode steps, which the greedy contract needs in bf16.
  - torch's forms (the CPU; CUDA with the kernels off; runs longer than the kernel takes): the closed
    form over the recorded k, g and the deltas the forms return (delta_rule.state_after_prefix). It
    rounds apart from feeding the tokens one by one, as the chunked verify itself does from decode steps.
- "replay" (the reference): the forward keeps a way to re-run itself; keep(n) restores the start
  states and re-runs the first n tokens. One n-token forward per keep; reads n on the host.

All state tensors are fixed buffers updated in place, so captured CUDA graphs stay valid.

What keep(n) means after a forward of T tokens ("the last forward" is always the latest call):
- n == T (an int): nothing to do, after any forward.
- n < T: the forward must have been recorded, i.e. 2 <= T <= rollback_tokens (a verify block, or a
  short prefill chunk). Decode steps (T = 1) and long prefill chunks are not recorded, so keep(n < T)
  after them raises instead of rolling back to a stale forward. A tensor n always needs a recorded
  forward (its value is not read). After keep(n) the kept tokens count as the last, unrecorded forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .kv_cache import KVCache

ROLLBACK_MODES = ("capture", "replay")


@dataclass
class _Run:
    """The last forward as keep() sees it."""

    tokens: int | None  # None: unknown (after a keep with a device tensor)
    recorded: bool = False
    rerun: Callable[[int], None] | None = None  # replay: feed its first n tokens again
    windows: dict[int, torch.Tensor] = field(default_factory=dict)  # capture, per DeltaNet slot
    prefix_states: dict[int, Callable[[torch.Tensor, int | torch.Tensor], torch.Tensor]] = field(default_factory=dict)


class HybridCache:
    has_state = True

    def __init__(self, kv: KVCache, layers: int, batch: int, conv_channels: int, conv_width: int,
                 state_shape: tuple[int, int, int], dtype: torch.dtype, state_dtype: torch.dtype,
                 device: torch.device | str, rollback: str = "capture", rollback_tokens: int = 64):
        self.kv = kv
        # one tensor per kind, so that a reset or a snapshot is one kernel; per-layer views for the layers
        self.conv_all = torch.zeros(layers, batch, conv_channels, conv_width, dtype=dtype, device=device)
        self.state_all = torch.zeros(layers, batch, *state_shape, dtype=state_dtype, device=device)
        self.start_conv_all = torch.zeros_like(self.conv_all)  # the states before the last recorded forward
        self.start_state_all = torch.zeros_like(self.state_all)
        self.conv, self.state = list(self.conv_all.unbind(0)), list(self.state_all.unbind(0))
        self.start_state = list(self.start_state_all.unbind(0))
        self.rollback, self.rollback_tokens = rollback, rollback_tokens
        self.capturing = False  # the running forward records traces for a capture rollback
        self.fresh = torch.zeros(1, dtype=torch.bool, device=device)  # the running forward is at position 0
        self._last = _Run(0)

    def volatile(self) -> list[torch.Tensor]:
        """The recurrent states: a discarded forward (a CUDA-graph warm-up) must be undone on them."""
        return [self.conv_all, self.state_all]

    @property
    def nbytes(self) -> int:
        parts = (self.conv_all, self.state_all, self.start_conv_all, self.start_state_all)
        return self.kv.nbytes + sum(t.nbytes for t in parts)

    def save_span(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv.save_span(lo, hi)

    def load_span(self, lo: int, span: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.kv.load_span(lo, span)

    def save_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the conv and recurrent states (the prefix cache's snapshot at a block's end)."""
        return self.conv_all.clone(), self.state_all.clone()

    def load_state(self, saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Resume from save_state's copies: the next forward continues after the position they were taken at."""
        self.conv_all.copy_(saved[0], non_blocking=True)
        self.state_all.copy_(saved[1], non_blocking=True)
        self._last = _Run(0)

    def begin(self, positions: torch.Tensor, rerun: Callable[[int], None]) -> None:
        """Called by the model before a forward at `positions`; rerun(n) feeds its first n tokens again.

        Like KV slots, the states need no reset between sequences: a forward at position 0 starts from
        zero states, decided on the device (no host sync). A multi-token forward zeroes the buffers here
        (one pass over them, little next to the forward); for a single token, decode's hot path, the
        layers fold `fresh` into the token's conv input and decay instead, at no cost."""
        tokens = positions.shape[0]
        self.fresh = positions[:1] == 0
        if tokens > 1:
            self.conv_all.masked_fill_(self.fresh, 0)
            self.state_all.masked_fill_(self.fresh, 0)
        recorded = 2 <= tokens <= self.rollback_tokens
        replay = self.rollback == "replay"
        if recorded:
            self.start_conv_all.copy_(self.conv_all)
            self.start_state_all.copy_(self.state_all)
        self._last = _Run(tokens, recorded, rerun if recorded and replay else None)
        self.capturing = recorded and not replay

    def update(self, slot: int, window: torch.Tensor, state: torch.Tensor, prefix_state=None) -> None:
        """A DeltaNet layer's new state; window = [previous K-1 inputs, this run's inputs] of its conv.
        prefix_state(start, n), while capturing: the state after this run's first n tokens from `start`."""
        self.conv[slot].copy_(window[..., window.shape[-1] - self.conv[slot].shape[-1] :])
        self.state[slot].copy_(state)
        if prefix_state is not None:
            self.record(slot, window, prefix_state)

    def record(self, slot: int, window: torch.Tensor, prefix_state) -> None:
        """What a capture rollback needs of a DeltaNet layer's run, where the layer updated its states in place
        itself (the Triton kernels): its conv window and prefix_state(start, n) as `update` takes them."""
        self._last.windows[slot], self._last.prefix_states[slot] = window, prefix_state

    def keep(self, kept: int | torch.Tensor) -> None:
        """Of the last forward's tokens keep the first `kept` (see the module doc)."""
        run = self._last
        self.capturing = False
        if isinstance(kept, int):
            if run.tokens is None or not 0 <= kept <= run.tokens:
                raise ValueError(f"keep({kept}) after a forward of {run.tokens} tokens")
            if kept == run.tokens:
                self._last = _Run(kept)
                return
        if not run.recorded:
            raise RuntimeError(f"cannot roll back a forward of {run.tokens} tokens: only forwards of 2.."
                               f"{self.rollback_tokens} tokens are recorded (new_cache rollback_tokens)")
        if run.rerun is None:
            self._rebuild(run, kept)
        else:
            kept = int(kept)
            self.conv_all.copy_(self.start_conv_all)
            self.state_all.copy_(self.start_state_all)
            if kept:
                run.rerun(kept)
        self._last = _Run(kept if isinstance(kept, int) else None)

    def _rebuild(self, run: _Run, kept: int | torch.Tensor) -> None:
        for slot, window in run.windows.items():
            conv = self.conv[slot]
            columns = kept + torch.arange(conv.shape[-1], device=window.device)  # the K-1 inputs before n
            conv.copy_(window.index_select(-1, columns))
            self.state[slot].copy_(run.prefix_states[slot](self.start_state[slot], kept))
