"""What coding agents need from the server, through the official openai and anthropic clients: a tool defined,
called by the model, its result sent back, a final answer; reasoning split off; the Anthropic Messages API
and its event stream; log-probabilities, penalties and n choices; and fuzzed bodies never a server error.

Where the reply's text matters (a tool call in a given form) a scripted engine replies; elsewhere the tiny
random model does."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from helpers import byte_tokenizer, drafter_config, tiny_drafter, tiny_target, tiny_tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import Probe, metric, post_in_thread, serving, wait_for

from deepflash.engine.config import EngineConfig
from deepflash.engine.engine import Chunk, Engine, Result
from deepflash.engine.sampling import SamplingParams

MODEL = "tiny"
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class ScriptedEngine:
    """Stands in for the Engine: each generation streams the next scripted reply, five characters a chunk,
    and keeps its prompt as text (the byte tokenizer round-trips it)."""

    block_size, max_ctx, drafter, prefix = 4, 4096, None, None

    def __init__(self, replies: list[str], default: str = "Fine."):
        self.tokenizer = byte_tokenizer()
        self.replies, self.default = list(replies), default
        self.prompts: list[str] = []
        self.params: list[SamplingParams] = []

    def generate(self, prompt_ids, params, cancelled=None):
        text = self.replies.pop(0) if self.replies else self.default
        self.prompts.append(self.tokenizer.hf.decode(prompt_ids))
        self.params.append(params)
        pieces = [text[i : i + 5] for i in range(0, len(text), 5)] or [""]
        for piece in pieces:
            yield Chunk(piece, [7])
        reason = "length" if len(pieces) >= params.max_new_tokens else "stop"
        yield Chunk("", [], Result(text, [7] * len(pieces), len(prompt_ids), reason, 0.01, 0.01, params.seed))


def scripted(*replies: str):
    engine = ScriptedEngine(list(replies))
    return engine, serving(engine, tokenizer=engine.tokenizer)


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def anthropic_client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)


# --- OpenAI: tools and reasoning ---------------------------------------------------------------------
def test_openai_client_completes_a_tool_using_exchange():
    engine, server = scripted(CALL, "<think>The tool says sunny.</think>\n\nIt is sunny in Paris.")
    tools = [{"type": "function", "function": WEATHER}]
    with server as url:
        client = openai_client(url)
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        first = client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
        second = client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
    answer = second.choices[0]
    assert answer.finish_reason == "stop" and answer.message.content == "It is sunny in Paris."
    assert answer.message.model_extra["reasoning_content"] == "The tool says sunny."
    prompt = engine.prompts[1]
    assert '"name": "get_weather"' in prompt.split("<|user|>")[0]  # the tools' schemas in the system turn
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt


def test_openai_stream_carries_reasoning_content_and_tool_calls():
    engine, server = scripted("<think>Look it up.</think>" + CALL)
    with server as url:
        stream = openai_client(url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
            tools=[{"type": "function", "function": WEATHER}], stream=True)
        chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "Look it up."
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert not "".join(d.content or "" for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and chunks[-1].usage.completion_tokens > 0


def test_a_malformed_call_comes_back_as_text_with_stop():
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    engine, server = scripted(broken, broken)
    with server as url:
        client = openai_client(url)
        body = dict(model=MODEL, messages=[{"role": "user", "content": "x"}], tools=[{"type": "function", "function": WEATHER}])
        out = client.chat.completions.create(**body)
        streamed = list(client.chat.completions.create(**body, stream=True))
    assert out.choices[0].finish_reason == "stop" and out.choices[0].message.content == broken
    assert out.choices[0].message.tool_calls is None
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == broken
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_a_named_tool_choice_forces_the_call():
    """tool_choice naming a function starts the reply with that call's opening; the model writes the rest."""
    engine, server = scripted('{"city": "Lima"}}\n</tool_call>')
    with server as url:
        out = openai_client(url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], tools=[{"type": "function", "function": WEATHER}],
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = out.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Lima"}
    assert engine.prompts[0].endswith('<|assistant|><tool_call>\n{"name": "get_weather", "arguments": ')


def test_the_random_model_with_tools_answers_without_a_server_error():
    """On the tiny random model the content does not matter: a forced call it cannot finish is text."""
    target = tiny_target()
    engine = Engine(target, tiny_tokenizer(), tiny_drafter(drafter_config(target.cfg)), config=EngineConfig(spec="on"))
    with serving(engine) as url:
        client = openai_client(url)
        for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
            out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5 w6"}],
                                                 tools=[{"type": "function", "function": WEATHER}], tool_choice=choice,
                                                 max_tokens=12, temperature=0)
            assert out.choices[0].finish_reason in ("stop", "length") and out.choices[0].message.tool_calls is None


# --- OpenAI: log-probabilities, penalties, n ------------------------------------------------------------
def test_logprobs_and_penalties_through_the_server_equal_plain_decoding():
    target, tokenizer = tiny_target(), tiny_tokenizer()
    engine = Engine(target, tokenizer, tiny_drafter(drafter_config(target.cfg)), config=EngineConfig(spec="on"))
    body = dict(model=MODEL, messages=[{"role": "user", "content": "w5 w6 w7"}], temperature=0, max_tokens=15,
                logprobs=True, top_logprobs=2, presence_penalty=1.2, frequency_penalty=0.4,
                extra_body={"repetition_penalty": 1.3})
    with serving(engine) as url:
        out = openai_client(url).chat.completions.create(**body)
    params = SamplingParams(max_new_tokens=15, logprobs=2, presence_penalty=1.2, frequency_penalty=0.4,
                            repetition_penalty=1.3)
    plain = Engine(target, tokenizer).complete(tokenizer.chat([{"role": "user", "content": "w5 w6 w7"}]), params)
    assert out.choices[0].message.content == plain.text
    entries = out.choices[0].logprobs.content
    assert [e.logprob for e in entries] == pytest.approx([lp.logprob for lp in plain.logprobs], abs=1e-6)
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in entries)


def test_text_completions_report_logprobs():
    engine = Engine(tiny_target(), tiny_tokenizer())
    with serving(engine) as url:
        out = openai_client(url).completions.create(model=MODEL, prompt="w5 w6", max_tokens=6, temperature=0, logprobs=3)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == out.usage.completion_tokens
    assert all(len(top) <= 3 for top in logprobs.top_logprobs)


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_run_one_after_another_with_their_own_seeds(stream):
    engine, server = scripted("one", "two", "three")
    with server as url:
        client = openai_client(url)
        body = dict(model=MODEL, messages=[{"role": "user", "content": "x"}], n=3, seed=5, temperature=0.8)
        if stream:
            chunks = list(client.chat.completions.create(**body, stream=True))
            texts = {}
            for c in chunks:
                for choice in c.choices:
                    texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            usage = chunks[-1].usage
        else:
            out = client.chat.completions.create(**body)
            texts = {c.index: c.message.content for c in out.choices}
            usage = out.usage
    assert texts == {0: "one", 1: "two", 2: "three"}
    assert [p.seed for p in engine.params] == [5, 6, 7] and usage.completion_tokens == 3


# --- Anthropic ----------------------------------------------------------------------------------------
ANTHROPIC_TOOL = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER["parameters"]}


def test_anthropic_client_completes_a_tool_using_exchange():
    engine, server = scripted("<think>Need the tool.</think>" + CALL, "It is sunny.")
    with server as url:
        client = anthropic_client(url)
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        first = client.messages.create(model="claude-any", max_tokens=200, tools=[ANTHROPIC_TOOL],
                                       messages=messages, system="Be brief.", thinking={"type": "enabled",
                                                                                        "budget_tokens": 1024})
        assert first.stop_reason == "tool_use" and first.model == MODEL
        kinds = [b.type for b in first.content]
        assert kinds == ["thinking", "tool_use"] and first.content[0].thinking == "Need the tool."
        use = first.content[1]
        assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id.startswith("toolu_")
        messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": "sunny, 21 C"}]}]
        second = client.messages.create(model="claude-any", max_tokens=200, tools=[ANTHROPIC_TOOL], messages=messages)
    assert second.stop_reason == "end_turn" and [b.text for b in second.content] == ["It is sunny."]
    assert second.usage.output_tokens > 0 and "speculative_decoding" in second.usage.model_extra
    assert engine.prompts[0].startswith("<|system|>Be brief.")
    prompt = engine.prompts[1]
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt


def test_anthropic_stream_follows_the_documented_event_order():
    engine, server = scripted("<think>Hmm.</think>Let me check." + CALL)
    with server as url:
        with anthropic_client(url).messages.stream(model="m", max_tokens=100, tools=[ANTHROPIC_TOOL],
                                                   messages=[{"role": "user", "content": "Weather?"}]) as stream:
            events = [e.type for e in stream if e.type in ("message_start", "content_block_start", "content_block_delta",
                                                           "content_block_stop", "message_delta", "message_stop")]
            final = stream.get_final_message()
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    blocks, open_block = [], False
    for kind in events[1:-2]:  # every block: start, deltas, stop
        if kind == "content_block_start":
            assert not open_block
            open_block = True
            blocks.append(kind)
        elif kind == "content_block_stop":
            assert open_block
            open_block = False
        else:
            assert open_block and kind == "content_block_delta"
    assert len(blocks) == 3 and not open_block
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[1].text == "Let me check." and final.content[2].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"


def test_anthropic_stop_sequences_and_max_tokens():
    real = Engine(tiny_target(), tiny_tokenizer())
    with serving(real) as url:
        client = anthropic_client(url)
        full = client.messages.create(model="m", max_tokens=10, messages=[{"role": "user", "content": "w5 w6"}],
                                      extra_body={"temperature": 0})
        assert full.stop_reason == "max_tokens" and full.usage.output_tokens == 10
        words = full.content[0].text.split()
        cut = client.messages.create(model="m", max_tokens=10, messages=[{"role": "user", "content": "w5 w6"}],
                                     extra_body={"temperature": 0}, stop_sequences=[words[2]])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == words[2]


def test_anthropic_count_tokens_counts_the_rendered_prompt():
    engine, server = scripted()
    with server as url:
        client = anthropic_client(url)
        counted = client.messages.count_tokens(model="m", messages=[{"role": "user", "content": "Hi"}],
                                               tools=[ANTHROPIC_TOOL])
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "Hi"}],
                               tools=[ANTHROPIC_TOOL])
    assert counted.input_tokens == len(engine.prompts[0].encode())  # one id per byte


@pytest.mark.parametrize("body, status, kind, message", [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error",
     "greater than or equal to 1"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, 400, "invalid_request_error", "tool_use"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tool_choice": {"type": "tool", "name": "nope"}, "tools": [ANTHROPIC_TOOL]}, 400, "invalid_request_error",
     "not among the request's tools"),
    ({"model": "m", "max_tokens": 5, "temperature": -1, "messages": [{"role": "user", "content": "x"}]}, 400,
     "invalid_request_error", "temperature"),
])
def test_anthropic_errors_have_anthropic_bodies(body, status, kind, message):
    engine, server = scripted()
    with server as url:
        response = httpx.post(f"{url}/v1/messages", json=body)
        missing = httpx.post(f"{url}/v1/messages/nothing", json={})
        bad_json = httpx.post(f"{url}/v1/messages", content=b"{", headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and message in error["error"]["message"]
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"


def test_anthropic_overload_and_a_client_that_leaves():
    """A full queue is 503 with an overloaded_error body and Retry-After; a client that leaves cancels its
    generation (499 in /metrics)."""
    engine = ScriptedEngine([], default="long " * 100)
    probe = Probe(engine)
    probe.gate.clear()  # the first generation holds the worker until the gate opens
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    with serving(engine, tokenizer=engine.tokenizer, queue_size=1) as url:
        results: dict = {}
        threads = [post_in_thread(url, body, results, "running", path="/v1/messages")]
        wait_for(lambda: metric(url, "deepflash_running_requests") == 1)
        threads.append(post_in_thread(url, body, results, "queued", path="/v1/messages"))
        wait_for(lambda: metric(url, "deepflash_queue_depth") == 1)
        refused = httpx.post(f"{url}/v1/messages", json=body)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["type"] == "overloaded_error"
        probe.gate.set()
        for thread in threads:
            thread.join()
        assert results["running"].status_code == results["queued"].status_code == 200
        probe.step_delay = 0.05
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/messages", json=body | {"max_tokens": 400}, timeout=0.2)
        wait_for(lambda: metric(url, 'deepflash_requests_total{endpoint="/v1/messages",status="499"}') == 1)


# --- fuzzing -------------------------------------------------------------------------------------------
JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=12), lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "x"]),
                                 "content": st.one_of(st.text(max_size=20), JSON)},
                                optional={"tool_calls": JSON, "tool_call_id": JSON})
FIELDS = {"model": st.one_of(st.just(MODEL), JSON), "messages": st.one_of(st.lists(MESSAGE, max_size=3), JSON),
          "prompt": st.one_of(st.text(max_size=20), JSON), "max_tokens": st.one_of(st.integers(-3, 8), JSON),
          "temperature": st.one_of(st.floats(-1, 3), JSON), "top_p": JSON, "top_k": JSON, "n": st.integers(-1, 4),
          "stop": JSON, "stream": st.booleans(), "tools": JSON, "tool_choice": JSON, "logprobs": JSON,
          "top_logprobs": JSON, "presence_penalty": JSON, "seed": JSON, "system": JSON, "stop_sequences": JSON,
          "thinking": JSON}
BODY = st.fixed_dictionaries({}, optional=FIELDS)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens"]),
       body=BODY)
def test_fuzzed_bodies_never_get_a_server_error(fuzz_server, path, body):
    response = httpx.post(f"{fuzz_server}{path}", json=body, timeout=10)
    assert response.status_code < 500, (path, body, response.text)


@pytest.fixture(scope="module")
def fuzz_server():
    engine = ScriptedEngine([], default="<think>a</think>" + CALL)
    with serving(engine, tokenizer=engine.tokenizer) as url:
        yield url


NAME = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True)
FUNCTION = st.fixed_dictionaries({"name": NAME}, optional={"description": st.text(max_size=10), "parameters": JSON})
OPENAI_CHAT = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]),
                                                 "content": st.text(max_size=20)},
                                                optional={"tool_call_id": st.text(max_size=5)}), min_size=1, max_size=4)},
    optional={"tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": FUNCTION}), max_size=2),
              "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]),
                                       st.fixed_dictionaries({"type": st.just("function"),
                                                              "function": st.fixed_dictionaries({"name": NAME})})),
              "logprobs": st.booleans(), "top_logprobs": st.integers(-1, 25), "n": st.integers(0, 3),
              "max_tokens": st.integers(0, 6), "stream": st.booleans(), "temperature": st.floats(-0.5, 2),
              "presence_penalty": st.floats(-3, 3), "repetition_penalty": st.floats(-1, 3), "seed": st.integers(-2, 9),
              "stop": st.lists(st.text(max_size=3), max_size=2),
              "chat_template_kwargs": st.fixed_dictionaries({}, optional={"enable_thinking": JSON})})
ANTHROPIC_BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.text(max_size=5), "name": NAME, "input": JSON}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.text(max_size=5),
                           "content": st.text(max_size=10)}))
ANTHROPIC = st.fixed_dictionaries(
    {"model": st.text(max_size=8), "max_tokens": st.integers(0, 6),
     "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                                 "content": st.one_of(st.text(max_size=10),
                                                                      st.lists(ANTHROPIC_BLOCK, max_size=3))}),
                          min_size=1, max_size=3)},
    optional={"system": st.text(max_size=10), "stream": st.booleans(), "stop_sequences": st.lists(st.text(max_size=3)),
              "tools": st.lists(st.fixed_dictionaries({"name": NAME, "input_schema": JSON}), max_size=2),
              "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none"])},
                                                   optional={"name": NAME}),
              "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled"])}),
              "temperature": st.floats(-0.5, 2), "top_k": st.integers(-1, 5)})


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(openai_body=OPENAI_CHAT, anthropic_body=ANTHROPIC)
def test_fuzzed_well_formed_bodies_never_get_a_server_error(fuzz_server, openai_body, anthropic_body):
    """Bodies of the right shape with any values: past validation, into rendering, the engine and the parser."""
    for path, body in [("/v1/chat/completions", openai_body), ("/v1/messages", anthropic_body),
                       ("/v1/messages/count_tokens", anthropic_body)]:
        response = httpx.post(f"{fuzz_server}{path}", json=body, timeout=10)
        assert response.status_code < 500, (path, body, response.text)
        if body.get("stream") and response.status_code == 200:
            assert "internal server error" not in response.text, (path, body, response.text)
