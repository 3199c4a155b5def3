"""The OpenAI-compatible server, end to end over loopback HTTP: the official openai client, raw httpx
requests for the failure cases, a one-at-a-time FIFO worker, and cancellation on disconnect."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from helpers import drafter_config, tiny_drafter, tiny_target, tiny_tokenizer

from deepflash.cli import build_parser
from deepflash.engine.config import EngineConfig
from deepflash.engine.engine import Engine, Result
from deepflash.engine.sampling import SamplingParams
from deepflash.server.app import create_app

TOKENIZER = tiny_tokenizer()
TARGET = tiny_target()
DRAFTER = tiny_drafter(drafter_config(TARGET.cfg))
MODEL = "tiny"


def spec_engine() -> Engine:
    return Engine(TARGET, TOKENIZER, DRAFTER, config=EngineConfig(spec="on"))


def reference(prompt: str, **params) -> Result:
    """What the engine itself answers to a one-message chat (on an engine of its own)."""
    ids = TOKENIZER.chat([{"role": "user", "content": prompt}])
    return spec_engine().complete(ids, SamplingParams(**params))


class Probe:
    """Wraps engine.generate: records the order generations start in and how far each got; can hold
    generations at a gate, slow their steps, or fail after the first chunk of a chosen prompt."""

    def __init__(self, engine: Engine):
        self._generate = engine.generate
        engine.generate = self.generate
        self.gate = threading.Event()
        self.gate.set()
        self.step_delay = 0.0
        self.fail_on: list[int] | None = None
        self.started: list[list[int]] = []
        self.runs: list[tuple[int, bool]] = []  # (chunks yielded, ran to the end) per finished generation

    def generate(self, prompt_ids, params, cancelled=None):
        self.started.append(prompt_ids)
        self.gate.wait()
        yielded, completed = 0, False
        try:
            for chunk in self._generate(prompt_ids, params, cancelled):
                if yielded == 1 and prompt_ids == self.fail_on:
                    raise RuntimeError("injected failure")
                time.sleep(self.step_delay)
                yielded += 1
                yield chunk
            completed = True
        finally:
            self.runs.append((yielded, completed))


@contextlib.contextmanager
def serving(engine: Engine, tokenizer=TOKENIZER, **app_args):
    """Run the app on a free loopback port in a background thread; yields the base URL."""
    app = create_app(engine, tokenizer, MODEL, **app_args)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture(scope="module")
def shared():
    """One server for the tests that only send requests."""
    with serving(spec_engine()) as url:
        yield url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def chat(url: str, prompt: str, **fields):
    """A one-message chat through the openai client (greedy unless `temperature` is given)."""
    fields = {"model": MODEL, "temperature": 0} | fields
    return client(url).chat.completions.create(messages=[{"role": "user", "content": prompt}], **fields)


def chat_body(prompt: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "temperature": 0, **fields}


def check_spec_block(metrics: dict, want: Result) -> None:
    """The response's speculative block reports the engine's own statistics for the same generation."""
    spec = want.spec
    assert spec.steps > 0
    assert metrics["speculative_decoding"] == {
        "mean_acceptance_length": pytest.approx(spec.acceptance_length, abs=1e-4),
        "acceptance_histogram": spec.histogram,
        "num_spec_steps": spec.steps,
        "num_draft_tokens": spec.draft_tokens,
        "num_accepted_tokens": spec.accepted_tokens,
    }


def metric(url: str, name: str) -> float:
    """The sum of a metric's samples named exactly `name` (any labels)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# --- the openai client ------------------------------------------------------------------------------
def test_chat_completion(shared):
    messages = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w5 w6 w7"}]
    out = client(shared).chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40)
    ids = TOKENIZER.chat(messages)
    want = spec_engine().complete(ids, SamplingParams(max_new_tokens=40))
    choice = out.choices[0]
    assert choice.message.content == want.text and choice.message.role == "assistant"
    assert choice.finish_reason == want.finish_reason
    assert out.object == "chat.completion" and out.model == MODEL
    n = want.generated_tokens
    usage = out.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(ids), n, len(ids) + n)
    check_spec_block(out.model_extra["metrics"], want)


def test_chat_streaming(shared):
    chunks = list(chat(shared, "w8", model="deepflash", max_tokens=30, stream=True))
    want = reference("w8", max_new_tokens=30)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    last, n = chunks[-1], want.generated_tokens
    assert last.choices[0].finish_reason == want.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert last.usage.completion_tokens == n and last.usage.total_tokens == last.usage.prompt_tokens + n
    check_spec_block(last.model_extra["metrics"], want)
    assert all(c.usage is None for c in chunks[:-1])


def test_completions(shared):
    ids = TOKENIZER.encode("w5 w6 w7 w8")
    want = spec_engine().complete(ids, SamplingParams(max_new_tokens=20))
    out = client(shared).completions.create(model=MODEL, prompt="w5 w6 w7 w8", max_tokens=20, temperature=0)
    assert out.choices[0].text == want.text and out.object == "text_completion"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == want.generated_tokens
    check_spec_block(out.model_extra["metrics"], want)
    chunks = list(client(shared).completions.create(model=MODEL, prompt="w5 w6 w7 w8", max_tokens=20, temperature=0,
                                                    stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    assert chunks[-1].usage.completion_tokens == want.generated_tokens


def test_stop_sequences(shared):
    full = reference("w5", max_new_tokens=40).text
    words = full.split()
    for stop in (" ".join(words[5:7]), [words[20], " ".join(words[5:7])]):
        out = chat(shared, "w5", max_tokens=40, stop=stop)
        assert out.choices[0].message.content == full[: full.index(" ".join(words[5:7]))]
        assert out.choices[0].finish_reason == "stop"
        streamed = chat(shared, "w5", max_tokens=40, stop=stop, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == out.choices[0].message.content


def test_seeded_sampling_is_reproducible(shared):
    def sample(seed):
        return chat(shared, "w5 w6", temperature=1.0, top_p=0.95, seed=seed, max_tokens=25).choices[0].message.content

    want = reference("w5 w6", temperature=1.0, top_p=0.95, seed=7, max_new_tokens=25).text
    assert sample(7) == sample(7) == want
    assert sample(8) != sample(7)


def test_models_health_and_metrics(shared):
    models = client(shared).models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].model_extra["max_model_len"] == 512
    before = metric(shared, "deepflash_generated_tokens_total")
    out = httpx.post(f"{shared}/v1/chat/completions", json=chat_body("w5", max_tokens=12)).json()
    spec = out["metrics"]["speculative_decoding"]
    assert metric(shared, "deepflash_generated_tokens_total") - before == 12
    text = httpx.get(f"{shared}/metrics").text
    for name in ("deepflash_prompt_tokens_total", "deepflash_draft_tokens_total", "deepflash_accepted_tokens_total",
                 "deepflash_acceptance_length_bucket", "deepflash_step_duration_seconds_bucket",
                 "deepflash_time_to_first_token_seconds_bucket", "deepflash_request_duration_seconds_bucket",
                 "deepflash_queue_depth", "deepflash_running_requests"):
        assert name in text, name
    assert 'deepflash_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    assert metric(shared, "deepflash_acceptance_length_count") >= spec["num_spec_steps"] > 0


def test_no_drafter_reports_null_speculation():
    with serving(Engine(TARGET, TOKENIZER)) as url:
        out = httpx.post(f"{url}/v1/chat/completions", json=chat_body("w5", max_tokens=5)).json()
        assert out["metrics"] == {"speculative_decoding": None} and out["usage"]["completion_tokens"] == 5


# --- client errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("body, status, param, message", [
    (chat_body("w5", n=17), 400, "n", "less than or equal to 16"),
    (chat_body("w5", presence_penalty=3), 400, None, "presence_penalty must be in [-2, 2]"),
    (chat_body("w5", logprobs=True, top_logprobs=21), 400, "top_logprobs", "less than or equal to 20"),
    (chat_body("w5", tool_choice="required"), 400, None, "tool_choice 'required' needs at least one tool"),
    (chat_body("w5", model="gpt-4"), 404, None, "model 'gpt-4' is not served here"),
    (chat_body("w5 " * 600), 400, None, "the prompt has"),
    (chat_body("w5", temperature=-1), 400, None, "temperature must be"),
    (chat_body("w5", top_p=0), 400, None, "top_p must be in (0, 1]"),
    (chat_body("w5", seed=-3), 400, None, "seed must be"),
    (chat_body("w5", max_tokens=0), 400, "max_tokens", "greater than or equal to 1"),
    (chat_body("w5", stop=[""]), 400, None, "stop strings must be non-empty"),
    ({"messages": []}, 400, "messages", "at least 1 item"),
    ({"temperature": 0}, 400, "messages", "Field required"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages.0.content", "a list of text parts"),
    ({"messages": [{"role": "user"}]}, 400, "messages.0", "a user message needs content"),
    ({"messages": [{"role": "wizard", "content": "w5"}]}, 400, "messages.0.role", "'user', 'assistant' or 'tool'"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_client_errors(shared, body, status, param, message, stream):
    response = httpx.post(f"{shared}/v1/chat/completions", json=body | {"stream": stream})
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param
    assert set(error) == {"message", "type", "param", "code"}


def test_malformed_requests(shared):
    bad_json = httpx.post(f"{shared}/v1/chat/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["message"] == "the request body is not valid JSON"
    no_prompt = httpx.post(f"{shared}/v1/completions", json={"prompt": ["w5", "w6"]})
    assert no_prompt.status_code == 400 and no_prompt.json()["error"]["param"] == "prompt"
    unknown = httpx.get(f"{shared}/v1/nothing")
    assert unknown.status_code == 404 and unknown.json()["error"]["message"] == "Not Found"
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client(shared).completions.create(model="other", prompt="w5", max_tokens=2)


def test_unexpected_error_fails_one_request_only():
    engine = spec_engine()
    probe = Probe(engine)
    probe.fail_on = TOKENIZER.chat([{"role": "user", "content": "w66"}])
    with serving(engine) as url:
        failed = httpx.post(f"{url}/v1/chat/completions", json=chat_body("w66"))
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "internal_error"
        # streaming: the status line went out with the first chunk, so the error comes as the last event
        streamed = httpx.post(f"{url}/v1/chat/completions", json=chat_body("w66", stream=True))
        last = json.loads(streamed.text.strip().splitlines()[-1].removeprefix("data: "))
        assert streamed.status_code == 200 and last["error"]["code"] == "internal_error"
        ok = httpx.post(f"{url}/v1/chat/completions", json=chat_body("w5", max_tokens=5))
        assert ok.json()["choices"][0]["message"]["content"] == reference("w5", max_new_tokens=5).text
        assert metric(url, 'deepflash_requests_total{endpoint="/v1/chat/completions",status="500"}') == 1


# --- one worker, a bounded FIFO queue ---------------------------------------------------------------
def post_in_thread(url: str, body: dict, results: dict, key, path: str = "/v1/chat/completions") -> threading.Thread:
    def send():
        results[key] = httpx.post(f"{url}{path}", json=body, timeout=30)

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def test_full_queue_gets_503_and_health_answers_while_generating():
    engine = spec_engine()
    probe = Probe(engine)
    probe.gate.clear()  # the first generation holds the worker until the gate opens
    with serving(engine, queue_size=1) as url:
        results = {}
        threads = [post_in_thread(url, chat_body("w5", max_tokens=5), results, "running")]
        wait_for(lambda: metric(url, "deepflash_running_requests") == 1)
        threads.append(post_in_thread(url, chat_body("w6", max_tokens=5), results, "queued"))
        wait_for(lambda: metric(url, "deepflash_queue_depth") == 1)
        assert httpx.get(f"{url}/health", timeout=2).status_code == 200
        refused = httpx.post(f"{url}/v1/chat/completions", json=chat_body("w7", max_tokens=5))
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["code"] == "queue_full"
        probe.gate.set()
        for thread in threads:
            thread.join()
        assert results["running"].status_code == results["queued"].status_code == 200
        assert results["queued"].json()["choices"][0]["message"]["content"] == reference("w6", max_new_tokens=5).text


def test_concurrent_clients_are_served_alone_in_fifo_order():
    prompts = [f"w{10 + i} w{40 + 3 * i}" for i in range(6)]
    want = {p: reference(p, max_new_tokens=12 + i).text for i, p in enumerate(prompts)}
    engine = spec_engine()
    probe = Probe(engine)
    probe.gate.clear()
    with serving(engine, queue_size=8) as url:
        results, threads = {}, []
        for i, p in enumerate(prompts):
            threads.append(post_in_thread(url, chat_body(p, max_tokens=12 + i, stream=i % 2 == 1), results, p))
            wait_for(lambda: len(probe.started) + metric(url, "deepflash_queue_depth") == i + 1)
        probe.gate.set()
        for thread in threads:
            thread.join()
    assert probe.started == [TOKENIZER.chat([{"role": "user", "content": p}]) for p in prompts]
    for i, p in enumerate(prompts):
        assert results[p].status_code == 200
        if i % 2:
            events = [json.loads(line[6:]) for line in results[p].text.splitlines()
                      if line.startswith("data: {")]
            text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
        else:
            text = results[p].json()["choices"][0]["message"]["content"]
        assert text == want[p]


# --- cancellation -----------------------------------------------------------------------------------
def test_disconnect_mid_stream_cancels_the_generation():
    engine = spec_engine()
    probe = Probe(engine)
    probe.step_delay = 0.02  # 400 steps would take 8 s
    with serving(engine) as url:
        body = chat_body("w5", max_tokens=400, stream=True)
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            assert next(response.iter_lines()).startswith("data: ")
        begin = time.monotonic()
        out = httpx.post(f"{url}/v1/chat/completions", json=chat_body("w6", max_tokens=10), timeout=10)
        assert out.status_code == 200 and time.monotonic() - begin < 2  # the engine was freed at once
        chunks, completed = probe.runs[0]
        assert not completed and chunks < 50


def test_disconnect_while_waiting_cancels_the_generation():
    engine = spec_engine()
    probe = Probe(engine)
    probe.step_delay = 0.02
    with serving(engine) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/chat/completions", json=chat_body("w5", max_tokens=400), timeout=0.3)
        wait_for(lambda: probe.runs, timeout=2)
        chunks, completed = probe.runs[0]
        assert not completed and chunks < 50
        wait_for(lambda: metric(url, 'deepflash_requests_total{endpoint="/v1/chat/completions",status="499"}') == 1)


def test_disconnect_during_a_long_prefill_frees_the_engine_within_a_second():
    """The engine asks the job between prefill pieces: a client that leaves while its long prompt is still
    being prefilled (16 pieces of 0.2 s here) frees the engine within a second, not at the prefill's end."""
    engine = Engine(TARGET, TOKENIZER, DRAFTER, config=EngineConfig(spec="on", prefill_chunk=4))
    probe = Probe(engine)
    prefill, pieces = engine.steps.prefill, []

    def slow_prefill(*args):
        pieces.append(time.monotonic())
        time.sleep(0.2)
        prefill(*args)

    engine.steps.prefill = slow_prefill
    prompt = " ".join(f"w{5 + i % 50}" for i in range(60))
    with serving(engine) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/chat/completions", json=chat_body(prompt, max_tokens=8), timeout=0.3)
        left = time.monotonic()
        wait_for(lambda: probe.runs, timeout=1.0)
        assert probe.runs == [(0, False)] and time.monotonic() - left < 1.0 and len(pieces) < 10
        wait_for(lambda: metric(url, 'deepflash_requests_total{endpoint="/v1/chat/completions",status="499"}') == 1)


def test_serve_command_is_registered():
    args = build_parser().parse_args(["serve", "--port", "9001", "--queue-size", "3", "--no-draft"])
    assert (args.port, args.queue_size, args.host, args.no_draft) == (9001, 3, "127.0.0.1", True)
    assert args.func.__name__ == "cmd_serve"
