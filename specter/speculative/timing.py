"""How long a cycle's draft and verification took, without adding a host sync.

On CUDA the host only launches work: the wall time around the draft's launches is launch time, and
the draft's device time lands in whatever host wait comes next (verification's). So the cycle is
timed on the compute stream instead, with CUDA events, and read only once they have completed:

    cycle    mark m0 | draft launches | mark m1 | verify, accept | mark m2     (events on the stream)
    submit   ((m0, m1, m2), deliver)        queued; nothing waits
    poll     oldest first, while every mark of it has completed (event.query(), no sync):
             deliver(m0 -> m1, m1 -> m2) in seconds (event.elapsed_time)

A cycle's acceptance reads its result on the host, so its events have normally completed when it
is submitted, and it is delivered at once; a cycle whose events are still pending is delivered by
a later poll, in order. On CPU the marks are wall-clock readings (`WallClock`), ready at once.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable

import torch


class WallClock:
    """CPU: host wall-clock readings, in seconds; every mark is ready."""

    def mark(self) -> float:
        return time.perf_counter()

    def ready(self, mark) -> bool:
        return True

    def seconds(self, a, b) -> float:
        return b - a

    def release(self, marks) -> None:
        pass


class EventClock:
    """CUDA: events recorded on `device`'s current stream (the current device's when None); `event()`
    makes one: torch.cuda.Event with timing, or a stand-in in tests. Events are reused once their
    cycle is delivered."""

    def __init__(self, event: Callable | None = None, device=None):
        if event is None:
            def event():
                return torch.cuda.Event(enable_timing=True)
        self.event, self.free, self.device = event, [], device

    def mark(self):
        e = self.free.pop() if self.free else self.event()
        if self.device is None:
            e.record()
        else:
            e.record(torch.cuda.current_stream(self.device))
        return e

    def ready(self, mark) -> bool:
        return mark.query()

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3  # elapsed_time: milliseconds

    def release(self, marks) -> None:
        self.free.extend(marks)


def clock_for(device) -> WallClock | EventClock:
    device = torch.device(device)
    return EventClock(device=device) if device.type == "cuda" else WallClock()


class CycleTimes:
    """Cycles' spans handed to their `deliver(*seconds)` in order, once the clock can read them.
    `mark()` takes a mark: on the wall clock `time.perf_counter` itself (no call of ours on the hot
    path), whose spans are delivered at once."""

    def __init__(self, clock):
        self.clock, self.pending = clock, deque()
        self.wall = isinstance(clock, WallClock)
        self.mark = time.perf_counter if self.wall else clock.mark

    def submit(self, marks: tuple, deliver: Callable[..., None]) -> None:
        """deliver(seconds between consecutive marks...), now or at a later poll. Two or three marks."""
        if self.wall:  # readings: ready now (and nothing is ever pending)
            if len(marks) == 2:
                deliver(marks[1] - marks[0])
            else:
                deliver(marks[1] - marks[0], marks[2] - marks[1])
            return
        self.pending.append((marks, deliver))
        self.poll()

    def poll(self) -> int:
        """Deliver every leading cycle whose marks have all completed; returns how many are left."""
        clock, pending = self.clock, self.pending
        while pending:
            marks, deliver = pending[0]
            for m in marks:
                if not clock.ready(m):
                    return len(pending)
            pending.popleft()
            spans = [clock.seconds(a, b) for a, b in zip(marks, marks[1:])]
            clock.release(marks)
            deliver(*spans)
        return 0
