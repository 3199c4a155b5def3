"""A conversation with tools, rendered through the model's chat template into the prompt's ids.

Messages arrive in OpenAI's form (the Anthropic endpoint converts to it): system, user and assistant turns,
assistant turns that called tools (`tool_calls`), and tool results (role `tool`). A template that knows
tools (Qwen's, Llama 3.1's, ...) renders them itself; one that does not (SmolLM2's) gets them in the
Hermes form the reply parser reads: the tools' JSON schemas in the system turn, calls as `<tool_call>`
blocks, results as `<tool_response>` blocks in a user turn. `tool_choice` "required" or a named function
starts the reply with the opening of a call in the template's form (the prompt ends with it), so the model
writes a call; "none" renders no tools and parses none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..errors import UserError
from ..loading.tokenizer import Tokenizer

HERMES_SYSTEM = (
    "You may call one or more functions to assist with the user query. The functions are described by "
    "these JSON schemas:\n<tools>\n{tools}\n</tools>\nTo call a function, reply with a JSON object holding its "
    "name and arguments inside <tool_call></tool_call> tags, one block per call:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


@dataclass
class Conversation:
    messages: list[dict]  # OpenAI chat messages: content a string (or None beside tool_calls)
    tools: list[dict] = field(default_factory=list)  # OpenAI tools: {"type": "function", "function": {...}}
    tool_choice: str | dict = "auto"  # "auto", "none", "required" or {"type": "function", "function": {"name"}}
    enable_thinking: bool | None = None  # passed to templates that take it


@dataclass(frozen=True)
class Rendered:
    ids: list[int]
    prompt: str  # the text the ids encode
    forced: str  # the start of the reply the prompt already holds (a forced call's opening)
    thinking: bool  # the reply starts inside a thinking block the prompt opened
    tools: dict[str, dict] | None  # the tools whose calls the reply may hold, by name; None: parse none


def render(tokenizer: Tokenizer, conversation: Conversation) -> Rendered:
    functions = {t["function"]["name"]: t["function"] for t in conversation.tools}
    choice = conversation.tool_choice
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if named is not None and named not in functions:
        raise UserError(f"tool_choice names {named!r}, which is not among the request's tools")
    if choice == "required" and not functions:
        raise UserError("tool_choice 'required' needs at least one tool")
    offered = functions if choice != "none" else {}
    template = tokenizer.hf.chat_template or ""
    native = "tools" in template
    messages = [_native(m) if native else _hermes(m) for m in conversation.messages]
    kwargs = {} if conversation.enable_thinking is None else {"enable_thinking": conversation.enable_thinking}
    if offered and native:
        kwargs["tools"] = [{"type": "function", "function": f} for f in offered.values()]
    elif offered:
        messages = _with_tools_in_system(messages, list(offered.values()))
    text = tokenizer.template_text(messages, **kwargs)
    forced = _forced_call(_form(template if native else ""), named) if (named or choice == "required") else ""
    thinking = text.rfind("<think>") > text.rfind("</think>")
    return Rendered(tokenizer.encode_text(text + forced), text + forced, forced, thinking, offered or None)


def _form(template: str) -> str:
    """The tool-call form a template teaches: "xml" (Qwen3-Coder), "llama" (Llama 3) or "hermes"."""
    if "<function=" in template:
        return "xml"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama"
    return "hermes"


def _forced_call(form: str, name: str | None) -> str:
    """The opening of a call that the reply must continue: of the named function where one is named."""
    if form == "xml":
        return "<tool_call>\n" + (f"<function={name}>\n" if name else "<function=")
    if form == "llama":
        return '{"name": ' + (f'"{name}", "parameters": ' if name else '"')
    return "<tool_call>\n" + ('{"name": ' + json.dumps(name) + ', "arguments": ' if name else '{"name": "')


def _arguments(call: dict) -> dict:
    """An OpenAI tool call's arguments (a JSON string on the wire) as an object, as templates expect."""
    arguments = call["function"].get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            raise UserError(f"tool call {call['function'].get('name')!r}: arguments are not JSON") from None
    return arguments


def _native(message: dict) -> dict:
    """A message for a template that renders tools: calls' arguments as objects, no null content."""
    out = {k: v for k, v in message.items() if v is not None}
    out["content"] = message.get("content") or ""
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["function"]["name"], "arguments": _arguments(c)}}
                             for c in message["tool_calls"]]
    return out


def _hermes(message: dict) -> dict:
    """A message for a template that knows only system, user and assistant turns."""
    content = message.get("content") or ""
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = "".join("\n<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": _arguments(c)})
                    + "\n</tool_call>" for c in message.get("tool_calls") or [])
    return {"role": message["role"], "content": (content + calls).strip("\n") if calls else content}


def _with_tools_in_system(messages: list[dict], functions: list[dict]) -> list[dict]:
    tools = "\n".join(json.dumps({"type": "function", "function": f}) for f in functions)
    note = HERMES_SYSTEM.format(tools=tools)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + note}] + messages[1:]
    return [{"role": "system", "content": note}] + messages
