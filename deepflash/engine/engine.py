"""The engine: a request's ids -> a stream of text chunks and a final result with its statistics.

Loop (nano-vllm style): prefill, then per step decide (controller) -> run (plain or speculative step)
-> postprocess (push committed tokens through the output tracker, commit their features).

State of one sequence: `tokens` (prompt + generated) and `processed`, the number of positions whose
KV and features exist. tokens[processed] is the newest committed token, not yet run through the target;
it is the first token of the next block.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ..drafter.checkpoint import validate_pair
from ..drafter.context import DrafterContext, drafter_kernels
from ..drafter.features import FeatureStore, drafter_window, pick_ring_kernels, storage_scale
from ..drafter.model import DFlashDrafter
from ..errors import UserError
from ..loading.tokenizer import Detokenizer, Tokenizer
from ..models import TargetModel
from ..models.kv_budget import BudgetKVCache, KVBudget
from .config import EngineConfig, context_length
from .controller import SpecController
from .graphs import StepGraphs, chunk_grid, kv_bucket, prefill_pieces
from .logprobs import TokenLogprob
from .memory import prefix_cache_bytes
from .output import OutputTracker
from .prefix_cache import PrefixCache
from .prefix_reuse import PrefixReuse
from .sampling import SamplingParams
from .stats import PhaseTimer, SpecStats
from .steps import Steps, StepState

PIPELINE_DEPTH = 2  # decode steps queued on the device at once (see Engine._fill)


class Cancelled(Exception):
    """Engine.generate stopped at its caller's request (its `cancelled` said so)."""


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
    logprobs: list[TokenLogprob] | None = None  # one per token id, where the request asked for them
    stop_string: str | None = None  # the stop string the output ended at, if one
    cached_tokens: int = 0  # prompt positions restored from the prefix cache instead of computed

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
            "cached_tokens": self.cached_tokens,
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
    logprobs: list[TokenLogprob] | None = None  # token_ids' log-probabilities, where the request asked for them


@dataclass
class Sequence:
    """Host view of one request. The device state (steps.StepState) runs up to PIPELINE_DEPTH steps ahead."""

    tokens: list[int]
    processed: int  # positions the target has processed once the last collected step is counted
    params: SamplingParams
    tracker: OutputTracker
    generated: int = 0  # tokens committed after the prompt (the first comes from prefill)
    new_tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the output tokens', where asked for
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    drafter_synced: int = 0  # positions below this have their K/V in the drafter's context (steps.Steps.plain)
    cached: int = 0  # prompt positions the prefix cache restored


@dataclass
class Launched:
    """A step in flight: what ran and where its result will be readable."""

    kind: str  # "plain" | "spec"
    size: int
    began: float
    number: int  # the step's number: where its result is readable (StepState.mailbox.read)
    ready: torch.cuda.Event | None = None  # None: the device ran the step inside its launch (the CPU)
    launch_s: float = 0.0
    region: int = 0  # the context region the controller decided it in (SpecController.use_spec)
    timed: bool = True  # False: one-off work (a capture, the drafter's catch-up) or other steps' host work
    # ran during it, its time is not its cost
    phases: int = 0  # PhaseTimer entries up to and including this step's


class Engine:
    """One sequence at a time on one device: target, tokenizer, optional drafter and the EngineConfig that
    says how to run them (its max_ctx a number or None, resolved by runtime.load_runtime where 'auto')."""

    def __init__(self, target: TargetModel, tokenizer: Tokenizer, drafter: DFlashDrafter | None = None,
                 config: EngineConfig = EngineConfig()):
        config = config.validated()
        self.config = config
        target.use_kernels(config.target_kernels)  # checks the choice; set again per request (generate)
        self.target, self.tokenizer, self.drafter = target, tokenizer, drafter
        cfg = target.cfg
        if config.rope_scaling and cfg.rope != cfg.with_rope_scaling(config.rope_scaling).rope:
            raise UserError(f"rope scaling {config.rope_scaling!r} is applied when the target is loaded "
                            "(load_target's rope_scaling, as runtime.load_runtime passes it); this target has none")
        self.max_ctx = context_length(config.max_ctx, cfg.positions)
        self.device = target.device
        self.stop_ids = tokenizer.stop_ids(cfg.eos_token_ids)
        self.controller = SpecController(mode=config.spec if drafter is not None else "off")
        self.block_size = 1
        features = context = None
        if drafter is not None:
            validate_pair(drafter.cfg, cfg, config.block_size)
            self.block_size = config.block_size or drafter.cfg.block_size
            self.trained_ctx = config.trained_ctx or drafter.cfg.trained_context_length
            self.window = drafter_window(self.max_ctx, self.trained_ctx, config.feat_ring_cap)
            width = len(drafter.cfg.target_layer_ids) * cfg.hidden_size
            features = FeatureStore(self.window, width, config.feature_dtype, target.dtype, self.device,
                                    drafter.device, slack=self.block_size,
                                    kernels=pick_ring_kernels(config.ring_kernels, self.device),
                                    channel_scale=storage_scale(drafter.fc.weight))
            context = DrafterContext(drafter, self.window, slack=self.block_size,
                                     kernels=drafter_kernels(config.target_kernels, drafter))
        self.cache = target.new_cache(1, self.max_ctx, self._kv_budget())
        self.kv = getattr(self.cache, "kv", self.cache)  # the attention layers' (a hybrid cache's kv)
        self.bounded = isinstance(self.kv, BudgetKVCache)
        # rope rows are gathered from tables rather than computed in every step (layers.Rotary.tabulate);
        # the tables cover the target's whole range, so that engines sharing a model share them
        target.rotary.tabulate(cfg.positions, target.dtype)
        if drafter is not None:
            drafter.rotary.tabulate(cfg.positions, drafter.dtype)
        # the mailbox's slots outnumber the steps in flight, so a step's slot is read before it is reused
        self.state = StepState(self.device, self.block_size, self.max_ctx, slots=PIPELINE_DEPTH + 1,
                               vocab=cfg.vocab_size)
        self.steps = Steps(target, self.cache, self.state, drafter, features, context)
        self.graphs = StepGraphs(self.state.buffers(), self.device, enabled=config.cuda_graphs, cache=self.cache)
        self.launches = 0  # decode steps launched: the next one's number
        self.prefix = None
        if config.prefix_cache:
            on_device, on_host = prefix_cache_bytes(target, drafter, self.max_ctx, config, self.device)
            index = PrefixCache(config.prefix_block, on_device, on_host, self.cache.has_state,
                                self.window if drafter is not None else None, grid=config.chunk)
            self.prefix = PrefixReuse(index, self.cache, features, self.steps.catch_up, config.chunk)

    def _kv_budget(self) -> KVBudget | None:
        """The bounded cache's sizes (--kv-budget): a forward writes a prefill chunk or a verify block."""
        if self.config.kv_budget is None:
            return None
        return KVBudget(self.config.kv_budget, max(self.config.chunk, self.block_size))

    # --- public API ---------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 cancelled: Callable[[], bool] | None = None) -> Iterator[Chunk]:
        """Stream a completion of prompt_ids; the last chunk carries the Result. `cancelled` is asked
        between prefill pieces (a long prompt's prefill raises Cancelled once it says so); between
        chunks the caller stops by closing the generator."""
        params = params.validated()
        self._check_prompt(prompt_ids)
        seq = Sequence(list(prompt_ids), len(prompt_ids), params, OutputTracker(
            Detokenizer(self.tokenizer), self.stop_ids, params.stop, params.max_new_tokens))
        spec = SpecStats(self.block_size) if self.drafter is not None else None
        timer = PhaseTimer(self.device)
        self.controller.new_request()
        # engines may share a target (the benchmarks): each request runs with this engine's kernels
        self.target.use_kernels(self.config.target_kernels)
        t0 = time.perf_counter()
        self._prefill(seq, cancelled)
        seq.generated = 1
        first = self.state.result[1:2].tolist()
        self._postprocess(seq, first, self._read_logprobs(seq, self.launches, first))
        prefill_s = time.perf_counter() - t0
        yield self._chunk(seq)
        t1 = time.perf_counter()
        self._last_collect = t1
        inflight: deque[Launched] = deque()
        self._fill(seq, inflight, timer)
        collected = 0  # PhaseTimer entries of the steps collected
        while inflight:
            launched = inflight.popleft()
            committed = self._collect(seq, launched, spec)
            logprobs = self._read_logprobs(seq, launched.number, committed)
            collected = launched.phases
            # queue the next step before the host digests this one, so the GPU always has the next
            # step waiting; not after a stop token, where the output ends (a stop string ends it later)
            if self.stop_ids.isdisjoint(committed):
                self._fill(seq, inflight, timer)
            self._postprocess(seq, committed, logprobs)
            yield self._chunk(seq)
            if seq.tracker.finished:
                break
        # steps still in flight run past the output's end: their results are discarded and the result does
        # not wait for them (the next request's first device work queues behind them: its prefill time)
        decode_s = time.perf_counter() - t1
        if spec is not None:
            phases = timer.collect(collected)
            spec.spec_s = phases.get("spec", 0.0)
        result = Result(seq.tracker.text, seq.tracker.tokens, len(prompt_ids), seq.tracker.finish_reason,
                        prefill_s, decode_s, None if params.greedy else params.seed, spec,
                        seq.logprobs if params.logprobs is not None else None, seq.tracker.stop_string,
                        seq.cached)
        yield Chunk(seq.tracker.stream(), [], result, [] if params.logprobs is not None else None)

    def wait_idle(self) -> None:
        """Wait for the steps generate left queued past an output's end (it returns without them): a
        benchmark counts them in the request's wall time."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

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

    @torch.no_grad()
    def _prefill(self, seq: Sequence, cancelled: Callable[[], bool] | None) -> None:
        """The prompt in pieces (prefill_pieces), from where the prefix cache's restore leaves it. Where the
        target allows it they are powers of two that may overlap, each run as a CUDA graph per (size, KV
        bucket): an eager prefill chunk is hundreds of host-bound kernel launches (~12 ms for a 170-token
        prompt on an H200). Else (recurrent layers) consecutive chunks on the grid of prefill_chunk, eager.
        With `cancelled`, the host keeps at most two pieces queued on the device and asks it before each
        launch: a cancelled request stops within about two pieces' time, where the host would otherwise
        queue the whole prompt at once."""
        if self.steps.features is not None:
            self.steps.features.reset()
            self.steps.context.reset()
        if self.bounded:
            self.kv.reset()
        params = seq.params
        self.state.sampling.load(params)
        n = len(seq.tokens)
        self.state.prompt[:n].copy_(torch.tensor(seq.tokens))
        if params.penalized:
            self.state.counts.reset(self.state.prompt[:n])
        seq.cached = self.prefix.restore(seq.tokens) if self.prefix is not None else 0
        graphs = self.target.idempotent_positions
        chunk = self.config.chunk
        pieces = prefill_pieces(n, chunk, seq.cached) if graphs else chunk_grid(seq.cached, n, chunk)
        queued: deque[torch.cuda.Event] = deque()
        for lo, size in pieces:
            if cancelled is not None:
                if len(queued) == 2:
                    queued.popleft().synchronize()
                if cancelled():
                    raise Cancelled("the request was cancelled during its prefill")
            self.state.start.fill_(lo)
            if self.bounded:
                self.kv.make_room(lo, lo + size)
            kv_len = kv_bucket(lo + size, self.max_ctx) if graphs else lo + size
            step = functools.partial(self.steps.prefill, size, kv_len, params)
            if graphs:
                self.graphs.run(("prefill", size, kv_len) + params.graph_key, step)
            else:
                step()
            if self.prefix is not None:
                self.prefix.save_prefill(seq.tokens, lo + size)
            if cancelled is not None and self.device.type == "cuda":
                queued.append(torch.cuda.Event())
                queued[-1].record()
        seq.drafter_synced = n

    def _room(self, seq: Sequence, inflight: deque[Launched] | tuple = ()) -> int:
        """Tokens a step launched after the `inflight` ones may still add to the output: cut by
        max_new_tokens (each in-flight step commits at least one token) and by the context."""
        wanted = seq.params.max_new_tokens - seq.generated - len(inflight)
        return min(self._context_room(seq, inflight), wanted)

    def _context_room(self, seq: Sequence, inflight: deque[Launched] | tuple = ()) -> int:
        """Positions a step launched after the `inflight` ones may process: each in-flight step may
        commit its whole size, and no step may write past the cache."""
        return self.max_ctx - 1 - self._processed_bound(seq, inflight)

    @staticmethod
    def _processed_bound(seq: Sequence, inflight: deque[Launched] | tuple) -> int:
        """Positions processed once the in-flight steps are done, at most."""
        return seq.processed + sum(launched.size for launched in inflight)

    def _fill(self, seq: Sequence, inflight: deque[Launched], timer: PhaseTimer) -> None:
        """Keep PIPELINE_DEPTH steps queued on the device while the output may still grow. Each step
        reads its inputs from the device state the previous one left, so queueing needs no host sync;
        the GPU then never waits for the host's sync, detokenization and next launch."""
        while len(inflight) < PIPELINE_DEPTH and not seq.tracker.finished and self._room(seq, inflight) > 0:
            launched = self._launch(seq, inflight, timer)
            if launched is None:  # a bounded cache's rebuild waits for the steps in flight
                return
            inflight.append(launched)

    @torch.no_grad()
    def _launch(self, seq: Sequence, inflight: deque[Launched], timer: PhaseTimer) -> Launched | None:
        """Schedule and start one step (plain or speculative) on the device; nothing waits for it. None: a
        bounded cache must be rebuilt first, at the committed length the steps in flight will leave."""
        # full blocks up to the end of the output: tokens past max_new_tokens are dropped by the tracker,
        # and a block cut to the few tokens still wanted would capture a new graph per size; only the end
        # of the context shortens a block
        size = min(self.block_size, self._context_room(seq, inflight))
        processed = self._processed_bound(seq, inflight)
        began = time.perf_counter()
        rebuilt = False
        if self.bounded:
            # the pool is rebuilt at exactly rebuild_at, as plain decoding meets it: a speculative block ends
            # there, and the rebuild waits until the host knows the committed length (no step in flight)
            if processed >= self.kv.rebuild_at:
                if inflight:
                    return None
                rebuilt = self.kv.make_room(processed, processed)  # host work and a sync: not the step's cost
            size = min(size, self.kv.rebuild_at - processed)
            self.kv.make_room(processed, processed + size)
        params = seq.params
        window = self.window if self.drafter is not None else None
        region = kv_bucket(processed + self.block_size, self.max_ctx, window)  # step costs are per KV bucket
        switched = False
        if self.drafter is not None and size >= 2 and self.controller.use_spec(region):
            kv_len = kv_bucket(processed + size, self.max_ctx, window)
            # switching work, not a spec step's cost: counted as one it would raise the break-even and turn
            # paying drafters off (DESIGN.md, the controller)
            switched = self._catch_up(seq, inflight, processed)
            timer.start("spec")
            # the drafter's ring holds no position at or past the verify's KV bucket: it attends over
            # that many slots (a graph per bucket, as the verify)
            captured = self.graphs.run(("spec", size, kv_len) + params.graph_key,
                                       lambda: self.steps.speculate(size, kv_len, params))
            timer.stop()
            kind = "spec"
        else:
            kv_len = kv_bucket(processed + 1, self.max_ctx, window)
            captured = self.graphs.run(("plain", kv_len) + params.graph_key, lambda: self.steps.plain(kv_len, params))
            kind, size = "plain", 1
        for queued in inflight:
            # a capture delays every step in flight; a spec launch's host work (the drafter's catch-up, its
            # graph's launch) can outlast a queued plain step on the device and delay its collect
            if captured or (kind == "spec" and queued.kind == "plain" and queued.ready is not None):
                queued.timed = False
        # the host learns the outcome from the step's mailbox slot; the device already advanced its own inputs
        number = self.launches
        self.launches += 1
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return Launched(kind, size, began, number, ready, time.perf_counter() - began, region,
                        timed=not (captured or switched or rebuilt), phases=len(timer.pending))

    def _catch_up(self, seq: Sequence, inflight: deque[Launched], processed: int) -> bool:
        """Before drafting: give the drafter the context K/V of the positions plain steps committed
        (True when there were any). With only plain steps in flight, `processed` is exact (each commits
        its one position); with a speculative step in flight there is nothing to catch up, its verify
        appends its own block."""
        if any(launched.kind == "spec" for launched in inflight) or seq.drafter_synced >= processed:
            return False
        self.steps.catch_up(seq.drafter_synced, processed)
        seq.drafter_synced = processed
        return True

    def _collect(self, seq: Sequence, launched: Launched, spec: SpecStats | None) -> list[int]:
        committed = self._read_result(launched)
        now = time.perf_counter()
        # a queued step starts when the previous one ends: its own time runs from the later of the two.
        # A step that ran inside its launch took its launch's time (between two collects, the CPU ran
        # the step launched after the first, not the one collected).
        seconds = now - max(launched.began, self._last_collect) if launched.ready is not None else launched.launch_s
        seconds = seconds if launched.timed else None
        self._last_collect = now
        seq.processed += len(committed)
        seq.generated += len(committed)
        if launched.kind == "spec":
            seq.drafter_synced = seq.processed  # the verify appended every committed position's K/V
            spec.record(launched.size, len(committed) - 1)
            self.controller.record_spec(len(committed), seconds, launched.region)
        elif spec is not None:
            spec.record_plain()
            self.controller.record_plain(seconds, launched.region)
        return committed

    def _read_result(self, launched: Launched) -> list[int]:
        """Committed tokens of a step: result = [accepted, token_1, ...] (the step's one sync)."""
        if launched.ready is not None:
            launched.ready.synchronize()
        values = self.state.mailbox.read(launched.number, launched.size + 1)
        return values[1 : values[0] + 2]

    def _read_logprobs(self, seq: Sequence, number: int, committed: list[int]) -> list[TokenLogprob] | None:
        """The committed tokens' log-probabilities from step `number`'s slot, where the request asked."""
        top = seq.params.logprobs
        return None if top is None else self.state.logprobs.read(number, committed, top)

    def _postprocess(self, seq: Sequence, committed: list[int], logprobs: list[TokenLogprob] | None) -> None:
        for i, token in enumerate(committed):
            seq.tokens.append(token)
            seq.new_tokens.append(token)
            if logprobs is not None:
                seq.logprobs.append(logprobs[i])
                seq.new_logprobs.append(logprobs[i])
            if seq.tracker.push(token):
                return
        if self._room(seq) <= 0:
            seq.tracker.end("length")

    @staticmethod
    def _chunk(seq: Sequence) -> Chunk:
        """The text and tokens since the previous chunk."""
        tokens, seq.new_tokens = seq.new_tokens, []
        logprobs, seq.new_logprobs = seq.new_logprobs, []
        return Chunk(seq.tracker.stream(), tokens, logprobs=logprobs if seq.params.logprobs is not None else None)
