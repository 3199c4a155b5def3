"""A reply split into reasoning, content and tool calls (server/reply.py), whole and streamed in pieces, and a
conversation with tools rendered through a chat template (server/chat.py)."""

import pytest
from helpers import tiny_tokenizer

from deepflash.errors import UserError
from deepflash.server.chat import Conversation, render
from deepflash.server.reply import ReplyParser

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                          "required": ["city"]}}
TOOLS = {"get_weather": WEATHER}


def parse(text: str, pieces: int | None = None, **kwargs) -> list[tuple]:
    """(kind, text or (name, arguments)) runs of the events, the text fed whole or in pieces of that size."""
    parser = ReplyParser(**kwargs)
    step = pieces or max(len(text), 1)
    events = [e for i in range(0, len(text), step) for e in parser.feed(text[i : i + step])] + parser.finish()
    runs: list[tuple] = []
    for e in events:
        if e.kind != "tool_call" and runs and runs[-1][0] == e.kind:
            runs[-1] = (e.kind, runs[-1][1] + e.text)
        else:
            runs.append((e.kind, (e.call.name, e.call.arguments) if e.kind == "tool_call" else e.text))
    return runs


CASES = [
    ("hermes", 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
     dict(tools=TOOLS), [("content", "Checking."), ("tool_call", ("get_weather", {"city": "Paris", "days": 2}))]),
    ("two calls", '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>\n'
     '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"B\\"}"}</tool_call>', dict(tools=TOOLS),
     [("tool_call", ("get_weather", {"city": "A"})), ("content", "\n"), ("tool_call", ("get_weather", {"city": "B"}))]),
    ("qwen3-coder xml", '<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n'
     '<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>', dict(tools=TOOLS),
     [("tool_call", ("get_weather", {"city": "New York", "days": 3}))]),
    ("llama json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', dict(tools=TOOLS),
     [("tool_call", ("get_weather", {"city": "Oslo"}))]),
    ("malformed json", '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call> sorry',
     dict(tools=TOOLS), [("content", '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call> sorry')]),
    ("unterminated", '<tool_call>{"name": "get_weather", "arg', dict(tools=TOOLS),
     [("content", '<tool_call>{"name": "get_weather", "arg')]),
    ("unknown tool", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', dict(tools=TOOLS),
     [("content", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>')]),
    ("json without tools", '{"name": "get_weather", "parameters": {}}', {},
     [("content", '{"name": "get_weather", "parameters": {}}')]),
    ("calls not parsed without tools", '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', {},
     [("content", '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>')]),
    ("reasoning", "<think>\nThe user greets.\n</think>\n\nHello!", {},
     [("reasoning", "The user greets.\n"), ("content", "Hello!")]),
    ("reasoning opened by the prompt", "Short.\n</think>\nAnswer <think> stays", dict(thinking=True),
     [("reasoning", "Short.\n"), ("content", "Answer <think> stays")]),
    ("reasoning then a call", '<think>need weather</think><tool_call>{"name": "get_weather", "arguments": '
     '{"city": "Rome"}}</tool_call>', dict(tools=TOOLS),
     [("reasoning", "need weather"), ("tool_call", ("get_weather", {"city": "Rome"}))]),
    ("tag look-alikes", "a < b and <tool_calls> or <thinking", dict(tools=TOOLS),
     [("content", "a < b and <tool_calls> or <thinking")]),
]


@pytest.mark.parametrize("name, text, kwargs, want", CASES, ids=[c[0] for c in CASES])
def test_replies_parse_alike_whole_and_in_any_pieces(name, text, kwargs, want):
    assert parse(text, **kwargs) == want
    for size in (1, 2, 3, 5, 11):
        assert parse(text, size, **kwargs) == want, size


def test_a_streamed_call_is_reported_once_its_block_closes():
    parser = ReplyParser(TOOLS)
    assert [e.text for e in parser.feed("Hi <tool")] == ["Hi "]  # "<tool" may open a call: held back
    assert parser.feed('_call>{"name": "get_weather", "arguments": {"city": "X"}}') == []
    (event,) = parser.feed("</tool_call>")
    assert event.kind == "tool_call" and event.call.arguments == {"city": "X"} and parser.calls == [event.call]


QWEN_LIKE = ("{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}{% for m in messages %}"
             "<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}"
             "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}</{{ m.role }}>{% endfor %}<assistant>"
             "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>{% endif %}")
HISTORY = [{"role": "user", "content": "w5"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


def test_a_template_that_knows_tools_renders_them_itself():
    tok = tiny_tokenizer()
    tok.hf.chat_template = QWEN_LIKE
    rendered = render(tok, Conversation(HISTORY, [{"type": "function", "function": WEATHER}]))
    text = rendered.prompt
    assert "<tools>" in text and '{"city": "Paris"}' in text and "<tool>sunny</tool>" in text
    assert rendered.thinking and rendered.forced == "" and rendered.tools == TOOLS
    quiet = render(tok, Conversation(HISTORY[:1], [{"type": "function", "function": WEATHER}], enable_thinking=False))
    assert not quiet.thinking


def test_a_template_without_tools_gets_them_in_the_hermes_form():
    """The tiny tokenizer's template knows only message contents: the tools go into a system turn, the
    call into the assistant's content as a <tool_call> block, the result into a user turn."""
    tok = tiny_tokenizer()
    rendered = render(tok, Conversation(HISTORY, [{"type": "function", "function": WEATHER}]))
    text = rendered.prompt
    assert text.index("<tools>") < text.index("w5") < text.index('<tool_call>\n{"name": "get_weather", '
                                                                 '"arguments": {"city": "Paris"}}\n</tool_call>')
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert not rendered.thinking and rendered.tools == TOOLS
    none = render(tok, Conversation(HISTORY, [{"type": "function", "function": WEATHER}], tool_choice="none"))
    assert none.tools is None and "<tools>" not in none.prompt


@pytest.mark.parametrize("choice, forced", [
    ("required", '<tool_call>\n{"name": "'),
    ({"type": "function", "function": {"name": "get_weather"}}, '<tool_call>\n{"name": "get_weather", "arguments": '),
])
def test_a_required_or_named_call_starts_the_reply(choice, forced):
    tok = tiny_tokenizer()
    rendered = render(tok, Conversation(HISTORY[:1], [{"type": "function", "function": WEATHER}], choice))
    assert rendered.forced == forced
    parser = ReplyParser(rendered.tools)
    reply = forced + ('get_weather", "arguments": {"city": "Lima"}}' if choice == "required" else '{"city": "Lima"}}')
    events = parser.feed(reply + "\n</tool_call>") + parser.finish()
    assert [(e.call.name, e.call.arguments) for e in events if e.kind == "tool_call"] == \
        [("get_weather", {"city": "Lima"})]


@pytest.mark.parametrize("conversation, message", [
    (Conversation(HISTORY[:1], [], "required"), "needs at least one tool"),
    (Conversation(HISTORY[:1], [{"type": "function", "function": WEATHER}],
                  {"type": "function", "function": {"name": "nope"}}), "not among the request's tools"),
    (Conversation([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]), "arguments are not JSON"),
])
def test_conversations_that_cannot_render_are_user_errors(conversation, message):
    with pytest.raises(UserError, match=message):
        render(tiny_tokenizer(), conversation)


def test_hermes_calls_in_history_round_trip_through_the_parser():
    """What the fallback writes into an assistant turn is what the parser reads back."""
    rendered = render(tiny_tokenizer(), Conversation(HISTORY[:2], [{"type": "function", "function": WEATHER}]))
    start = rendered.prompt.rindex("<tool_call>")  # the history's call, after the system turn's instructions
    block = rendered.prompt[start : rendered.prompt.rindex("</tool_call>") + len("</tool_call>")]
    assert parse(block, tools=TOOLS) == [("tool_call", ("get_weather", {"city": "Paris"}))]
