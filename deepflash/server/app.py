"""The FastAPI app: OpenAI and Anthropic routes in front of one engine worker, plus /health and /metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..engine.engine import Chunk, Engine, Result
from ..engine.sampling import SamplingParams
from ..errors import NotFound
from ..loading.tokenizer import Tokenizer
from .anthropic_api import CountTokensRequest, MessageReply, MessagesRequest
from .chat import Rendered, render
from .errors import ApiError, ClientGone, describe, install_error_handlers
from .metrics import RequestMetricsMiddleware, ServerMetrics
from .openai_api import ChatRequest, CompletionRequest, GenerationRequest, Reply
from .reply import Event, ReplyParser
from .worker import EngineWorker, Job

MODEL_ALIAS = "deepflash"  # accepted in place of the served model's name

log = logging.getLogger("deepflash.server")
T = TypeVar("T")


def create_app(engine: Engine, tokenizer: Tokenizer, model_name: str, *, queue_size: int = 16,
               draft_name: str | None = None) -> FastAPI:
    """An app serving `engine`; its worker thread runs from app startup to shutdown (the lifespan)."""
    metrics = ServerMetrics(engine.block_size)
    worker = EngineWorker(engine, queue_size, metrics)
    metrics.watch(lambda: worker.waiting, lambda: worker.busy)
    if engine.prefix is not None:
        metrics.watch_prefix_cache(engine.prefix.index)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        await asyncio.to_thread(worker.stop)

    # strict_content_type off: a body sent without a Content-Type header is still read as JSON
    app = FastAPI(title="deepflash", lifespan=lifespan, strict_content_type=False)
    app.state.worker = worker  # for `deepflash serve`, which stops it after a forced quit skipped the lifespan
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    install_error_handlers(app)

    def check_model(name: str | None) -> None:
        if name not in (None, model_name, MODEL_ALIAS):
            raise NotFound(f"model {name!r} is not served here; use {model_name!r} (or {MODEL_ALIAS!r})")

    async def openai_reply(request: Request, body: GenerationRequest, rendered: Rendered, reply: Reply):
        params = body.sampling_params(engine.max_ctx).validated()  # a bad request takes no queue slot
        n = body.n or 1
        if not body.stream:
            choices, results = [], []
            for index in range(n):
                job = worker.submit(rendered.ids, choice_params(params, index))
                result = await while_connected(request, job, job.result())
                parser = reply_parser(reply, rendered)
                events = parser.feed(rendered.forced + result.text) + parser.finish()
                choices.append(reply.choice(index, result, events, parser.calls))
                results.append(result)
            return reply.body(choices, results=results)
        # wait for the first chunk before answering, so that a prompt the engine refuses still gets its 4xx
        job = worker.submit(rendered.ids, params)
        first = await while_connected(request, job, job.next_chunk())
        return StreamingResponse(openai_events(job, first, rendered, reply, params, n), media_type="text/event-stream")

    async def openai_events(job: Job, first: Chunk, rendered: Rendered, reply: Reply, params: SamplingParams,
                            n: int) -> AsyncIterator[str]:
        """Server-sent events of the n choices, one after another. Starlette cancels this generator when the
        client disconnects; `finally` then cancels the running job."""
        results: list[Result] = []
        try:
            for index in range(n):
                if index:
                    job = worker.submit(rendered.ids, choice_params(params, index))
                    first = await job.next_chunk()
                parser = reply_parser(reply, rendered)
                chunk, text = first, rendered.forced + first.text
                delta = reply.delta(index, parser.feed(text), chunk.logprobs, 0, first=True)
                yield sse(reply.body([delta], chunk=True))
                while chunk.result is None:
                    chunk = await job.next_chunk()
                    events = parser.feed(chunk.text) + (parser.finish() if chunk.result is not None else [])
                    delta = reply.delta(index, events, chunk.logprobs, len(parser.calls) - count_calls(events))
                    if delta is not None:
                        yield sse(reply.body([delta], chunk=True))
                results.append(chunk.result)
                last = reply.last_delta(index, chunk.result, parser.calls)
                yield sse(reply.body([last], chunk=True, results=results if index == n - 1 else ()))
            yield "data: [DONE]\n\n"
        except Exception as err:  # the status line is sent already: report in the stream, as OpenAI does
            yield sse(mid_stream(err).body())
        finally:
            job.cancel()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest):
        check_model(body.model)
        rendered = render(tokenizer, body.conversation())
        return await openai_reply(request, body, rendered, Reply("chat", model_name, tokenizer))

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        check_model(body.model)
        rendered = Rendered(tokenizer.encode(body.prompt), body.prompt, "", False, None)
        return await openai_reply(request, body, rendered, Reply("text", model_name, tokenizer))

    @app.post("/v1/messages")
    async def messages(request: Request, body: MessagesRequest):
        """Anthropic's Messages API. Any model name is taken (an agent such as Claude Code asks for its own
        model names); the response names the served model."""
        rendered = render(tokenizer, body.conversation())
        params = body.sampling_params().validated()
        job = worker.submit(rendered.ids, params)
        message = MessageReply(model_name)
        if not body.stream:
            result = await while_connected(request, job, job.result())
            parser = ReplyParser(rendered.tools, rendered.thinking)
            events = parser.feed(rendered.forced + result.text) + parser.finish()
            return message.message(result, events, parser.calls)
        first = await while_connected(request, job, job.next_chunk())
        return StreamingResponse(anthropic_events(job, first, rendered, message), media_type="text/event-stream")

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        return {"input_tokens": len(render(tokenizer, body.conversation()).ids)}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "deepflash",
                "max_model_len": engine.max_ctx, "draft": draft_name}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def reply_parser(reply: Reply, rendered: Rendered) -> ReplyParser:
    """Chat replies are parsed for reasoning and tool calls; text completions are not."""
    if reply.kind == "chat":
        return ReplyParser(rendered.tools, rendered.thinking)
    return ReplyParser(None)


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The n-th choice's parameters: its own seed, so that sampled choices differ (greedy ones cannot)."""
    return params if index == 0 else replace(params, seed=params.seed + index)


def count_calls(events: list[Event]) -> int:
    return sum(e.kind == "tool_call" for e in events)


async def anthropic_events(job: Job, first: Chunk, rendered: Rendered, message: MessageReply) -> AsyncIterator[str]:
    """Anthropic's event stream of one message; `finally` cancels the job if the client left."""
    try:
        yield event_sse(message.start(len(rendered.ids)))
        parser = ReplyParser(rendered.tools, rendered.thinking)
        chunk, text = first, rendered.forced + first.text
        while True:
            events = parser.feed(text) + (parser.finish() if chunk.result is not None else [])
            for event in message.events(events):
                yield event_sse(event)
            if chunk.result is not None:
                break
            chunk = await job.next_chunk()
            text = chunk.text
        for event in message.end(chunk.result, parser.calls):
            yield event_sse(event)
    except Exception as err:  # the status line is sent already: an error event, as Anthropic's stream has
        yield event_sse(mid_stream(err).anthropic_body())
    finally:
        job.cancel()


def mid_stream(err: Exception) -> ApiError:
    """A failure after the stream's status line: described, and logged with its traceback if unexpected."""
    error = describe(err)
    if error.status == 500:
        log.exception("generation failed mid-stream")
    return error


def event_sse(body: dict) -> str:
    return f"event: {body['type']}\ndata: {json.dumps(body)}\n\n"


async def while_connected(request: Request, job: Job, waiting: Awaitable[T]) -> T:
    """Await a step of `job`; if the client disconnects first (or this request is cancelled), cancel the job:
    the one engine must not spend its time on an answer nobody will read."""
    step = asyncio.ensure_future(waiting)
    leaving = asyncio.ensure_future(disconnected(request))
    try:
        done, _ = await asyncio.wait({step, leaving}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        leaving.cancel()
        if step.cancel():  # still pending: the client left, or this request itself was cancelled
            job.cancel()
    if step not in done:
        raise ClientGone("the client disconnected")
    return step.result()


async def disconnected(request: Request) -> None:
    """Returns when the client goes away (the request body has been read, so only that message is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"
