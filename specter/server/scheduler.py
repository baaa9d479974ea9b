"""One engine, many clients: a bounded FIFO queue in front of one engine thread.

    request -> submit() (QueueFull -> 503 when max_queue requests wait) -> Job
    _run:   wait its turn (asyncio.Lock is FIFO) -> engine.stream(...) on the engine thread ->
            pieces into Job.events (call_soon_threadsafe) -> the HTTP handler reads them
    client gone -> Job.cancel(): the engine finishes the cycle it is in and stops (its `cancel`
            event), and the next job starts at once

The engine only ever runs on that one thread, so generations never overlap (batch size one) and a
request's text is the text it would get alone.
"""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..errors import ConfigError
from .metrics import Metrics


class QueueFull(Exception):
    pass


@dataclass(eq=False)  # hashed by identity
class Job:
    ids: list[int]
    sampling: dict                              # engine.stream keyword arguments
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # ("piece", str) .. ("done", stats) | ("error", exc)
    cancelled: threading.Event = field(default_factory=threading.Event)  # set from any thread: the client left

    def cancel(self) -> None:
        self.cancelled.set()


class Scheduler:
    def __init__(self, engine, max_queue: int, metrics: Metrics):
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ConfigError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        self.engine, self.max_queue, self.metrics = engine, max_queue, metrics
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="specter-engine")
        self.turn = asyncio.Lock()              # FIFO: waiters acquire in arrival order
        self.waiting = 0
        self.running = 0
        self.jobs: dict[Job, asyncio.Task] = {}  # queued or running (the loop keeps only weak task refs)

    def submit(self, ids: list[int], sampling: dict) -> Job:
        """Queue a generation, or raise QueueFull when max_queue requests already wait."""
        if self.waiting + self.running > self.max_queue:
            raise QueueFull
        job = Job(ids, sampling)
        self.waiting += 1
        self.metrics.queue_depth.set(self.waiting)
        self.jobs[job] = asyncio.get_running_loop().create_task(self._run(job))
        self.jobs[job].add_done_callback(lambda _: self.jobs.pop(job, None))
        return job

    async def _run(self, job: Job) -> None:
        queued = time.perf_counter()
        try:
            await self.turn.acquire()
        finally:
            self.waiting -= 1
            self.metrics.queue_depth.set(self.waiting)
        self.running = 1
        self.metrics.queue_wait.observe(time.perf_counter() - queued)
        try:
            if job.cancelled.is_set():  # gone while it waited: the engine never sees it
                self.metrics.cancelled.inc()
                return
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self.thread, self._generate, job, loop)
        finally:
            self.running = 0
            self.turn.release()

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
                if not job.cancelled.is_set():
                    put("piece", piece)
        except Exception as e:  # a SpecterError from the engine, or a bug: the handler answers, we go on
            put("error", e)
            return
        if stats.get("finish_reason", "cancelled") == "cancelled":
            self.metrics.cancelled.inc()
        self.metrics.observe(stats)
        put("done", stats)

    def close(self) -> None:
        """Stop every generation at its next cycle and wait for the engine thread (then the engine may close)."""
        for job in list(self.jobs):
            job.cancel()
        self.thread.shutdown(wait=True, cancel_futures=True)
