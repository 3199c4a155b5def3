"""The OpenAI wire format: request bodies (pydantic) and the response, chunk and usage bodies.

Fields OpenAI defines but this engine cannot honour (penalties, logprobs, tools, ...) are ignored, except
`n` > 1, which is refused so that a client never silently receives fewer choices than it asked for.
`top_k` is an extension (as in vLLM). Optional fields may be null. Without max_tokens a generation may
run to the end of the context.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_core import PydanticCustomError

from ..engine.engine import Result
from ..engine.sampling import SamplingParams
from ..engine.stats import SpecStats


class GenerationRequest(BaseModel):
    model: str | None = None
    stream: bool | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise PydanticCustomError("n_unsupported", "only n=1 is supported (one choice per request); "
                                      "send n requests to get n completions")
        return n

    def token_limit(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, context: int) -> SamplingParams:
        """Engine parameters with OpenAI's defaults (temperature 1); `context` bounds a limitless request."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        limit = self.token_limit()
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            max_new_tokens=context if limit is None else limit,
            stop=tuple(stop),
        )


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(GenerationRequest):
    prompt: str


# --- responses --------------------------------------------------------------------------------------
class ChatShape:
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    @staticmethod
    def choice(text: str, finish_reason: str) -> dict:
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}

    @staticmethod
    def delta(text: str, finish_reason: str | None, first: bool) -> dict:
        delta = {"role": "assistant"} if first else {}
        if text or first:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


class CompletionShape:
    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl"

    @staticmethod
    def choice(text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    @staticmethod
    def delta(text: str, finish_reason: str | None, first: bool) -> dict:
        return CompletionShape.choice(text, finish_reason)


class Reply:
    """The identity shared by a response and all chunks of its stream."""

    def __init__(self, shape: type[ChatShape] | type[CompletionShape], model: str):
        self.shape = shape
        self.model = model
        self.id = f"{shape.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _body(self, obj: str, choice: dict) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}

    def complete(self, result: Result) -> dict:
        return self._body(self.shape.object, self.shape.choice(result.text, result.finish_reason)) | report(result)

    def chunk(self, text: str, first: bool = False) -> dict:
        return self._body(self.shape.chunk_object, self.shape.delta(text, None, first))

    def last_chunk(self, result: Result) -> dict:
        """Ends a stream: finish_reason, usage and the speculative metrics (all text came before)."""
        return self._body(self.shape.chunk_object, self.shape.delta("", result.finish_reason, False)) | report(result)


def report(result: Result) -> dict:
    return {"usage": usage(result), "metrics": {"speculative_decoding": speculative_decoding(result.spec)}}


def usage(result: Result) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.generated_tokens,
            "total_tokens": result.prompt_tokens + result.generated_tokens}


def speculative_decoding(spec: SpecStats | None) -> dict | None:
    """None when the server runs without a drafter; with one, zeros until speculation runs."""
    if spec is None:
        return None
    return {
        "mean_acceptance_length": round(spec.acceptance_length, 4),
        "acceptance_histogram": list(spec.histogram),
        "num_spec_steps": spec.steps,
        "num_draft_tokens": spec.draft_tokens,
        "num_accepted_tokens": spec.accepted_tokens,
    }
