"""The engine: a request's ids -> a stream of text chunks and a final result with its statistics.

Loop (nano-vllm style): prefill, then per step decide (controller) -> run (plain or speculative step)
-> postprocess (push committed tokens through the output tracker, commit their features).

State of one sequence: `tokens` (prompt + generated) and `processed`, the number of positions whose
KV and features exist. tokens[processed] is the newest committed token, not yet run through the target;
it is the first token of the next block.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .controller import SpecController
from .drafter import DFlashDrafter, DrafterContext, propose, validate_pair
from .errors import UserError
from .features import FeatureStore, drafter_window
from .models import TargetModel
from .output import OutputTracker
from .sampling import SamplingParams, choose
from .stats import PhaseTimer, SpecStats
from .tokenizer import Detokenizer, Tokenizer


@dataclass
class Result:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str
    prefill_s: float
    decode_s: float
    seed: int | None
    spec: SpecStats | None = None

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tok_per_s(self) -> float:
        return self.generated_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def to_json(self) -> dict:
        out = {
            "text": self.text,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "finish_reason": self.finish_reason,
            "tok_per_s": round(self.tok_per_s, 2),
            "prefill_s": round(self.prefill_s, 6),
            "decode_s": round(self.decode_s, 6),
            "seed": self.seed,
        }
        if self.spec is not None:
            out.update(self.spec.to_json())
        return out


@dataclass
class Chunk:
    """Text (and the tokens behind it) produced since the previous chunk; `result` on the last one."""

    text: str
    token_ids: list[int]
    result: Result | None = None


@dataclass
class Sequence:
    tokens: list[int]
    processed: int
    params: SamplingParams
    tracker: OutputTracker
    new_tokens: list[int] = field(default_factory=list)


class Engine:
    def __init__(self, target: TargetModel, tokenizer: Tokenizer, drafter: DFlashDrafter | None = None, *,
                 max_ctx: int | None = None, block_size: int | None = None, feature_dtype: str = "f32",
                 feat_ring_cap: int | None = None, trained_ctx: int | None = None, spec: str = "auto",
                 prefill_chunk: int = 1024):
        self.target, self.tokenizer, self.drafter = target, tokenizer, drafter
        cfg = target.cfg
        self.max_ctx = min(max_ctx or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if self.max_ctx < 2:
            raise UserError(f"max context must be at least 2 tokens, got {self.max_ctx}")
        self.device = target.device
        self.cache = target.new_cache(1, self.max_ctx)
        self.stop_ids = tokenizer.stop_ids(cfg.eos_token_ids)
        self.prefill_chunk = prefill_chunk
        self.controller = SpecController(mode=spec if drafter is not None else "off")
        self.taps: tuple[int, ...] = ()
        if drafter is not None:
            validate_pair(drafter.cfg, cfg, block_size)
            self.block_size = block_size or drafter.cfg.block_size
            self.taps = drafter.cfg.target_layer_ids
            self.trained_ctx = trained_ctx or drafter.cfg.trained_context_length
            self.window = drafter_window(self.max_ctx, self.trained_ctx, feat_ring_cap)
            width = len(self.taps) * cfg.hidden_size
            self.features = FeatureStore(self.window, width, feature_dtype, target.dtype, self.device,
                                         drafter.device)
            self.context = DrafterContext(drafter, self.window)

    # --- public API ---------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[Chunk]:
        """Stream a completion of prompt_ids; the last chunk carries the Result."""
        params = params.validated()
        self._check_prompt(prompt_ids)
        seq = Sequence(list(prompt_ids), 0, params, OutputTracker(
            Detokenizer(self.tokenizer), self.stop_ids, params.stop, params.max_new_tokens))
        spec = SpecStats(self.block_size) if self.drafter is not None else None
        timer = PhaseTimer(self.device)
        t0 = time.perf_counter()
        first = self._prefill(seq)
        self._postprocess(seq, [first])
        prefill_s = time.perf_counter() - t0
        yield Chunk(seq.tracker.stream(), self._take_new(seq))
        t1 = time.perf_counter()
        self.controller.new_request()
        while not seq.tracker.finished:
            committed = self._step(seq, spec, timer)
            self._postprocess(seq, committed)
            yield Chunk(seq.tracker.stream(), self._take_new(seq))
        decode_s = time.perf_counter() - t1
        if spec is not None:
            phases = timer.collect()
            spec.draft_s, spec.verify_s = phases.get("draft", 0.0), phases.get("verify", 0.0)
        result = Result(seq.tracker.text, seq.tracker.tokens, len(prompt_ids), seq.tracker.finish_reason,
                        prefill_s, decode_s, None if params.greedy else params.seed, spec)
        yield Chunk(seq.tracker.stream(), [], result)

    def complete(self, prompt_ids: list[int], params: SamplingParams) -> Result:
        for chunk in self.generate(prompt_ids, params):
            if chunk.result is not None:
                return chunk.result
        raise AssertionError("generate ended without a result")

    # --- schedule -> run -> postprocess ------------------------------------------------------------
    def _check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise UserError("the prompt is empty")
        if len(prompt_ids) >= self.max_ctx:
            raise UserError(f"the prompt has {len(prompt_ids)} tokens but the context holds {self.max_ctx} "
                            "(prompt + at least 1 new token); shorten it or raise --max-ctx")
        vocab = self.target.cfg.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise UserError(f"prompt token ids must be in [0, {vocab})")

    def _block_size_for(self, seq: Sequence) -> int:
        """Tokens one verify may commit: the block, cut to the tokens still wanted and the room left."""
        room = self.max_ctx - len(seq.tokens)
        wanted = seq.params.max_new_tokens - len(seq.tracker.tokens)
        return min(self.block_size, room, wanted)

    def _step(self, seq: Sequence, spec: SpecStats | None, timer: PhaseTimer) -> list[int]:
        """One decode step, speculative when the controller says it pays; both end in one host sync,
        so the wall time measured here is the step's real cost."""
        begin = time.perf_counter()
        if spec is not None and self._block_size_for(seq) >= 2 and self.controller.use_spec():
            committed, size, accepted = self._spec_step(seq, timer)
            spec.record(size, accepted)
            self.controller.record_spec(len(committed), time.perf_counter() - begin)
            return committed
        committed = self._plain_step(seq)
        if spec is not None:
            spec.plain_steps += 1
            self.controller.record_plain(time.perf_counter() - begin)
        return committed

    def _prefill(self, seq: Sequence) -> int:
        """Run the prompt through the target in chunks (capturing features) and choose the first token."""
        if self.drafter is not None:
            self.features.reset()
            self.context.reset()
        n = len(seq.tokens)
        ids = torch.tensor(seq.tokens, device=self.device)
        for lo in range(0, n, self.prefill_chunk):
            hi = min(n, lo + self.prefill_chunk)
            positions = torch.arange(lo, hi, device=self.device)
            logits, feats = self.target(ids[None, lo:hi], positions, self.cache, hi, capture=self.taps,
                                        logits="last" if hi == n else "none")
            self._commit_features(lo, feats)
        seq.processed = n
        return choose(logits[0], torch.tensor([n], device=self.device), seq.params).item()

    def _plain_step(self, seq: Sequence) -> list[int]:
        pos = seq.processed
        token = torch.tensor([[seq.tokens[pos]]], device=self.device)
        positions = torch.tensor([pos], device=self.device)
        logits, feats = self.target(token, positions, self.cache, pos + 1, capture=self.taps)
        seq.processed += 1
        self._commit_features(pos, feats)
        return [choose(logits[0], positions + 1, seq.params).item()]

    def _spec_step(self, seq: Sequence, timer: PhaseTimer) -> tuple[list[int], int, int]:
        """Draft a block, verify it in one target forward, keep the longest agreeing prefix + the target's
        own next token. Returns (committed tokens, block size, accepted drafts)."""
        start = seq.processed
        size = self._block_size_for(seq)
        last = torch.tensor([seq.tokens[start]], device=self.device)
        timer.start("draft")
        drafts = propose(self.drafter, self.target, self.context, last, start, size)
        timer.stop()
        timer.start("verify")
        positions = torch.arange(start, start + size, device=self.device)
        block = torch.cat([last, drafts.to(self.device)])
        logits, feats = self.target(block[None], positions, self.cache, start + size, capture=self.taps)
        choices = choose(logits[0], positions + 1, seq.params)
        accepted = (drafts == choices[:-1]).cumprod(0).sum()
        host = torch.cat([accepted[None], choices]).tolist()  # the step's one host sync
        timer.stop()
        n = host[0]
        self.cache.keep(n + 1)
        seq.processed += n + 1
        self._commit_features(start, feats[0, : n + 1])
        return host[1 : n + 2], size, n

    def _commit_features(self, start: int, feats: torch.Tensor | None) -> None:
        if self.drafter is None:
            return
        rows = feats.reshape(-1, feats.shape[-1])
        first, stored = self.features.commit(start, rows)
        self.context.append(first, stored)

    def _postprocess(self, seq: Sequence, committed: list[int]) -> None:
        for token in committed:
            seq.tokens.append(token)
            seq.new_tokens.append(token)
            if seq.tracker.push(token):
                return
        if len(seq.tokens) >= self.max_ctx:
            seq.tracker.end("length")

    @staticmethod
    def _take_new(seq: Sequence) -> list[int]:
        new, seq.new_tokens = seq.new_tokens, []
        return new
