"""Everything around a decoder's committed chunks: turns, stop strings, printable pieces, asyncio.

    Turns        one generation at a time on an engine, in arrival order (a ticket lock; `aturn` for
                 coroutines, whose wait polls so the loop runs meanwhile)
    Decoding     one generation's bookkeeping: chunks in, (ids, text) cut at EOS, max_new_tokens or a
                 stop string out; then its stats
    Printer      (ids, text) as the generation goes -> the pieces that are final: nothing a stop string
                 could still cut, no incomplete UTF-8 sequence
    in_thread    a blocking iterator (a decoder's `run`) on a thread of its own, its items handed to
                 the running event loop: how `Engine.astream` drives the one body of a generation
"""
from __future__ import annotations

import asyncio
import bisect
import threading
import time
from contextlib import asynccontextmanager, contextmanager
from typing import AsyncIterator, Callable, Iterator

from .errors import ConfigError
from .offload.link import poll

# every generation reports every key, one schema for all: counts are 0 where nothing happened, ratios
# None where they do not apply (acceptance without drafting, recall without prefetching); and what it
# sampled with: `sampling` ("greedy", "temperature 0.7, top-p 0.95, ...") and `sampling_from`
# ("caller", "model": the model's generation_config.json, "none": greedy, as nothing was set); how
# expert bytes reach the device, `h2d_path` ("pinned store", "staging buffers (2 x N MiB)", "emulated
# (host memory)" on CPU; None when nothing is copied); `cuda_graphs` (speculative engines under CUDA
# graphs: recordings, recorded, bytes, warmups, threads so far; None without graphs)
STATS_DEFAULTS = dict(ttft_s=0.0, tpot_s=0.0, new_tokens=0, cycles=0, accepted_per_cycle=None, acceptance_rate=None,
                      draft_efficiency=None, k_histogram={}, expert_hits=0, expert_misses=0, prefetch_issued=0,
                      prefetch_used=0, prefetch_cancelled=0, prefetch_recall=None, route_coverage=None, h2d_bytes=0, stall_s=0.0,
                      decode_stall_s=0.0, draft_s=0.0, verify_s=0.0, drafted_tokens=0,
                      accepted_tokens=0, rejections=0, compiled=[], h2d_path=None, cuda_graphs=None)


class Turns:
    """One generation at a time on an engine, served in arrival order (a ticket lock)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._next = self._serving = 0
        self._owner: tuple | None = None  # (thread, task or None) running the current generation
        self._abandoned: set[int] = set()  # tickets of coroutines cancelled while they waited

    @property
    def waiting(self) -> int:
        """Generations queued behind the running one."""
        with self._cv:
            return self._next - self._serving - (self._owner is not None) - len(self._abandoned)

    def _take(self, task=None) -> int:
        """A ticket. Refused to a thread (a task) already holding the turn: waiting would deadlock it
        (a blocking call on a loop thread whose coroutine holds the turn waits for that thread too)."""
        me = (threading.get_ident(), task)
        if self._owner is not None and (self._owner == me or (task is None and self._owner[0] == me[0])):
            raise ConfigError("this thread is already generating on this engine (a stream it has not "
                              "finished); finish or close that stream before starting another")
        ticket, self._next = self._next, self._next + 1
        return ticket

    def _release(self) -> None:
        """The turn passes to the next ticket still waiting; called with the lock held."""
        self._owner = None
        self._serving += 1
        while self._serving in self._abandoned:
            self._abandoned.discard(self._serving)
            self._serving += 1
        self._cv.notify_all()

    @asynccontextmanager
    async def aturn(self):
        """`turn` for a coroutine: its wait polls, so the loop runs meanwhile; same arrival order as
        the threads'. A coroutine cancelled while it waits gives its ticket up."""
        task = asyncio.current_task()
        with self._cv:
            ticket = self._take(task)
        try:
            await poll(lambda: self._serving == ticket, spin=0.0, every=5e-3)  # a turn takes a while
        except BaseException:
            with self._cv:
                if self._serving == ticket:  # served just as it was cancelled: pass the turn on
                    self._release()
                else:
                    self._abandoned.add(ticket)
            raise
        with self._cv:
            self._owner = (threading.get_ident(), task)
        try:
            yield
        finally:
            with self._cv:
                self._release()

    @contextmanager
    def turn(self):
        with self._cv:
            ticket = self._take()
            while self._serving != ticket:
                self._cv.wait()
            self._owner = (threading.get_ident(), None)
        try:
            yield
        finally:
            with self._cv:
                self._release()


def stop_list(stop) -> list[str]:
    """None, a string or a list of strings -> a list of non-empty stop strings (else a ConfigError)."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise ConfigError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in stops):
        raise ConfigError("an empty stop string matches at once; remove it")
    return list(stops)


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that could be the start of a stop string (not yet printable)."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
               default=0)


class Decoding:
    """One generation's bookkeeping, whichever driver runs it: committed chunks in, (new ids so far,
    their text or None without a tokenizer) out, both cut at EOS, max_new_tokens or a stop string;
    then its stats."""

    def __init__(self, engine, ids: list[int], max_new_tokens: int, stops: list[str]):
        self.engine, self.prompt_tokens, self.max_new, self.stops = engine, len(ids), max_new_tokens, stops
        self.eos = set(engine.model.spec.eos_token_ids)
        self.longest = max(map(len, stops), default=0)
        engine.decoder.reset_stats()
        self.new: list[int] = []
        self.text: str | None = None
        self.checked = 0  # text before this offset holds no stop string
        self.done, self.finish_reason = False, "length"
        self.t0, self.t_first, self.prefill_stall = time.perf_counter(), None, 0.0

    def feed(self, chunk: list[int]) -> tuple[list[int], str | None]:
        eng = self.engine
        if self.t_first is None:
            self.t_first = time.perf_counter()
            self.prefill_stall = eng.decoder.stats().get("stall_s", 0.0)
        new = self.new
        for t in chunk:
            new.append(t)
            if t in self.eos or len(new) >= self.max_new:
                self.done, self.finish_reason = True, "stop" if t in self.eos else "length"
                break
        text = eng.decode(new) if eng.tokenizer is not None else None
        if self.stops:
            start = max(0, self.checked - self.longest + 1)
            hit = min((i for s in self.stops if (i := text.find(s, start)) >= 0), default=-1)
            self.checked = len(text)
            if hit >= 0:
                text, new = text[:hit], new[:tokens_for(eng.decode, new, hit)]
                self.done, self.finish_reason = True, "stop"
        self.new, self.text = new, text
        return new, text

    def finish(self, stats: dict) -> None:
        t_end = time.perf_counter()
        t_first = t_end if self.t_first is None else self.t_first
        stats.update(STATS_DEFAULTS)
        stats.update(self.engine.decoder.stats())
        stats.update(
            decode_stall_s=stats["stall_s"] - self.prefill_stall,  # copies waited on after the first token
            ttft_s=t_first - self.t0,
            tpot_s=(t_end - t_first) / max(len(self.new) - 1, 1),
            new_tokens=len(self.new),
            prompt_tokens=self.prompt_tokens,
            total_s=t_end - self.t0,
            policy=self.engine.policy,
            finish_reason=self.finish_reason,  # OpenAI's: "stop" (EOS or a stop string), "length", or "cancelled"
        )


class Printer:
    """(new ids, text) as a generation goes -> the pieces that are final: nothing a stop string could
    still cut, no incomplete UTF-8 sequence."""

    def __init__(self, engine, stops: list[str]):
        self.engine, self.stops = engine, stops
        self.sent = self.printed = 0
        self.new: list[int] = []
        self.text: str | None = None

    def feed(self, new: list[int], text: str | None) -> tuple[list[int], str] | None:
        self.new, self.text = new, text
        if text is None:  # no tokenizer (and so no stop strings)
            ids_end, text_end = len(new), 0
        else:
            text_end = len(text) - held_back(text, self.stops)
            if text[:text_end].endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait
                return None
            ids_end = len(new) if text_end == len(text) else tokens_within(self.engine.decode, new, text_end)
        if ids_end > self.sent or text_end > self.printed:
            piece = new[self.sent:ids_end], (text or "")[self.printed:text_end]
            self.sent, self.printed = max(self.sent, ids_end), max(self.printed, text_end)
            return piece
        return None

    def end(self) -> tuple[list[int], str] | None:
        """What is left once the generation is over: nothing is held back any more."""
        if len(self.new) > self.sent or len(self.text or "") > self.printed:
            return self.new[self.sent:], (self.text or "")[self.printed:]
        return None


def tokens_for(decode, new: list[int], n_chars: int) -> int:
    """The fewest leading tokens whose text reaches `n_chars` characters (the text up to a stop)."""
    return bisect.bisect_left(range(len(new) + 1), n_chars, key=lambda j: len(decode(new[:j])))


def tokens_within(decode, new: list[int], n_chars: int) -> int:
    """The most leading tokens whose text fits in `n_chars` characters."""
    return bisect.bisect_right(range(len(new) + 1), n_chars, key=lambda j: len(decode(new[:j]))) - 1


async def in_thread(make: Callable[[], Iterator], name: str = "specter-generation") -> AsyncIterator:
    """The items of `make()` (a blocking iterator, built and run on a thread of its own), on the running
    loop, which stays free meanwhile. Leaving early (break + aclose, cancellation) stops the iterator
    after the item it is computing and waits for its thread: the engine is whole when this ends."""
    loop = asyncio.get_running_loop()
    items: asyncio.Queue = asyncio.Queue()
    stop, end = threading.Event(), object()

    def put(item) -> None:
        try:
            loop.call_soon_threadsafe(items.put_nowait, item)
        except RuntimeError:  # the loop has closed: nobody is listening
            stop.set()

    def produce() -> None:
        try:
            it = make()
            try:
                for item in it:
                    put(item)
                    if stop.is_set():
                        break
            finally:
                getattr(it, "close", lambda: None)()
        except BaseException as e:  # handed to the consumer, raised there
            put(e)
        put(end)

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while (item := await items.get()) is not end:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # the chunk in progress ends (a cycle at most), then the thread
            await asyncio.sleep(1e-3)
