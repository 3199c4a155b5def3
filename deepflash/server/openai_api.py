"""The OpenAI wire format: chat and text completion requests (pydantic), and their responses and chunks.

Chat requests may carry tools (their calls come back as `tool_calls`), ask for log-probabilities, set
penalties (`repetition_penalty` and `top_k` are vLLM's extensions), and ask for `n` completions, which run
one after another. A Qwen3-style `<think>` block comes back as `reasoning_content`, as vLLM returns it.
Optional fields may be null; fields this engine does not implement (`logit_bias`, `response_format`, ...)
are ignored. Without max_tokens a generation may run to the end of the context.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..engine.engine import Result
from ..engine.logprobs import TokenLogprob
from ..engine.sampling import MAX_LOGPROBS, SamplingParams
from ..engine.stats import SpecStats
from ..loading.tokenizer import Tokenizer
from .chat import Conversation
from .reply import Event, ToolCall

MAX_CHOICES = 16


class GenerationRequest(BaseModel):
    model: str | None = None
    stream: bool | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None

    def token_limit(self) -> int | None:
        return self.max_tokens

    def alternatives(self) -> int | None:
        """How many alternatives' log-probabilities each token reports; None: no log-probabilities."""
        return None

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
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logprobs=self.alternatives(),
        )


class Function(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: Function


class FunctionCall(BaseModel):
    name: str
    arguments: str = "{}"


class MessageToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        if isinstance(content, list) and any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise PydanticCustomError("text_only", "content must be a string or a list of text parts "
                                      "({'type': 'text', 'text': ...}); this server takes no images or audio")
        return content

    @model_validator(mode="after")
    def _has_content(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def for_template(self) -> dict:
        """The message as chat.render takes it: text content, OpenAI's call objects, `developer` as
        `system` (templates know the latter)."""
        text = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        out = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return out


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: dict  # {"name": ...}

    @model_validator(mode="after")
    def _named(self) -> NamedToolChoice:
        if not isinstance(self.function.get("name"), str):
            raise ValueError("a named tool_choice needs function.name")
        return self


class ChatRequest(GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict | None = None  # vLLM's: e.g. {"enable_thinking": false}

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> Conversation:
        thinking = (self.chat_template_kwargs or {}).get("enable_thinking")
        choice = self.tool_choice if not isinstance(self.tool_choice, NamedToolChoice) else \
            {"type": "function", "function": {"name": self.tool_choice.function["name"]}}
        return Conversation([m.for_template() for m in self.messages],
                            [t.model_dump(exclude_none=True) for t in self.tools or []],
                            choice or ("auto" if self.tools else "none"),
                            None if thinking is None else bool(thinking))


class CompletionRequest(GenerationRequest):
    prompt: str
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def alternatives(self) -> int | None:
        return self.logprobs


# --- responses --------------------------------------------------------------------------------------
class Reply:
    """The identity shared by a response and all chunks of its stream."""

    def __init__(self, kind: Literal["chat", "text"], model: str, tokenizer: Tokenizer):
        self.kind, self.model, self.tokenizer = kind, model, tokenizer
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def body(self, choices: list[dict], chunk: bool = False, results: list[Result] = ()) -> dict:
        obj = {"chat": "chat.completion", "text": "text_completion"}[self.kind] + (".chunk" if chunk and
                                                                                   self.kind == "chat" else "")
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        return out | report(list(results)) if results else out

    def choice(self, index: int, result: Result, events: list[Event], calls: list[ToolCall]) -> dict:
        """A whole choice of a finished generation (events: its reply parsed)."""
        if self.kind == "text":
            return {"index": index, "text": result.text, "finish_reason": result.finish_reason,
                    "logprobs": self.text_logprobs(result.logprobs)}
        content = "".join(e.text for e in events if e.kind == "content")
        reasoning = "".join(e.text for e in events if e.kind == "reasoning")
        message = {"role": "assistant", "content": content or (None if calls else "")}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [tool_call(c) for c in calls]
        return {"index": index, "message": message, "logprobs": self.chat_logprobs(result.logprobs),
                "finish_reason": "tool_calls" if calls else result.finish_reason}

    def delta(self, index: int, events: list[Event], logprobs: list[TokenLogprob] | None, calls_before: int,
              first: bool = False) -> dict | None:
        """A stream chunk's choice for a chunk of text (its parsed events); None when it says nothing."""
        if self.kind == "text":
            text = "".join(e.text for e in events)
            if not text and not first:
                return None
            return {"index": index, "text": text, "finish_reason": None, "logprobs": self.text_logprobs(logprobs)}
        delta: dict = {"role": "assistant", "content": ""} if first else {}
        content = "".join(e.text for e in events if e.kind == "content")
        reasoning = "".join(e.text for e in events if e.kind == "reasoning")
        calls = [e.call for e in events if e.kind == "tool_call"]
        if content:
            delta["content"] = content
        if reasoning:
            delta["reasoning_content"] = reasoning
        if calls:
            delta["tool_calls"] = [tool_call(c, calls_before + i) for i, c in enumerate(calls)]
        if not delta and not logprobs:
            return None
        return {"index": index, "delta": delta, "logprobs": self.chat_logprobs(logprobs), "finish_reason": None}

    def last_delta(self, index: int, result: Result, calls: list[ToolCall]) -> dict:
        finish = "tool_calls" if calls and self.kind == "chat" else result.finish_reason
        if self.kind == "text":
            return {"index": index, "text": "", "finish_reason": finish, "logprobs": None}
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}

    def chat_logprobs(self, logprobs: list[TokenLogprob] | None) -> dict | None:
        if logprobs is None:
            return None
        return {"content": [self._entry(e.token, e.logprob) | {"top_logprobs": [self._entry(t, lp) for t, lp in e.top]}
                            for e in logprobs]}

    def text_logprobs(self, logprobs: list[TokenLogprob] | None) -> dict | None:
        if logprobs is None:
            return None
        tokens = [self.tokenizer.decode([e.token]) for e in logprobs]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in logprobs], "text_offset": offsets,
                "top_logprobs": [{self.tokenizer.decode([t]): lp for t, lp in e.top} for e in logprobs]}

    def _entry(self, token: int, logprob: float) -> dict:
        text = self.tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def tool_call(call: ToolCall, index: int | None = None) -> dict:
    out = {"id": f"call_{call.id}", "type": "function",
           "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
    return out if index is None else {"index": index} | out


def report(results: list[Result]) -> dict:
    """usage summed over the choices (the prompt and its cached part counted once); the first choice's
    speculative metrics (each choice is a generation)."""
    prompt = results[0].prompt_tokens
    generated = sum(r.generated_tokens for r in results)
    return {"usage": {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
                      "prompt_tokens_details": {"cached_tokens": results[0].cached_tokens}},
            "metrics": {"speculative_decoding": speculative_decoding(results[0].spec)}}


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
