"""The FastAPI app: OpenAI routes in front of one engine worker, plus /health and /metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..engine.engine import Chunk, Engine
from ..errors import NotFound
from ..loading.tokenizer import Tokenizer
from .errors import ClientGone, describe, install_error_handlers
from .metrics import RequestMetricsMiddleware, ServerMetrics
from .protocol import ChatRequest, ChatShape, CompletionRequest, CompletionShape, GenerationRequest, Reply
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

    async def generate(request: Request, body: GenerationRequest, prompt_ids: list[int], reply: Reply):
        params = body.sampling_params(engine.max_ctx).validated()  # a bad request takes no queue slot
        job = worker.submit(prompt_ids, params)
        if not body.stream:
            return reply.complete(await while_connected(request, job, job.result()))
        # wait for the first chunk before answering, so that a prompt the engine refuses still gets its 4xx
        first = await while_connected(request, job, job.next_chunk())
        return StreamingResponse(events(job, first, reply), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest):
        check_model(body.model)
        prompt_ids = tokenizer.chat([m.model_dump() for m in body.messages])
        return await generate(request, body, prompt_ids, Reply(ChatShape, model_name))

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        check_model(body.model)
        prompt_ids = tokenizer.encode(body.prompt)
        return await generate(request, body, prompt_ids, Reply(CompletionShape, model_name))

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


async def events(job: Job, first: Chunk, reply: Reply) -> AsyncIterator[str]:
    """Server-sent events of one stream. Starlette cancels this generator when the client disconnects;
    `finally` then cancels the job."""
    try:
        chunk = first
        yield sse(reply.chunk(chunk.text, first=True))
        while chunk.result is None:
            chunk = await job.next_chunk()
            if chunk.text:
                yield sse(reply.chunk(chunk.text))
        yield sse(reply.last_chunk(chunk.result))
        yield "data: [DONE]\n\n"
    except Exception as err:  # the status line is sent already: report in the stream, as OpenAI does
        error = describe(err)
        if error.status == 500:
            log.exception("generation failed mid-stream")
        yield sse(error.body())
    finally:
        job.cancel()


def sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"
