"""Staging buffers: how CudaLink copies out of a host store that is not pinned.

A CUDA copy from pageable memory is not asynchronous: the driver bounces it through pinned memory of
its own while the host waits. And pinning a copy of each source (`pin_memory()`) would lock a whole
expert per copy, synchronously. So when the store could not be pinned (the host refused, or
SPECTER_PIN_STORE=0), the link owns two pinned buffers, each sized for the largest copy, and uses
them in turn:

    stager thread   wait for buffer i's last copy (its event)  ->  memcpy srcs -> buffer i  ->  enqueue H2D from buffer i
    buffers         0, 1, 0, 1, ...: one fills on the host while the other's copy crosses the bus

The memcpy is host work (one expert's bytes a copy): it runs on the link's stager thread, never on
the thread that queues compute. A buffer is overwritten only after the event recorded on the copy
stream behind the copy that last read it has completed (a host wait on that event, on the stager).
"""
from __future__ import annotations

import collections
import threading
from typing import Callable

import torch

from ..errors import BudgetError
from ..sizes import format_size
from .threads import daemon

_ALIGN = 256  # bytes: every staged tensor starts aligned, so any dtype can view it


def staged_nbytes(srcs: list[torch.Tensor]) -> int:
    """Bytes of a staging buffer that holds `srcs` back to back, each aligned."""
    return sum(aligned(s.nbytes) for s in srcs)  # a coded source (offload/coded.py): its coded bytes


def aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def describe(nbytes: int, count: int = 2) -> str:
    """The host-to-device path through `count` staging buffers of `nbytes`, as plans and stats name it."""
    return f"staging buffers ({count} x {format_size(nbytes)})"


def pinned_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes], page-locked at its exact size (cudaHostRegister, as the store's arena); the
    caching host allocator (which rounds up to a power of two) when the host refuses that."""
    from .store import host_limits, page_aligned, register

    buf = page_aligned(nbytes, torch.uint8)
    if register(buf) is None:
        return buf
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as e:
        raise BudgetError(f"could not pin two {format_size(nbytes)} staging buffers for host-to-device copies "
                          f"({e}; {host_limits()}): raise `ulimit -l` (memlock) or free host memory") from None


class StagingBuffers:
    """`count` pinned buffers of `nbytes`, handed out in turn; each reused only after the event of the
    copy that last read it has completed."""

    def __init__(self, nbytes: int, alloc: Callable[[int], torch.Tensor] = pinned_buffer, count: int = 2):
        self.nbytes, self.count = nbytes, count
        self.buffers = [alloc(nbytes) for _ in range(count)]  # uint8 [nbytes] each, pinned
        self._last = [None] * count                           # the event behind the copy that last read buffer i
        self._turn = 0

    def describe(self) -> str:
        return describe(self.nbytes, self.count)

    def fits(self, srcs: list[torch.Tensor]) -> bool:
        return staged_nbytes(srcs) <= self.nbytes

    def stage(self, srcs: list[torch.Tensor]) -> tuple[int, list[torch.Tensor]]:
        """(i, views): the next buffer in turn, holding a copy of `srcs` (views of it with their
        shapes and dtypes). The host first waits for the copy that last read buffer i."""
        if not self.fits(srcs):
            raise ValueError(f"staging: {staged_nbytes(srcs)} bytes do not fit a {self.nbytes}-byte buffer")
        i, self._turn = self._turn, (self._turn + 1) % self.count
        self._settle(i)
        views, off, buf = [], 0, self.buffers[i]
        for s in srcs:
            n = s.numel() * s.element_size()
            view = buf[off:off + n].view(s.dtype).view(s.shape)
            view.copy_(s)
            views.append(view)
            off += staged_nbytes([s])
        return i, views

    def release(self, i: int, event) -> None:
        """`event` (recorded on the copy stream after the copy that read buffer i) guards its reuse."""
        self._last[i] = event

    def drain(self) -> None:
        """Wait until no copy reads any buffer (before they are dropped or replaced)."""
        for i in range(self.count):
            self._settle(i)

    def _settle(self, i: int) -> None:
        if self._last[i] is not None:
            self._last[i].synchronize()
            self._last[i] = None


class Stager:
    """One thread that runs `work(job)` for each job put, urgent jobs before queued ordinary ones."""

    def __init__(self, work: Callable, name: str):
        self._work = work
        self._cv = threading.Condition()
        self._lanes = (collections.deque(), collections.deque())  # (urgent, normal)
        self._closed = False
        self._thread = daemon(self._run, name, self)

    def put(self, job, urgent: bool) -> None:
        with self._cv:
            self._lanes[0 if urgent else 1].append(job)
            self._cv.notify()

    def close(self) -> None:
        """Run every job already put, then stop."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _next(self):
        with self._cv:
            self._cv.wait_for(lambda: self._lanes[0] or self._lanes[1] or self._closed)
            for lane in self._lanes:
                if lane:
                    return lane.popleft()
            return None  # closed and drained

    def _run(self) -> None:
        while (job := self._next()) is not None:
            self._work(job)


class StagedCopies:
    """A link's staging path: its buffers (`reserve`d up front, or at the first copy that needs them)
    and the stager thread that fills them and hands each copy on to `issue(t, stream, after, views)`,
    which enqueues it and sets `t._event`; `fail(t, busy_s, error)` reports a copy that could not be."""

    def __init__(self, alloc: Callable[[int], torch.Tensor], issue: Callable, fail: Callable, name: str):
        self._alloc, self._issue, self._fail, self._name = alloc, issue, fail, name
        self.buffers: StagingBuffers | None = None
        self._lock = threading.Lock()
        self._stager: Stager | None = None

    def reserve(self, nbytes: int) -> StagingBuffers:
        """The buffers, (re)allocated when a copy of `nbytes` does not fit them."""
        with self._lock:
            if self.buffers is None or self.buffers.nbytes < nbytes:
                if self.buffers is not None:
                    self.buffers.drain()
                self.buffers = StagingBuffers(nbytes, alloc=self._alloc)
            return self.buffers

    def put(self, t, stream, after, urgent: bool) -> None:
        """Stage t (its `_src` pageable) and issue it on `stream` after `after`; sets `t._issued` when done."""
        with self._lock:
            if self._stager is None:
                self._stager = Stager(self._stage, name=f"specter-stager-{self._name}")
            stager = self._stager
        stager.put((t, stream, after), urgent)

    def close(self) -> None:
        """Every copy put so far is on its stream (or failed) when this returns."""
        with self._lock:
            stager = self._stager
        if stager is not None:
            stager.close()

    def _stage(self, job) -> None:  # on the stager thread
        t, stream, after = job
        try:
            buffers = self.reserve(staged_nbytes(t._src))
            i, views = buffers.stage(t._src)
            self._issue(t, stream, after, views)
            buffers.release(i, t._event)
        except Exception as e:  # reported to whoever waits on the transfer
            self._fail(t, busy_s=0.0, error=e)
        finally:
            t._issued.set()
