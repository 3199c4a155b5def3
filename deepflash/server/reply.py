"""A model's reply split into reasoning, content and tool calls, as the text streams in.

Reasoning is the text between `<think>` and `</think>` (Qwen3's and DeepSeek's form; a reply that starts
inside a thinking block the prompt opened has no opening tag). Tool calls come in three forms:
- Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call;
- Qwen3-Coder: `<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>`, the
  values typed by the tool's JSON schema;
- Llama 3: the whole reply one JSON object `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`.
A block that does not parse as a call is returned as text: the model's output is never lost, and never a
server error. The parser holds back a tail that may be the start of a tag until the next text decides it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

THINK, END_THINK = "<think>", "</think>"
CALL, END_CALL = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])


@dataclass(frozen=True)
class Event:
    kind: str  # "reasoning" | "content" | "tool_call"
    text: str = ""
    call: ToolCall | None = None


class ReplyParser:
    """Feed text deltas, get events; `finish()` flushes what is held back. `tools`: the request's tool
    specs (OpenAI's `function` objects by name), None when calls are not to be parsed; `thinking`: the
    reply starts inside a thinking block."""

    def __init__(self, tools: dict[str, dict] | None = None, thinking: bool = False):
        self.tools = tools
        self.state = "reasoning start" if thinking else "start"
        self.pending = ""
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        events: list[Event] = []
        while self._step(events, final=False):
            pass
        return [e for e in events if e.kind == "tool_call" or e.text]

    def finish(self) -> list[Event]:
        events: list[Event] = []
        while self._step(events, final=True):
            pass
        if self.pending:
            if self.state == "json":
                events += self._whole_json(self.pending)
            else:
                events.append(Event("reasoning" if self.state.startswith("reasoning") else "content", self.pending))
            self.pending = ""
        return [e for e in events if e.kind == "tool_call" or e.text]

    def _step(self, events: list[Event], final: bool) -> bool:
        """Consume what can be decided; True when the state changed and another step may decide more."""
        if self.state == "start":
            return self._start(final)
        if self.state in ("reasoning start", "content start"):  # the newlines that follow a thinking tag
            self.pending = self.pending.lstrip("\n")
            if not self.pending and not final:
                return False
            self.state = self.state.removesuffix(" start")
            return True
        if self.state == "reasoning":
            return self._until(END_THINK, "reasoning", "content start", events, final)
        if self.state == "call":
            return self._call(events, final)
        if self.state == "json":
            return False  # a whole-reply JSON call is decided at the end
        return self._content(events, final)

    def _start(self, final: bool) -> bool:
        """The reply's opening: a thinking block, a Llama JSON call, or content."""
        head = self.pending.lstrip()
        if not head and not final:
            return False
        if head.startswith(THINK):
            self.pending = head[len(THINK) :]
            self.state = "reasoning start"
            return True
        if self.tools is not None and (head.startswith("{") or head.startswith(PYTHON_TAG)):
            self.state = "json"
            return True
        if not final and (THINK.startswith(head) or (self.tools is not None and PYTHON_TAG.startswith(head))):
            return False  # may still become a tag
        self.state = "content"
        return True

    def _content(self, events: list[Event], final: bool) -> bool:
        if self.tools is None:
            events.append(Event("content", self.pending))
            self.pending = ""
            return False
        return self._until(CALL, "content", "call", events, final)

    def _until(self, tag: str, kind: str, after: str, events: list[Event], final: bool) -> bool:
        """Emit `kind` text up to `tag`, then switch to `after`; hold back a tail that may start the tag."""
        at = self.pending.find(tag)
        if at >= 0:
            events.append(Event(kind, self.pending[:at]))
            self.pending = self.pending[at + len(tag) :]
            self.state = after
            return True
        keep = 0 if final else _partial_tag(self.pending, tag)
        events.append(Event(kind, self.pending[: len(self.pending) - keep]))
        self.pending = self.pending[len(self.pending) - keep :]
        return False

    def _call(self, events: list[Event], final: bool) -> bool:
        at = self.pending.find(END_CALL)
        if at < 0 and not final:
            return False
        body = self.pending[:at] if at >= 0 else self.pending
        self.pending = self.pending[at + len(END_CALL) :] if at >= 0 else ""
        call = self._parse_block(body)
        if call is None:
            raw = CALL + body + (END_CALL if at >= 0 else "")
            events.append(Event("content", raw))
        else:
            self.calls.append(call)
            events.append(Event("tool_call", call=call))
        self.state = "content"
        return bool(self.pending)

    def _parse_block(self, body: str) -> ToolCall | None:
        """A <tool_call> block's call: JSON (Hermes) or <function=...> (Qwen3-Coder); None if neither."""
        body = body.strip()
        function = _FUNCTION.fullmatch(body)
        if function:
            name = function.group(1)
            values = {p: _typed(v.strip("\n"), self._schema(name, p)) for p, v in _PARAMETER.findall(function.group(2))}
            return self._known(name, values)
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        return self._call_object(obj)

    def _whole_json(self, text: str) -> list[Event]:
        """A reply that is one JSON call (Llama 3), else its text as content."""
        body = text.strip().removeprefix(PYTHON_TAG)
        try:
            call = self._call_object(json.loads(body))
        except json.JSONDecodeError:
            call = None
        if call is None:
            return [Event("content", text)]
        self.calls.append(call)
        return [Event("tool_call", call=call)]

    def _call_object(self, obj) -> ToolCall | None:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        return self._known(obj["name"], arguments) if isinstance(arguments, dict) else None

    def _known(self, name: str, arguments: dict) -> ToolCall | None:
        """Only calls of the request's tools count as calls."""
        return ToolCall(name, arguments) if self.tools is not None and name in self.tools else None

    def _schema(self, name: str, parameter: str) -> dict:
        function = (self.tools or {}).get(name) or {}
        return ((function.get("parameters") or {}).get("properties") or {}).get(parameter) or {}


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest tail of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _typed(value: str, schema: dict):
    """A Qwen3-Coder parameter's text as its schema's type (strings stay text; JSON where it parses)."""
    if schema.get("type") == "string":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value
