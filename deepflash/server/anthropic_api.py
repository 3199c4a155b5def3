"""The Anthropic Messages wire format: requests, the message body, its stream's events and error bodies.

A request is turned into the same Conversation as an OpenAI chat (chat.render): text, tool_use and
tool_result blocks become messages, tool calls and tool results; `tool_choice` any / tool / none map to
required / a named function / none; `thinking` enabled or disabled passes enable_thinking to the template.
The reply's parsed events become thinking, text and tool_use blocks, streamed as Anthropic's event
sequence (message_start, content_block_start / _delta / _stop per block, message_delta, message_stop). The
speculative metrics travel in `usage` as an extra field.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from ..engine.engine import Result
from ..engine.sampling import SamplingParams
from ..errors import UserError
from .chat import Conversation
from .openai_api import speculative_decoding
from .reply import Event, ToolCall


class TextBlock(BaseModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(BaseModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        text = self.content if not isinstance(self.content, list) else "".join(b.text for b in self.content)
        return ("Error: " if self.is_error else "") + (text or "")


class ThinkingBlock(BaseModel):  # an earlier turn's thinking, sent back by clients: not re-rendered
    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class AnthropicMessage(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
    description: str | None = None
    input_schema: dict


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(BaseModel):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None


class CountTokensRequest(BaseModel):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    def conversation(self) -> Conversation:
        messages = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            messages.append({"role": "system", "content": system})
        for message in self.messages:
            messages += _openai_messages(message)
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                   "parameters": t.input_schema}} for t in self.tools or []]
        return Conversation(messages, tools, _tool_choice(self.tool_choice, bool(tools)),
                            None if self.thinking is None else self.thinking.type == "enabled")


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None
    metadata: dict | None = None

    def sampling_params(self) -> SamplingParams:
        """Engine parameters with Anthropic's default temperature (1)."""
        return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                              max_new_tokens=self.max_tokens, stop=tuple(self.stop_sequences or ()))


def _openai_messages(message: AnthropicMessage) -> list[dict]:
    """One Anthropic turn as OpenAI messages: tool results become `tool` messages (before the turn's text),
    tool uses the assistant's `tool_calls`."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
    results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
               for b in message.content if isinstance(b, ToolResultBlock)]
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in message.content if isinstance(b, ToolUseBlock)]
    if message.role == "user":
        if calls:
            raise UserError("a user message cannot hold tool_use blocks")
        return results + ([{"role": "user", "content": text}] if text or not results else [])
    if results:
        raise UserError("an assistant message cannot hold tool_result blocks")
    if calls:
        return [{"role": "assistant", "content": text or None, "tool_calls": calls}]
    return [{"role": "assistant", "content": text}]


def _tool_choice(choice: ToolChoice | None, tools: bool) -> str | dict:
    if choice is None:
        return "auto" if tools else "none"
    if choice.type == "tool":
        if not choice.name:
            raise UserError("tool_choice of type 'tool' needs a name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


# --- the message and its events ----------------------------------------------------------------------
def stop_reason(result: Result, calls: list[ToolCall]) -> str:
    if calls:
        return "tool_use"
    if result.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if result.stop_string is not None else "end_turn"


def usage(result: Result) -> dict:
    """Anthropic's counts: input_tokens are the prompt tokens computed, cache_read_input_tokens those the prefix
    cache restored (their sum is the prompt)."""
    return {"input_tokens": result.prompt_tokens - result.cached_tokens, "output_tokens": result.generated_tokens,
            "cache_read_input_tokens": result.cached_tokens, "cache_creation_input_tokens": 0,
            "speculative_decoding": speculative_decoding(result.spec)}


class MessageReply:
    """One message: its blocks from parsed events, whole or as a stream of events."""

    def __init__(self, model: str):
        self.model = model
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.blocks: list[dict] = []  # the message's content so far
        self.open: int | None = None  # the index of the block the stream has open

    def start(self, prompt_tokens: int) -> dict:
        """message_start, sent before the prefill: the whole prompt counts as input until message_delta's
        usage splits it into computed and cached tokens."""
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
        return {"type": "message_start", "message": message}

    def events(self, events: list[Event]) -> list[dict]:
        """Stream events for parsed reply events: consecutive text (or thinking) extends the open block."""
        out: list[dict] = []
        for event in events:
            kind = {"content": "text", "reasoning": "thinking", "tool_call": "tool_use"}[event.kind]
            if kind == "tool_use" or self.open is None or self.blocks[self.open]["type"] != kind:
                out += self._close()
                out.append(self._start_block(kind, event.call))
            if kind == "tool_use":
                out.append(self._delta({"type": "input_json_delta", "partial_json": json.dumps(event.call.arguments)}))
                self.blocks[self.open]["input"] = event.call.arguments
                out += self._close()
            else:
                field = "text" if kind == "text" else "thinking"
                self.blocks[self.open][field] += event.text
                out.append(self._delta({"type": f"{field}_delta", field: event.text}))
        return out

    def end(self, result: Result, calls: list[ToolCall]) -> list[dict]:
        return self._close() + [{"type": "message_delta", "usage": usage(result),
                                 "delta": {"stop_reason": stop_reason(result, calls),
                                           "stop_sequence": result.stop_string}},
                                {"type": "message_stop"}]

    def message(self, result: Result, events: list[Event], calls: list[ToolCall]) -> dict:
        """The whole message of a finished generation."""
        self.events(events)
        self._close()
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.blocks, "stop_reason": stop_reason(result, calls),
                "stop_sequence": result.stop_string, "usage": usage(result)}

    def _start_block(self, kind: str, call: ToolCall | None) -> dict:
        block = {"text": {"type": "text", "text": ""}, "thinking": {"type": "thinking", "thinking": "", "signature": ""},
                 "tool_use": {"type": "tool_use", "id": f"toolu_{call.id}" if call else "", "name": call.name if call else "",
                              "input": {}}}[kind]
        self.blocks.append(block)
        self.open = len(self.blocks) - 1
        return {"type": "content_block_start", "index": self.open, "content_block": dict(block)}

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.open, "delta": delta}

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        index, self.open = self.open, None
        return [{"type": "content_block_stop", "index": index}]


def error_body(status: int, message: str) -> dict:
    kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
            499: "invalid_request_error", 503: "overloaded_error", 529: "overloaded_error"}.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
