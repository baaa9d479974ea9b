"""One engine, many clients: a bounded FIFO queue in front of one engine thread.

    request -> submit() (QueueFull -> 503 when max_queue requests wait) -> Job
    _run:   wait its turn (asyncio.Lock is FIFO) -> engine.stream(...) on the engine thread ->
            pieces into Job.events (call_soon_threadsafe) -> the HTTP handler reads them
    client gone -> Job.cancel(): a queued job leaves the queue at once (its place and its count);
            a running one ends after the engine's cycle in progress, and the next job starts at once
    shutdown -> drain(grace): new jobs are refused, queued ones answered ShuttingDown, the running
            one may finish within `grace` seconds and is then stopped (finish_reason "abort")

The engine only ever runs on that one thread, so generations never overlap (batch size one) and a
request's text is the text it would get alone.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..errors import ConfigError, SpecterError
from .metrics import Metrics

log = logging.getLogger("uvicorn.error")  # uvicorn's own error log, so its handlers print it


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


@dataclass(eq=False)  # hashed by identity
class Job:
    ids: list[int]
    sampling: dict                              # engine.stream keyword arguments
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # ("piece", str) .. ("done", stats) | ("error", exc)
    cancelled: threading.Event = field(default_factory=threading.Event)  # set from any thread: the client left
    queued: bool = True                         # waiting for its turn (read and written on the event loop)
    started: bool = False                       # it had its turn
    aborted: bool = False                       # stopped by the server's shutdown, not by its client
    _leave: object = None                       # while queued: drops it from the queue (thread-safe)

    def cancel(self) -> None:
        """The client is gone: a queued job leaves the queue now, a running one stops at the next cycle."""
        self.cancelled.set()
        if self._leave is not None:
            self._leave()


class Scheduler:
    def __init__(self, engine, max_queue: int, metrics: Metrics):
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ConfigError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        self.engine, self.max_queue, self.metrics = engine, max_queue, metrics
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="specter-engine")
        # CUDA graphs are recorded per thread: record them on the engine thread, before any request
        # (a no-op without captured graphs; the executor runs it before the first generation)
        record = getattr(getattr(engine, "decoder", None), "record_graphs", None)
        self.recorded = self.thread.submit(record) if record is not None else None
        self.turn = asyncio.Lock()              # FIFO: waiters acquire in arrival order
        self.waiting = 0
        self.running = 0
        self.jobs: dict[Job, asyncio.Task] = {}  # queued or running (the loop keeps only weak task refs)
        self.current: Job | None = None         # the one the engine runs
        self.closing = False                    # drain() was called: no new jobs

    def submit(self, ids: list[int], sampling: dict) -> Job:
        """Queue a generation, or raise QueueFull when max_queue requests already wait (ShuttingDown
        after drain())."""
        if self.closing:
            raise ShuttingDown
        if self.waiting + self.running > self.max_queue:
            raise QueueFull
        loop = asyncio.get_running_loop()
        job = Job(ids, sampling)
        self.waiting += 1
        self.metrics.queue_depth.set(self.waiting)
        task = self.jobs[job] = loop.create_task(self._run(job))

        def finished(task):
            self.jobs.pop(job, None)
            self._dequeue(job)          # a task cancelled before its first step never ran _run's finally
            if not job.started and not job.aborted:  # it left the queue
                self.metrics.cancelled.inc()

        task.add_done_callback(finished)

        def leave_now():  # on the loop: still queued -> stop waiting for the turn
            if job.queued:
                task.cancel()

        job._leave = lambda: loop.call_soon_threadsafe(leave_now)
        return job

    async def _run(self, job: Job) -> None:
        queued = time.perf_counter()
        try:
            await self.turn.acquire()   # cancelled here: it left the queue (client gone, or shutdown)
        finally:
            self._dequeue(job)
        self.running, self.current, job.started = 1, job, True
        self.metrics.queue_wait.observe(time.perf_counter() - queued)
        try:
            if job.cancelled.is_set():  # gone while it waited: the engine never sees it
                self.metrics.cancelled.inc()
                return
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self.thread, self._generate, job, loop)
        finally:
            self.running, self.current = 0, None
            self.turn.release()

    def _dequeue(self, job: Job) -> None:
        if job.queued:
            job.queued = False
            self.waiting -= 1
            self.metrics.queue_depth.set(self.waiting)

    def drain(self, grace: float) -> None:
        """Shutdown, on the event loop: refuse new jobs, answer the queued ones ShuttingDown, and stop the
        running one if it has not finished within `grace` seconds (its stats say finish_reason "abort")."""
        self.closing = True
        for job in list(self.jobs):
            if job.queued:
                job.aborted = True
                job.events.put_nowait(("error", ShuttingDown()))
                job.cancel()
        if self.current is not None:
            asyncio.get_running_loop().call_later(grace, self._abort, self.current)

    def _abort(self, job: Job | None) -> None:
        """Stop `job` at the engine's next cycle if it is still the running one (from any thread)."""
        if job is not None and self.current is job:
            job.aborted = True
            job.cancelled.set()

    def abort_now(self) -> None:
        """A forced shutdown (a second SIGINT): stop the running generation at once, from any thread."""
        self.closing = True
        self._abort(self.current)

    def _generate(self, job: Job, loop) -> None:
        """On the engine thread: the whole generation, pieces handed to the event loop as they come."""
        def put(kind, value):
            try:
                loop.call_soon_threadsafe(job.events.put_nowait, (kind, value))
            except RuntimeError:  # the event loop has closed: nobody is listening
                job.cancel()

        stats: dict = {}
        try:
            # `cancel`: the engine ends the generation after the cycle it is in and still fills stats
            for piece in self.engine.stream(job.ids, stats=stats, cancel=job.cancelled, **job.sampling):
                if not job.cancelled.is_set() or job.aborted:  # a stopped stream still gets all its text
                    put("piece", piece)
        except Exception as e:  # a SpecterError from the engine, or a bug: the handler answers, we go on
            if not isinstance(e, SpecterError):
                log.error("generation failed", exc_info=e)
            put("error", e)
            return
        if stats.get("finish_reason", "cancelled") == "cancelled":
            if job.aborted:
                stats["finish_reason"] = "abort"  # stopped by the shutdown (vLLM's name for it)
            else:
                self.metrics.cancelled.inc()
        self.metrics.observe(stats)
        put("done", stats)

    def close(self) -> None:
        """Stop every generation at its next cycle and wait for the engine thread (then the engine may close)."""
        for job in list(self.jobs):
            job.cancel()
        self.thread.shutdown(wait=True, cancel_futures=True)
