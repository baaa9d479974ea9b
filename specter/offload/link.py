"""The copy engine: host-to-device copies of expert weights, one after another.

    link = make_link(device)                       # cuda_link.py: CudaLink on CUDA, calibrated EmulatedLink on CPU
    t = link.copy([slot_w13, slot_w2], [host_w13, host_w2], tag=(layer, expert))
    ...                                            # compute keeps going
    t.wait()                                       # or `await t.landed()`, or t.add_done_callback(fn)

CudaLink (cuda_link.py) issues copies on a dedicated stream and hands back events (from the pinned store,
or through two pinned staging buffers of its own when the store is not pinned: staging.py). EmulatedLink is one worker
thread that really copies the bytes and then sleeps until `start + latency + nbytes / bandwidth`,
so a CPU run sees the same copy : compute ratio as the real GPU (see calibrate.py).

A copy converts into the destination's dtype (the store keeps the checkpoint's, the pool the compute
dtype or the store's: offload/plan.py pool_dtype). CUDA stages a converting copy through the device
(the bus carries the stored bytes); the emulated link times a copy by the bytes it writes, the width
its compute was calibrated at, so the copy : compute ratio stays the GPU's.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import concurrent.futures
import contextlib
import threading
import time

import torch

from .threads import daemon


async def poll(ready, spin: float = 2e-3, every: float = 1e-3) -> None:
    """Until ready() (CUDA events are queried from the loop, never synchronised): for `spin` seconds
    give the loop a turn between checks (sleep(0)), then sleep `every` between them (epoll's timeout
    has 1 ms resolution: no finer sleep exists)."""
    if ready():
        return
    spin_until = time.perf_counter() + spin
    while not ready():
        await asyncio.sleep(0 if time.perf_counter() < spin_until else every)


_CHUNK = 32768  # elements per emulated copy_: below ATen's parallel grain, so the worker never starts OpenMP


class Transfer:
    """One host-to-device copy of one or more tensors (dst[i] <- src[i]; a tensor or a list each). Awaitable."""

    def __init__(self, dst, src, tag=None):
        dst = [dst] if isinstance(dst, torch.Tensor) else list(dst)
        src = [src] if isinstance(src, torch.Tensor) else list(src)
        if len(dst) != len(src):
            raise ValueError(f"copy: {len(dst)} destinations for {len(src)} sources")
        self.nbytes = self.dst_nbytes = 0      # bytes read from the host (a CodedExpert's: coded), written
        for d, s in zip(dst, src):
            if d.shape != s.shape:
                raise ValueError(f"copy: shape mismatch, dst {tuple(d.shape)} vs src {tuple(s.shape)}")
            self.nbytes += s.nbytes
            self.dst_nbytes += d.numel() * d.element_size()
        self.tag = tag
        self.t_enqueued = time.perf_counter()  # host clock (s); t_started/t_finished filled in by the link
        self.seconds: float | None = None      # EmulatedLink: the time it is charged (latency included)
        self.counted = True                    # False: left out of the link's stats (EmulatedLink.untimed)
        self.t_started: float | None = None
        self.t_finished: float | None = None
        self._dst, self._src = dst, src        # held until the bytes are in place
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        self._event = None                     # CUDA only: recorded on the copy stream after the copies
        self._device = None
        self._waits = None                     # CUDA only: the link's (compute reached, copy done) pairs, if timed
        self._cuda = None                      # CUDA only: the link's CudaApi (streams and events)
        self._issued = None                    # CUDA, staged or held: a threading.Event set once it is on a stream
        self._hurry = None                     # CUDA, held: puts it on a stream now (CudaLink.hurry)

    def done(self) -> bool:
        if self._event is not None:
            return self._event.query()
        return self._future.done()

    def ready(self) -> bool:
        """`wait()` would not block the host now: on CUDA always (a stream wait), else once complete."""
        return self._event is not None or self._future.done()

    def wait(self) -> float:
        """Block until the bytes are in place; seconds spent waiting. CUDA: a stream wait, no host sync,
        so it returns 0 and the device-side stall is measured by events (`CudaLink.drain_stall_s`); a
        staged copy the link's stager has not issued yet is first waited for on the host (timed)."""
        if self._issued is not None and not self._issued.is_set():
            t0 = time.perf_counter()
            if self._hurry is not None:  # held behind other prefetches: it goes first, on the urgent lane
                self._hurry(self)
            self._issued.wait()
            return self.wait() + time.perf_counter() - t0
        if self._event is not None:
            stream = self._cuda.current_stream(self._device)
            if self._waits is not None:  # timed: compute got here; it stalls until the copy's event
                reached = self._cuda.event(timing=True)
                reached.record(stream)
                self._waits.append((reached, self._event))
            stream.wait_event(self._event)
            return 0.0
        if self._future.done():
            self._future.result()  # re-raise a failed copy
            return 0.0
        t0 = time.perf_counter()
        self._future.result()
        return time.perf_counter() - t0

    async def landed(self) -> float:
        """`wait` for asyncio code: seconds from this call until the bytes are in place, the loop free
        meanwhile. CUDA: `wait`'s stream wait (compute is ordered after the copy on the device; nothing
        blocks, so 0 here, the stall measured by events as in `wait`). Emulated: the link's thread
        completes an asyncio future (call_soon_threadsafe) and the stall is the time until this
        coroutine resumes, as `wait`'s is the time until its thread does (then `wait`, which no longer
        blocks: a host job's rows are on the device only after its stream wait)."""
        if self.ready():
            return self.wait()
        t0 = time.perf_counter()
        await self._loop_future()
        return self.wait() + time.perf_counter() - t0

    def __await__(self):
        """`await t` -> t, once the copy has completed on the host's view: the emulated link's future;
        on CUDA the copy's event, queried from the loop with a backoff (never synchronised)."""
        if self._event is not None:
            return self._polled().__await__()
        return self._loop_future().__await__()

    async def _polled(self) -> Transfer:
        await poll(self._event.query)
        return self

    def _loop_future(self) -> asyncio.Future:
        """A future of the running loop that the link's thread completes. Cancelling it (its awaiter
        was cancelled) leaves the copy alone: it lands, and the manager marks it ready later."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def settle() -> None:
            if fut.cancelled():
                return
            if self._future.cancelled():
                fut.cancel()
            elif (error := self._future.exception()) is not None:
                fut.set_exception(error)
            else:
                fut.set_result(self)

        def done(_) -> None:  # on the link's thread
            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the loop has closed: nobody is waiting
                pass

        self._future.add_done_callback(done)
        return fut

    def add_done_callback(self, fn) -> None:
        """fn(transfer), once, when complete (from the link's thread, or now if already complete)."""
        self._future.add_done_callback(lambda _: fn(self))

    def failed(self) -> bool:
        """Completed with an error (the waiter gets it): its destination holds no valid bytes."""
        f = self._future
        return f.done() and not f.cancelled() and f.exception() is not None

    def cancelled(self) -> bool:
        """Withdrawn by `Link.cancel` before it started: it never wrote its destination."""
        return self._future.cancelled()

    def _finish(self, error: BaseException | None = None) -> None:
        self.t_finished = time.perf_counter()
        self._dst = self._src = None
        if error is None:
            self._future.set_result(None)
        else:
            self._future.set_exception(error)

    def __repr__(self) -> str:
        state = "cancelled" if self.cancelled() else "done" if self._future.done() else "pending"
        return f"Transfer(tag={self.tag!r}, nbytes={self.nbytes}, {state})"


class Link(abc.ABC):
    """Base: a FIFO copy engine with an urgent lane, counters and a clean shutdown."""

    name: str
    bandwidth: float  # bytes/s
    latency: float    # s per transfer

    def __init__(self, name: str, bandwidth: float, latency: float):
        self.name, self.bandwidth, self.latency = name, float(bandwidth), float(latency)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified whenever a transfer completes
        self._pending = 0                             # queued + in flight
        self._closed = False
        self.stats = {"transfers": 0, "bytes": 0, "busy_s": 0.0}

    @abc.abstractmethod
    def copy(self, dst, src, *, urgent: bool = False, tag=None, after="all") -> Transfer:
        """Enqueue copying src[i] into dst[i]; urgent copies go ahead of queued ordinary ones.
        `after` orders the copy after device work that may still read dst: "all" (everything queued
        on the current stream), an event from `read_event()` (the destination's last reader), or
        None (nothing reads it). Only CUDA needs it: CPU compute has finished when copy() is called."""

    def read_event(self):
        """A marker, recorded now on the compute stream, that copies can be ordered `after` (CUDA);
        None where compute is synchronous (CPU)."""
        return None

    coalesces = False  # one transfer may carry several experts' tensors (the manager coalesces a call's misses)
    h2d_path = "emulated (host memory)"  # how bytes reach the device: CudaLink says pinned store or staging

    def prepare(self, srcs: list[torch.Tensor], nbytes: int) -> None:
        """Copies will come out of `srcs`, at most `nbytes` each (CudaLink sets up staging if they are
        not pinned); nothing to do here."""

    def cancel(self, t: Transfer) -> bool:
        """Withdraw `t` if it has not started: True when it never will write its destination (it
        resolves cancelled; pending() drops), False when it has started or landed (it completes as
        usual). This base answers False: a copy the link has handed on cannot be recalled."""
        return False

    def untimed(self):
        """A context whose copies are not the link's to emulate (the load's warm-up: EmulatedLink lands them
        at once, uncounted); a real link's copies take what they take."""
        return contextlib.nullcontext()

    def pump(self) -> None:
        """Move copies along on the calling thread where the link would otherwise wait for one of its
        own threads (CudaLink: held prefetches; the manager calls it between layers); nothing here."""

    def copy_seconds(self, nbytes: int) -> float:
        """Seconds one copy of `nbytes` takes: the measured busy time per byte once there is any, times
        nbytes (a transfer of one expert: its time; of several, coalesced: each its share of one fixed
        cost), else the nominal latency + nbytes / bandwidth."""
        st = self.stats
        if st["bytes"] and st["busy_s"] > 0:
            return st["busy_s"] * nbytes / st["bytes"]
        return nbytes / self.bandwidth + self.latency

    def pending(self) -> int:
        with self._lock:
            return self._pending

    def synchronize(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def reset_stats(self) -> None:
        with self._lock:
            self.stats.update(transfers=0, bytes=0, busy_s=0.0)

    def drain_stall_s(self) -> float:
        """Device-side seconds compute spent waiting on copies since the last call, where the host
        cannot see them (CUDA); 0 for links whose waits block the host and are timed there."""
        return 0.0

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.bandwidth / 1e9:.4g} GB/s, {self.latency * 1e6:.3g} us)"

    # --- helpers for subclasses
    def _complete(self, t: Transfer, busy_s: float, error: BaseException | None = None) -> None:
        t._finish(error)  # done() turns True and callbacks run before pending() drops
        with self._lock:
            if t.counted:
                self.stats["transfers"] += 1
                self.stats["bytes"] += t.nbytes
                self.stats["busy_s"] += busy_s
            self._pending -= 1
            self._idle.notify_all()


class EmulatedLink(Link):
    """A PCIe link played by one sleeping worker thread.

    Transfers complete one after another in queue order (urgent ones before any not yet started),
    each no sooner than start + latency + nbytes / bandwidth, start = max(enqueue, previous
    completion). The worker copies the bytes and then sleeps out the rest of the time.
    `clock` (tests): an object with now() -> seconds and sleep(seconds, wake: threading.Event) ->
    True if woken, read and slept on instead of the wall clock, so a test can check the schedule
    without the machine's load in it.
    """

    def __init__(self, bandwidth: float, latency: float = 0.0, name: str = "emulated", clock=None,
                 decode_bandwidth: float | None = None):
        if not bandwidth > 0 or not latency >= 0:
            raise ValueError(f"EmulatedLink needs bandwidth > 0 and latency >= 0, got {bandwidth}, {latency}")
        super().__init__(name, bandwidth, latency)
        self.coalesces = True  # a transfer of many tensors is charged one latency
        self.decode_bandwidth = decode_bandwidth  # bytes/s a coded expert's decode moves (None: free)
        self._now = clock.now if clock is not None else time.perf_counter
        self._sleep = clock.sleep if clock is not None else (lambda seconds, wake: wake.wait(seconds))
        self._work = threading.Condition(self._lock)   # notified on copy() and close()
        self._normal: collections.deque[Transfer] = collections.deque()
        self._urgent: collections.deque[Transfer] = collections.deque()
        self._closing = threading.Event()              # cuts the worker's sleep short
        self._untimed = False                          # copies land without their emulated time (untimed)
        self._worker = daemon(self._run, f"specter-link-{name}", self)

    def copy(self, dst, src, *, urgent: bool = False, tag=None, after="all") -> Transfer:
        t = Transfer(dst, src, tag)
        t.t_enqueued = self._now()
        t.seconds = 0.0 if self._untimed else self.seconds(t._dst, t._src)
        t.counted = not self._untimed
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: copy() on a closed link")
            self._pending += 1  # queued + in flight
            (self._urgent if urgent else self._normal).append(t)
            self._work.notify()
        return t

    def seconds(self, dst: list[torch.Tensor], src: list) -> float:
        """The emulated time of copying src into dst: latency + the bytes written / bandwidth (the width
        compute was calibrated at). A coded source (a CodedExpert) is charged its coded bytes instead,
        scaled by the same width, plus its decode: the coded bytes read and the bf16 bytes written at
        `decode_bandwidth` (make_link: the profile's device memory bandwidth, scaled like the link)."""
        wire = decode = 0.0
        for d, s in zip(dst, src):
            raw = getattr(s, "raw_nbytes", None)
            if raw is None:
                wire += d.numel() * d.element_size()
                continue
            width = d.numel() * d.element_size() / raw  # 2 for an fp32 slot of bf16 weights, 1 for bf16
            wire += s.nbytes * width
            if self.decode_bandwidth and getattr(s, "decodes", True):  # a tier fill decodes later (coded_tier.Fill)
                decode += (s.nbytes + raw) * width / self.decode_bandwidth
        return self.latency + wire / self.bandwidth + decode

    @contextlib.contextmanager
    def untimed(self):
        """Copies issued inside (by the calling thread) are made as soon as the worker reaches them, with no
        emulated time, and left out of the stats. The load's warm-up fills the slot pool this way: the
        emulated bandwidth is scaled to this CPU's compute (some 100x below a real link's), which would
        make a load sleep ~10 s a GB of pool for copies a GPU makes at 25 GB/s, or (an aliased pool) none."""
        self._untimed = True
        try:
            yield self
        finally:
            self._untimed = False

    def cancel(self, t: Transfer) -> bool:
        with self._lock:  # the worker pops under this lock: a queued transfer has not started
            for lane in (self._normal, self._urgent):
                if t in lane:
                    lane.remove(t)
                    break
            else:
                return False
            self._pending -= 1
            self._idle.notify_all()
        t._dst = t._src = None
        t._future.cancel()  # never set running, so this always succeeds; done() turns True
        return True

    def close(self) -> None:
        """Stop accepting copies; queued ones still land (bytes copied, no more sleeping); join."""
        with self._lock:
            self._closed = True
            self._work.notify()
        self._closing.set()
        if self._worker is not threading.current_thread():
            self._worker.join()

    def _next(self) -> Transfer | None:
        with self._work:
            self._work.wait_for(lambda: self._urgent or self._normal or self._closed)
            if self._urgent:
                return self._urgent.popleft()
            if self._normal:
                return self._normal.popleft()
            return None  # closed and drained

    def _run(self) -> None:
        deadline = 0.0  # emulated completion time of the previous transfer (perf_counter s)
        last_end = 0.0  # actual completion time of the previous transfer
        while (t := self._next()) is not None:
            start = max(t.t_enqueued, deadline)
            deadline = start + t.seconds
            t.t_started = self._now()
            error = None
            try:
                with torch.no_grad():  # slots may be nn.Parameters
                    for d, s in zip(t._dst, t._src):
                        _copy_serial(d, s)
            except Exception as e:  # reported to whoever waits on the transfer
                error = e
            while (left := deadline - self._now()) > 0:
                if self._sleep(left, self._closing):  # sleeps; returns True at once when closing
                    break
            end = self._now()
            self._complete(t, busy_s=end - max(start, last_end), error=error)
            last_end = end


def _copy_serial(d: torch.Tensor, s) -> None:
    """d.copy_(s) (converting dtype) in chunks small enough that ATen stays on this one thread. A meta
    destination (an aliased CPU pool, see manager.py) has no bytes to write: the copy is only timed.
    A coded source (offload/coded.py) is decoded into d (the torch decode)."""
    if d.is_meta:
        return
    if not isinstance(s, torch.Tensor):
        s.decode_into(d)
        return
    if d.is_contiguous() and s.is_contiguous() and d.numel() > _CHUNK:
        d, s = d.view(-1), s.view(-1)
        for i in range(0, d.numel(), _CHUNK):
            d[i:i + _CHUNK].copy_(s[i:i + _CHUNK])
    else:
        d.copy_(s)
