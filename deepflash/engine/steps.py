"""Decode steps on device-resident state: prefill, plain step, draft and verify.

Each step reads its inputs from `StepState` buffers and advances them on the device (the verify step
picks the next "last token" and start position itself), so the host never writes inputs between
steps and only reads one small result tensor. That makes each step a fixed-shape function of static
buffers, which `graphs.StepGraphs` can capture once as a CUDA graph and replay.

Speculative step (REFERENCE 2): draft [last, MASK x (B-1)] -> argmax drafts d1..d(B-1); verify
[last, d1..] in one target forward; the target's choice c_k at each block position (argmax, or its
sample at temperature > 0); accept the longest prefix with d_k == c_(k-1), plus c_n as the bonus token.
"""

from __future__ import annotations

import functools

import torch

from ..drafter.context import DrafterContext, propose
from ..drafter.features import FeatureStore
from ..drafter.model import DFlashDrafter
from ..kernels.accept import accept
from ..kernels.mailbox import Mailbox
from .logprobs import LogprobSlots
from .penalties import TokenCounts, penalize
from .sampling import SamplingBuffers, SamplingParams, choose


def commits_aside(cuda: bool, shared_device: bool) -> bool:
    """Whether verify steps commit features on a stream of their own (Steps.aside; the memory plan counts
    its cuBLAS workspace): a verify block's features go to the rings and the drafter's context K/V whatever
    it accepts, so on CUDA that work runs from the moment the taps exist, beside the target's last layers,
    head and choice. With the drafter on the target's device only: its work on another device would not
    follow the stream."""
    return cuda and shared_device


class StepState:
    """Inputs and outputs of the step functions, on the device."""

    def __init__(self, device: torch.device, block_size: int, max_ctx: int, slots: int, vocab: int):
        long = dict(dtype=torch.long, device=device)
        self.prompt = torch.zeros(max_ctx, **long)  # the request's prompt, read by the prefill steps
        self.start = torch.zeros((), **long)  # positions processed by the target (KV and features exist)
        self.last = torch.zeros(1, **long)  # newest committed token, the next block's first token
        # the blocks of a speculative step: row 0 the draft's [last, MASK...] (Steps fills the masks), row 1
        # the verify's [last, drafts...]; the draft step copies `last` into both in one kernel, and the
        # drafts are written where the verify reads them. Only the draft step writes them: a hybrid target's
        # replay rollback (cache.keep) runs the verify's tokens again after the acceptance has set `last`
        self.blocks = torch.zeros((2, max(block_size, 2)), **long)
        self.drafts = self.blocks[1, 1:]
        self.offsets = torch.arange(max(block_size, 2), **long)  # a block's positions are start + offsets
        self.sampling = SamplingBuffers(device)  # the request's sampling values, which every step reads
        self.result = torch.zeros(block_size + 1, **long)  # [accepted drafts, committed tokens...]
        # tokens of the last verify step kept, accepted drafts + 1 (result[0] + 1), stored by the acceptance for
        # cache.keep: computing it from result would add a kernel to every verify step, which attention
        # caches, whose keep does nothing, would still run
        self.kept = torch.zeros((), **long)
        self.mailbox = Mailbox(slots, block_size + 1, device)  # each decode step posts its result to the host
        self.counts = TokenCounts(vocab, device)  # what the penalties read (requests that ask for them)
        self.logprobs = LogprobSlots(slots, max(block_size, 2), device)  # requests that ask for log-probabilities

    def buffers(self) -> list[torch.Tensor]:
        """What the steps write (a capture's warm-up puts them back); the prompt, the offsets and the
        sampling values are only read."""
        return [self.start, self.last, self.blocks, self.result, self.kept, self.mailbox.posted,
                self.counts.generated, self.logprobs.data]


class Steps:
    def __init__(self, target, cache, state: StepState, drafter: DFlashDrafter | None = None,
                 features: FeatureStore | None = None, context: DrafterContext | None = None):
        self.target, self.cache, self.state = target, cache, state
        self.drafter, self.features, self.context = drafter, features, context
        self.taps = drafter.cfg.target_layer_ids if drafter is not None else ()
        beside = drafter is not None and commits_aside(target.device.type == "cuda", drafter.device == target.device)
        self.aside = context_stream(target.device) if beside else None
        if drafter is not None:
            state.blocks[0, 1:] = drafter.cfg.mask_token_id

    def prefill(self, size: int, kv_len: int, params: SamplingParams) -> None:
        """The next `size` prompt tokens (state.prompt from state.start): their KV, features and drafter
        context K/V, and the choice after the last of them into result and last, so that the prompt's
        last chunk leaves the first new token. Fixed shapes: a graph per (size, kv_len) serves every
        prompt (the engine splits a prompt into a few sizes)."""
        s = self.state
        positions = s.start + torch.arange(size, device=s.start.device)
        tokens = s.prompt.gather(0, positions)
        logits, feats = self.target(tokens[None], positions, self.cache, kv_len, capture=self.taps, logits="last")
        self._commit(positions, feats)
        token = self._choose(logits[0], positions[-1:], params, None)
        s.result[:1].zero_()
        s.result[1:2].copy_(token)
        s.last.copy_(token)
        s.start += size

    def plain(self, kv_len: int, params: SamplingParams) -> None:
        """One target forward over the last token. Its features go to the rings, so drafting can resume
        with the full context; the drafter's context K/V of a run of plain steps is computed in one
        batch when drafting resumes (catch_up), not per step."""
        s = self.state
        pos = s.start.view(1)
        logits, feats = self.target(s.last.view(1, 1), pos, self.cache, kv_len, capture=self.taps)
        token = self._choose(logits[0], pos, params, s.last)
        if params.penalized:
            s.counts.commit(s.last, 1)
        if self.features is not None:
            self.features.store(pos, feats.reshape(-1, feats.shape[-1]))
        s.result[:1].zero_()  # not result[0] = 0: a host scalar copy cannot be captured in a graph
        s.result[1:2].copy_(token)
        s.last.copy_(token)
        s.start += 1
        s.mailbox.post(s.result)

    def speculate(self, size: int, kv_len: int, params: SamplingParams) -> None:
        """One speculative step: the draft, then the verify, at the block's positions (computed once for
        both; the drafter's context spans the verify's KV bucket)."""
        q_pos = self.positions(size)
        self.draft(size, kv_len, q_pos)
        self.verify(size, kv_len, params, q_pos)

    def positions(self, size: int) -> torch.Tensor:
        """The next block's positions: start + offsets (no arange kernel)."""
        return self.state.start + self.state.offsets[:size]

    def draft(self, size: int, span: int | None, q_pos: torch.Tensor) -> None:
        """span: a bound on every position the drafter's context holds (DrafterContext.kv); q_pos: the
        block's positions (positions)."""
        s = self.state
        s.blocks[:, :1].copy_(s.last.expand(2, 1))
        propose(self.drafter, self.target, self.context, s.blocks[0, :size], q_pos, span, out=s.drafts[: size - 1])

    def verify(self, size: int, kv_len: int, params: SamplingParams, q_pos: torch.Tensor) -> None:
        s = self.state
        # features of the whole block go in; positions past the accepted prefix stay invisible to the
        # drafter (masks admit only positions < start) until a later step commits and rewrites them. So
        # the commit needs the taps alone and starts as soon as they exist (_commit_beside)
        logits, _ = self.target(s.blocks[1:, :size], q_pos, self.cache, kv_len, capture=self.taps,
                                on_features=functools.partial(self._commit_beside, q_pos))
        fed = s.blocks[1, :size]
        choices = self._choose(logits[0], q_pos, params, fed)
        accept(s.drafts[: size - 1], choices, s.result, s.last, s.start, s.kept, s.mailbox)
        if params.penalized:
            s.counts.commit(fed, s.kept)
        self.cache.keep(s.kept)
        if self.aside is not None:  # the step ends when the commit has
            torch.cuda.current_stream().wait_stream(self.aside)

    def _choose(self, logits: torch.Tensor, positions: torch.Tensor, params: SamplingParams,
                fed: torch.Tensor | None) -> torch.Tensor:
        """The target's choices after logits [T, V] at `positions`, for a step that feeds the tokens `fed`
        (None: the prefill), with the request's penalties where it has them; with its log-probabilities
        written to the slot of the step's number where it asks for them (before the step posts)."""
        s = self.state
        scores = logits
        if params.penalized:
            scores = penalize(logits, s.counts.before(fed), s.counts.prompt, s.sampling)
        chosen = choose(scores, filled(positions, params), params, s.sampling)
        if params.logprobs is not None:
            s.logprobs.write(s.mailbox.posted, logits, chosen, params.logprobs)
        return chosen

    def catch_up(self, begin: int, end: int) -> None:
        """The drafter's context K/V of committed positions [begin, end) that plain steps left to the
        rings, from the mirror (checked reads: a position the mirror does not hold raises). Only the
        newest `window` of them can be visible. Eager: host shapes, once per return to drafting."""
        begin = max(begin, end - self.features.window)
        if end > begin:
            positions = torch.arange(begin, end, device=self.drafter.device)
            self.context.append(positions, self.features.mirror.read(begin, end - begin))

    def _commit_beside(self, positions: torch.Tensor, feats: torch.Tensor) -> None:
        """_commit on the aside stream, after the work queued so far (the taps), where there is one. The
        tensors it reads outlive the step function, and those it makes are freed on that stream, so the
        caching allocator reuses no block across the two streams before they join (verify). Its kernels
        share no state with the target's running beside them: its projections are torch's GEMMs, not
        kernels/gemv.py's, whose split reductions count arrivals in one array per device."""
        if self.aside is None:
            return self._commit(positions, feats)
        self.aside.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.aside):
            self._commit(positions, feats)

    def _commit(self, positions: torch.Tensor, feats: torch.Tensor | None) -> None:
        if self.features is None:
            return
        kept, rows = self.features.commit(positions, feats.reshape(-1, feats.shape[-1]))
        self.context.append(kept, rows)


def filled(positions: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """The positions that tokens chosen after `positions` fill, which only sampling reads: None when
    greedy, so that a greedy step has no kernel for them."""
    return None if params.greedy else positions + 1


def context_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream verify steps commit their features on (Steps._commit_beside), one per device for all
    engines of the process: cuBLAS keeps a 32 MiB workspace per stream it has run on (graphs.py)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _context_stream(index)


@functools.cache
def _context_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(torch.device("cuda", index))
