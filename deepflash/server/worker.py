"""The one engine worker: a thread that runs queued generations one at a time, in FIFO order.

The Engine is synchronous and owns a single KV cache, so requests never run concurrently: handlers put
a Job on a bounded queue and await its chunks, which the worker passes to the event loop with
call_soon_threadsafe. Between chunks the worker looks at the job's cancel flag, and the engine asks it
between prefill pieces, so a client that leaves frees the engine after at most one more decode step or
about two prefill pieces.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time

from ..engine.engine import Cancelled, Chunk, Engine, Result
from ..engine.sampling import SamplingParams
from .metrics import ServerMetrics


class QueueFull(Exception):
    """Every queue slot is taken; the client should retry later (503)."""


class JobCancelled(Exception):
    """The job was cancelled before it finished (its client left, or the server is stopping)."""


class Job:
    """One generation request: filled in by the worker thread, read on the event loop."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams):
        self.prompt_ids = prompt_ids
        self.params = params
        self.submitted = time.perf_counter()
        self.cancelled = threading.Event()
        self._loop = asyncio.get_running_loop()
        self._items: asyncio.Queue[Chunk | BaseException] = asyncio.Queue()

    def cancel(self) -> None:
        self.cancelled.set()

    def deliver(self, item: Chunk | BaseException) -> None:
        """Called by the worker thread: a chunk, or the error that ended the job."""
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:  # the event loop is closed (forced quit): nobody is listening any more
            pass

    async def next_chunk(self) -> Chunk:
        item = await self._items.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def result(self) -> Result:
        while (chunk := await self.next_chunk()).result is None:
            pass
        return chunk.result


class EngineWorker:
    def __init__(self, engine: Engine, queue_size: int, metrics: ServerMetrics):
        self.engine = engine
        self.metrics = metrics
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)  # None asks the thread to end
        self._current: Job | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="deepflash-engine", daemon=True)

    @property
    def waiting(self) -> int:
        return self.jobs.qsize()

    @property
    def busy(self) -> bool:
        return self._current is not None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Cancel what is running or queued (each waiting handler gets JobCancelled), then end the thread."""
        if not self._thread.is_alive():
            return
        self._stopping.set()
        self.jobs.put(None)  # waits for a free slot if need be: the worker drains the queue fast now
        self._thread.join()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Job:
        """Queue a generation (call on the event loop); raises QueueFull when every slot is taken."""
        job = Job(prompt_ids, params)
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"all {self.jobs.maxsize} queue slots are taken; retry shortly") from None
        return job

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            self._current = job
            try:
                self._run(job)
            except Exception as err:  # this request's failure only: the worker goes on with the next job
                job.deliver(err)
            self._current = None

    def _run(self, job: Job) -> None:
        def cancelled() -> bool:
            return job.cancelled.is_set() or self._stopping.is_set()

        # engine.generate is a generator: nothing runs before next(), and closing it ends the generation
        with contextlib.closing(self.engine.generate(job.prompt_ids, job.params, cancelled)) as chunks:
            index, since = 0, job.submitted
            while not cancelled():
                try:
                    chunk = next(chunks)
                except Cancelled:
                    break
                now = time.perf_counter()
                self.metrics.observe_chunk(index, chunk, now - since)
                index, since = index + 1, now
                job.deliver(chunk)
                if chunk.result is not None:
                    return
            job.deliver(JobCancelled("the generation was cancelled"))
