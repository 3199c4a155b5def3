"""Token choice: greedy, or temperature / top-k / top-p sampling driven by position-keyed noise.

Sampling uses the Gumbel-max trick with uniforms hashed from (seed, absolute position, token id).
The token chosen at a position is then a pure function of the logits there, the seed and the
position: plain and speculative decoding make the same choice whenever they see the same logits,
and the speculative acceptance rule of REFERENCE 2.4 (accept while the target's sample equals the
draft) emits exactly the target's samples. Hashing instead of a stateful generator also keeps the
whole choice on the device with no host round trip.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

import torch

from ..errors import UserError
from ..kernels.argmax import argmax

_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()

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
        seed = self.seed if self.seed is not None else random.getrandbits(31)
        if int(seed) != seed or seed < 0:
            raise UserError(f"seed must be an integer >= 0, got {seed}")
        return replace(self, seed=int(seed), top_k=int(self.top_k), max_new_tokens=int(self.max_new_tokens),
                       stop=tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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


def adjusted_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float32 logits / temperature with tokens outside top-k and top-p set to -inf (transformers' order)."""
    scores = logits.float() / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = scores.topk(params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        drop_sorted = probs.cumsum(dim=-1) - probs >= params.top_p  # the token crossing top_p stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled token is drawn from (used by tests and the distribution checks)."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return adjusted_logits(logits, params).softmax(dim=-1)


def choose(logits: torch.Tensor, positions: torch.Tensor | None, params: SamplingParams,
           seed: torch.Tensor | None = None) -> torch.Tensor:
    """The token for each row of logits [N, V]; positions [N] are the absolute positions being filled
    (read when sampling; greedy choices may pass None). `seed` (0-d tensor) overrides params.seed;
    engines pass a device buffer."""
    if params.greedy:
        return argmax(logits)
    if seed is None:
        seed = torch.tensor(params.seed)
    gumbel = -torch.log(-torch.log(uniform_noise(seed, positions, logits.shape[-1])))
    return argmax(adjusted_logits(logits, params) + gumbel.float())
