"""Token choice: greedy, or temperature / top-k / top-p sampling driven by position-keyed noise.

Sampling uses the Gumbel-max trick with uniforms hashed from (seed, absolute position, token id).
The token chosen at a position is then a pure function of the logits there, the seed and the
position: plain and speculative decoding make the same choice whenever they see the same logits,
and the speculative acceptance rule of REFERENCE 2.4 (accept while the target's sample equals the
draft) emits exactly the target's samples. Hashing instead of a stateful generator also keeps the
whole choice on the device with no host round trip.

A request's values (seed, temperature, top-k, top-p) live in device buffers (SamplingBuffers) that the
steps read, so one captured CUDA graph serves every value: graphs are keyed on the sampling *mode*
alone (greedy, sampled, sampled with top-k / top-p filtering), never on the values.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

import torch

from ..errors import UserError
from ..kernels.argmax import argmax

_MASK32 = 0xFFFFFFFF
MAX_LOGPROBS = 20  # alternatives a request may ask log-probabilities for (OpenAI's top_logprobs bound)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    # penalties on the target's logits before each choice (penalties.py): presence and frequency over the
    # tokens generated so far (OpenAI's), repetition over the prompt's and the generated ones (1: off)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # report each chosen token's log-probability and this many alternatives

    def validated(self) -> SamplingParams:
        """Check user values; fill in a random seed so that a sampled request is reproducible from its stats."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UserError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise UserError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise UserError("stop strings must be non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (math.isfinite(getattr(self, name)) and -2 <= getattr(self, name) <= 2):
                raise UserError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise UserError(f"repetition_penalty must be a number > 0 (1 disables it), got {self.repetition_penalty}")
        if self.logprobs is not None and (int(self.logprobs) != self.logprobs or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise UserError(f"logprobs (top alternatives) must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        seed = self.seed if self.seed is not None else random.getrandbits(31)
        if int(seed) != seed or seed < 0:
            raise UserError(f"seed must be an integer >= 0, got {seed}")
        return replace(self, seed=int(seed), top_k=int(self.top_k), max_new_tokens=int(self.max_new_tokens),
                       stop=tuple(self.stop), logprobs=None if self.logprobs is None else int(self.logprobs))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def mode(self) -> str:
        """What the choice computes (the part of a step graph's key that sampling decides): "greedy",
        "sample" (temperature only) or "filtered" (with top-k and/or top-p)."""
        if self.greedy:
            return "greedy"
        return "filtered" if self.top_k > 0 or self.top_p < 1.0 else "sample"

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def graph_key(self) -> tuple:
        """What a step's kernels depend on beyond its shapes (the values are device buffers): the sampling
        mode, whether penalties apply, and how many alternatives' log-probabilities it reports."""
        return self.mode, self.penalized, self.logprobs


class SamplingBuffers:
    """A request's sampling values on the device (0-d tensors), written between requests and read by the
    steps: a captured graph reads the current request's values."""

    def __init__(self, device: torch.device | str):
        self.seed = torch.zeros((), dtype=torch.int64, device=device)
        self.temperature = torch.ones((), dtype=torch.float32, device=device)
        self.top_k = torch.zeros((), dtype=torch.int64, device=device)  # 0: off
        self.top_p = torch.ones((), dtype=torch.float32, device=device)  # 1: off
        self.presence = torch.zeros((), dtype=torch.float32, device=device)
        self.frequency = torch.zeros((), dtype=torch.float32, device=device)
        self.repetition = torch.ones((), dtype=torch.float32, device=device)

    def load(self, params: SamplingParams) -> None:
        """Host writes (outside any graph): a validated request's values; greedy requests keep temperature 1
        (unread: greedy steps only take the argmax)."""
        self.seed.fill_(params.seed or 0)
        self.temperature.fill_(params.temperature if not params.greedy else 1.0)
        self.top_k.fill_(params.top_k)
        self.top_p.fill_(params.top_p)
        self.presence.fill_(params.presence_penalty)
        self.frequency.fill_(params.frequency_penalty)
        self.repetition.fill_(params.repetition_penalty)

    @classmethod
    def of(cls, params: SamplingParams, device: torch.device | str,
           seeds: list[int] | None = None) -> SamplingBuffers:
        """params' values on `device`; `seeds`: one per row of the logits instead of params.seed (a batch
        of requests, train/datagen.py)."""
        buffers = cls(device)
        buffers.load(params)
        if seeds is not None:
            buffers.seed = torch.tensor(seeds, dtype=torch.int64, device=device)
        return buffers


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3 finaliser on int64 tensors holding 32-bit values (products wrap; only low bits are kept)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seed: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms in (0, 1), shape [N, vocab], a function of (seed, position, token id) only.
    `seed` is a 0-d int64 tensor on the device (a buffer, so captured CUDA graphs read the current one)."""
    device = positions.device
    seed = seed.to(device=device, dtype=torch.int64)
    row = _mix32(_mix32((positions.to(torch.int64) & _MASK32) ^ _mix32(seed & _MASK32)) ^ ((seed >> 32) & _MASK32))
    ids = torch.arange(vocab, device=device, dtype=torch.int64)
    x = _mix32((row[:, None] + ids * 0x27D4EB2F) & _MASK32)
    x = _mix32(x ^ row[:, None])
    return (x.to(torch.float64) + 0.5) / 4294967296.0


def adjusted_logits(logits: torch.Tensor, params: SamplingParams,
                    buffers: SamplingBuffers | None = None) -> torch.Tensor:
    """float32 logits / temperature with tokens outside top-k and top-p set to -inf (transformers' order).
    The values come from `buffers` (from params where None); params decides only the mode."""
    values = buffers if buffers is not None else SamplingBuffers.of(params, logits.device)
    scores = logits.float() / values.temperature
    return _filtered(scores, values.top_k, values.top_p) if params.mode == "filtered" else scores


def _filtered(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p on one descending sort of the scores, with k and p as device values (k = 0 and
    p = 1 are off): the k-th largest score is the threshold of top-k, and top-p keeps the tokens of the
    surviving probability mass before the token that crosses p (that token stays)."""
    vocab = scores.shape[-1]
    ordered, order = scores.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth = ordered.gather(-1, (k - 1).expand(*ordered.shape[:-1], 1))
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = ordered.softmax(dim=-1)
    drop_sorted = (ordered == float("-inf")) | ((top_p < 1.0) & (probs.cumsum(dim=-1) - probs >= top_p))
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))


def choose(logits: torch.Tensor, positions: torch.Tensor | None, params: SamplingParams,
           buffers: SamplingBuffers | None = None) -> torch.Tensor:
    """The token for each row of logits [N, V]; positions [N] are the absolute positions being filled
    (read when sampling; greedy choices may pass None). Inside a step the engine passes its device
    `buffers`, whose values the choice reads (params decides only the mode, part of the graph's key);
    without them the values come from params."""
    if params.greedy:
        return argmax(logits)
    values = buffers if buffers is not None else SamplingBuffers.of(params, logits.device)
    gumbel = -torch.log(-torch.log(uniform_noise(values.seed, positions, logits.shape[-1])))
    return argmax(adjusted_logits(logits, params, values) + gumbel.float())
