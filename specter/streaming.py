"""What streaming adds around a generation: printable pieces and asyncio.

    Printer      (ids, text) as the generation goes -> the pieces that are final: nothing a stop string
                 could still cut, no incomplete UTF-8 sequence
    in_thread    a blocking iterator on a thread of its own, its items handed to the running event
                 loop: how `Engine.astream` drives the one body of a generation (`Engine._decoding`)

Turns (one generation at a time) and `Engine._decoding` (one generation's bookkeeping) are in engine.py.
"""
from __future__ import annotations

import asyncio
import bisect
import threading
from typing import Callable, Iterator

from .offload.threads import close_at_exit


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that could be the start of a stop string (not yet printable).

    For each stop s, the end of `text` shorter than s that s starts with: its first position is the first
    place in that tail where s[0] occurs and s goes on as the tail does (a scan, not one comparison per
    length: a long stop string costs a request the length of its tail, not its square)."""
    best = 0
    for s in stops:
        tail = text[len(text) - min(len(s) - 1, len(text)):]
        i = tail.find(s[0]) if tail else -1
        while i >= 0 and len(tail) - i > best:
            if s.startswith(tail[i:]):
                best = len(tail) - i
                break
            i = tail.find(s[0], i + 1)
    return best


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
            done = complete(text)  # an incomplete UTF-8 sequence at the end waits for its other bytes
            text_end = len(done) - held_back(done, self.stops)
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


def not_unicode(text: str) -> str | None:
    """Why `text` is no text, or None: a lone surrogate (JSON's "\\ud800", or bytes that are not UTF-8
    read with surrogateescape, as the CLI's arguments and stdin are) that no tokenizer can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"it is not valid Unicode: a lone surrogate {text[e.start]!r} at character {e.start} (bytes that "
                f"are not UTF-8?); give UTF-8 text")
    return None


def complete(text: str) -> str:
    """`text` without the U+FFFD that end it: an incomplete UTF-8 sequence decodes to one (byte-level BPE)
    or one per byte (byte-fallback tokenizers), and becomes its character, fewer of them, when the rest
    of its bytes arrive."""
    return text.rstrip("\ufffd")


def _reach(decode, ids: list[int]) -> float:
    """How far `ids`' text reaches: its complete characters, and half of one more while an incomplete
    one is pending. Non-decreasing as tokens are appended, which the raw length is not (byte-fallback's
    pending bytes are one U+FFFD each, its character one), so a bisection over prefixes is sound."""
    text = decode(ids)
    done = complete(text)
    return len(done) + (0.5 if len(done) < len(text) else 0)


def tokens_for(decode, new: list[int], n_chars: int) -> int:
    """The fewest leading tokens whose text reaches `n_chars` complete characters (the text up to a
    stop): never a token that ends in the middle of a character before it."""
    return bisect.bisect_left(range(len(new) + 1), n_chars, key=lambda j: _reach(decode, new[:j]))


def tokens_within(decode, new: list[int], n_chars: int) -> int:
    """The most leading tokens whose text fits in `n_chars` characters, none of them incomplete."""
    return bisect.bisect_right(range(len(new) + 1), n_chars, key=lambda j: _reach(decode, new[:j])) - 1


def in_thread(make: Callable[[], Iterator], name: str = "specter-generation") -> "InThread":
    """The items of `make()` (a blocking iterator, built and run on a thread of its own), on the running
    loop, which stays free meanwhile. Leaving early (break + aclose, cancellation) stops the iterator
    after the item it is computing and waits for its thread: the engine is whole when aclose returns."""
    return InThread(make, name)


class InThread:
    """in_thread's async iterator. A class, not an async generator: the end of asyncio.run closes every
    live async generator at once, and would close this one beside its owner (Engine.astream), whose
    turn then passed on while this thread still decoded. Only its owner closes it, and waits."""

    def __init__(self, make: Callable[[], Iterator], name: str):
        self._loop = asyncio.get_running_loop()
        self._items: asyncio.Queue = asyncio.Queue()
        self._stop, self._end, self._over = threading.Event(), object(), False
        self._thread = threading.Thread(target=self._produce, args=(make,), name=name, daemon=True)
        close_at_exit(self)  # (offload/threads.py: a daemon thread inside a torch op at exit aborts the process)
        self._thread.start()  # (after its attribute is set: the thread reads it)

    CLOSE_FIRST = True  # at exit, before the links and lanes its generation uses

    def close(self) -> None:
        """At exit (a loop left with the stream running): stops the iterator after the item it is computing
        and joins its thread (a daemon thread still inside a torch op at finalization aborts the process)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _put(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:  # the loop has closed: nobody is listening
            self._stop.set()

    def _produce(self, make) -> None:
        try:
            it = make()
            try:
                for item in it:
                    self._put(item)
                    if self._stop.is_set():
                        break
            finally:
                getattr(it, "close", lambda: None)()
        except BaseException as e:  # handed to the consumer, raised there
            self._put(e)
        self._put(self._end)

    def __aiter__(self) -> "InThread":
        return self

    async def __anext__(self):
        if self._over:
            raise StopAsyncIteration
        item = await self._items.get()
        if item is self._end or isinstance(item, BaseException):
            self._over = True
            await self.aclose()  # the end, or its error: raised once its thread has ended (nothing left running)
            if item is self._end:
                raise StopAsyncIteration
            raise item
        return item

    async def aclose(self) -> None:
        """Stops the iterator after the item it is computing and waits for the thread, however this is left."""
        self._stop.set()
        cancelled = False
        while self._thread.is_alive():
            try:
                await asyncio.sleep(1e-3)
            except asyncio.CancelledError:  # cancelled while closing: still wait, then honour it
                cancelled = True
            except GeneratorExit:  # closed with no loop to wait on (the task closing it is being destroyed)
                self._thread.join()
                raise
        if cancelled:
            raise asyncio.CancelledError
