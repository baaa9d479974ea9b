"""The CUDA copy engine, and `make_link`, which picks it or the calibrated emulated link (link.py).

    link = make_link(device)       # CudaLink on CUDA, an EmulatedLink calibrated to this CPU elsewhere
"""
from __future__ import annotations

import collections
import math
import os
import queue
import threading
import time

import torch

from specter.errors import ConfigError, warn
from specter.offload.calibrate import (emulated_link_params, load_profile, measure_expert_throughput,
                                       profile_for_gpu)
from specter.offload.link import EmulatedLink, Link, Transfer
from specter.offload.staging import StagedCopies, pinned_buffer
from specter.offload.store import is_locked
from specter.offload.threads import daemon


class CudaApi:
    """The CUDA calls CudaLink makes, in one place, so that tests can hand it a fake that logs the
    ordering (which stream waits on what) on a machine without a GPU (tests/test_link.py)."""

    def device_index(self) -> int:
        return torch.cuda.current_device()

    def device_name(self, device) -> str:
        return torch.cuda.get_device_name(device)

    def stream(self, device, priority: int = 0):
        return torch.cuda.Stream(device, priority=priority)

    def event(self, timing: bool = False, blocking: bool = False):
        return torch.cuda.Event(enable_timing=timing, blocking=blocking)

    def current_stream(self, device):
        return torch.cuda.current_stream(device)

    def use(self, stream):
        """Context manager: `stream` is the current stream inside it."""
        return torch.cuda.stream(stream)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return is_locked(t)  # not t.is_pinned(): that misses a store pinned in place (store.py)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """uint8 [nbytes] of page-locked host memory (a staging buffer)."""
        return pinned_buffer(nbytes)

    def pinned_empty_like(self, t: torch.Tensor) -> torch.Tensor:
        """An empty host tensor of t's shape and dtype, page-locked (the caching host allocator: the
        host lane's activations and rows, a few KB a job)."""
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


class CudaLink(Link):
    """Copies on dedicated CUDA streams from pinned host memory; one event per transfer.

    Prefetches go on one copy stream, in order; `urgent` copies (a miss verification waits for) on
    a second stream of the highest priority. Priority does not reorder copies: the copy engines
    serve host-to-device copies in the order they were queued, whatever their stream. So the
    prefetch lane is metered: at most `window_bytes` of prefetches (and at least two) are on the
    copy stream at a time, the rest held here in FIFO order and issued by the watcher thread as
    earlier ones complete. An urgent copy is never held: it queues behind at most that window,
    never the whole backlog (EmulatedLink's "urgent ones before any not yet started").
    Each copy waits (on the GPU) only for what `after` names: the last reader of its destination
    slot (an event from `read_event`; the manager starts each slot at an event recorded after the
    pool's allocation), nothing (None), or by default ("all") all work queued so far on the current
    stream, captured at copy() (a held copy waits on that same event once issued). A small host
    thread a stream resolves its transfers' futures (for await / callbacks / stats) in issue order;
    the copy stream's also issues held prefetches, so an urgent copy whose `after` is long (compute
    queued far ahead) never holds up the prefetches landing behind it. So does whoever calls `pump()`
    or `copy()` (the manager pumps between layers), counting out the copies whose events query done:
    a watcher woken by a landing needs the GIL, which a decode thread running Python keeps.

    A source that is not pinned (the store could not be pinned, or SPECTER_PIN_STORE=0) goes through
    two pinned staging buffers the link owns (staging.py): a stager thread copies it into the next
    buffer once that buffer's previous copy has completed, then enqueues the copy from there. Until
    then the transfer has no event, and `wait()` first waits on the host for the stager. `h2d_path`
    names the path in use: "pinned store" or "staging buffers (2 x N)". Staged copies are not
    metered here: the two buffers already keep at most two of them on the streams.

    A held transfer has no event either (`t._issued` is set once it is on a stream): `wait()` on it
    first puts it on the urgent stream (`hurry`: needed now, it goes ahead of the guesses held before
    it). `cancel` withdraws a held prefetch (it resolves cancelled); a copy already on a stream
    cannot be withdrawn (False: it lands and is marked ready as usual).
    """

    def __init__(self, device, bandwidth: float | None = None, latency: float = 10e-6, name: str = "cuda",
                 cuda: CudaApi | None = None, window_bytes: float | None = None):
        self._cuda = cuda = cuda or CudaApi()
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", cuda.device_index())
        if bandwidth is None:
            profile = profile_for_gpu(cuda.device_name(self.device))
            bandwidth = load_profile(profile).pcie_bandwidth  # nominal; unknown GPU -> default profile
        super().__init__(name, bandwidth, latency)
        self.stream = cuda.stream(self.device)
        self.urgent_stream = cuda.stream(self.device, priority=-100)  # clamped to the highest priority
        self._waits: collections.deque = collections.deque()  # (compute reached the wait, copy done) events
        self._stall_s = 0.0
        self._warned_unpinned = False
        # The prefetch window: ~150 us of the nominal bandwidth, so that while the watcher wakes up to
        # issue the next held copy the link still has bytes to move (tiny experts would idle it with a
        # window of two); large experts go two at a time (the floor), so a miss waits for <= 2 of them.
        self.window_bytes = self.bandwidth * 150e-6 if window_bytes is None else float(window_bytes)
        self._held: collections.OrderedDict = collections.OrderedDict()  # Transfer -> (after, src), FIFO
        self._flying: dict = {}    # prefetches on self.stream, not yet completed, in issue order (guarded by _lock)
        self._flying_bytes = 0     # their bytes
        self._hurrying = 0         # held prefetches a waiter took out, not yet on the urgent stream
        self._releasing = threading.Lock()  # one thread at a time issues held prefetches (_release)
        self._staged = StagedCopies(cuda.pinned_empty, self._issue, self._complete, name)  # unpinned sources
        # One watcher a stream, each waiting for its stream's transfers in issue order: an urgent copy
        # waiting on a long `after` never delays the landing of the prefetches (nor the release of held ones).
        self._watch: queue.SimpleQueue = queue.SimpleQueue()         # the copy stream's
        self._watch_urgent: queue.SimpleQueue = queue.SimpleQueue()  # the urgent stream's
        self._watcher = daemon(self._run, f"specter-link-{name}", self)
        self._urgent_watcher = daemon(self._run_urgent, f"specter-link-{name}-urgent", self)

    def read_event(self):
        ev = self._cuda.event()
        ev.record(self._cuda.current_stream(self.device))
        return ev

    def prepare(self, srcs: list[torch.Tensor], nbytes: int) -> None:
        """Copies will come out of `srcs` (the host store), `nbytes` at most each: if any is not pinned,
        the staging buffers are allocated now, sized for that, rather than at the first copy (and no
        warning: the store said why it is not pinned, and `h2d_path` names the path)."""
        srcs = [s for s in srcs if isinstance(s, torch.Tensor)]  # coded sources go direct (see _issue)
        if not all(s.is_cuda or self._cuda.is_pinned(s) for s in srcs):
            self._warned_unpinned = True
            self._staged.reserve(nbytes)

    @property
    def coalesces(self) -> bool:
        """Several experts in one transfer (one event) from a pinned store; a staged copy holds one expert."""
        return self._staged.buffers is None

    @property
    def h2d_path(self) -> str:
        return "pinned store" if self._staged.buffers is None else self._staged.buffers.describe()

    def copy(self, dst, src, *, urgent: bool = False, tag=None, after="all") -> Transfer:
        t = Transfer(dst, src, tag)  # checks the pairs
        src = t._src
        t._device, t._waits, t._cuda = self.device, self._waits, self._cuda
        if self._closed:
            raise RuntimeError(f"{self.name}: copy() on a closed link")
        if len(self._waits) > 256:  # keep the event backlog short between stats() calls
            self._collect_stalls()
        if isinstance(after, str):  # "all": whatever compute has queued so far may still read dst
            after = self.read_event()
        if self._held and not urgent:  # older held prefetches whose room has come go first, then this one
            self.pump()
        stream = self.urgent_stream if urgent else self.stream
        pinned = all(not isinstance(s, torch.Tensor) or s.is_cuda or self._cuda.is_pinned(s) for s in src)
        if not pinned:
            self._warn_unpinned()
            t._issued = threading.Event()  # set by the stager once the copy is on its stream
        with self._lock:
            if self._closed:  # closed meanwhile
                raise RuntimeError(f"{self.name}: copy() on a closed link")
            self._pending += 1  # queued + in flight
            metered = pinned and not urgent
            if metered and (self._held or not self._room(t.nbytes)):
                t._issued = threading.Event()  # set by the watcher once the copy is on its stream
                t._hurry = self.hurry
                self._held[t] = (after, src)
                return t
            if metered:
                self._fly(t)
        if not pinned:
            self._staged.put(t, stream, after, urgent)
            return t
        try:
            self._issue(t, stream, after, src)
        except BaseException:
            with self._lock:  # never enqueued: not pending
                self._pending -= 1
                self._land(t)
                self._idle.notify_all()
            raise
        if urgent and self._held:  # held prefetches whose room has come, behind this copy
            self.pump()
        return t

    # --- the prefetch window (all under self._lock)
    def _room(self, nbytes: int) -> bool:
        """Whether a prefetch of `nbytes` may go on the copy stream now."""
        return len(self._flying) < 2 or self._flying_bytes + nbytes <= self.window_bytes

    def _fly(self, t: Transfer) -> None:
        self._flying[t] = None
        self._flying_bytes += t.nbytes

    def _land(self, t: Transfer) -> None:
        if t in self._flying:
            del self._flying[t]
            self._flying_bytes -= t.nbytes

    def _release(self) -> None:
        """Issue held prefetches, oldest first, while the window has room (the watcher, or pump's
        caller: one at a time, so that they reach the copy stream in FIFO order)."""
        with self._releasing:
            while True:
                with self._lock:
                    if not self._held or not self._room(next(iter(self._held)).nbytes):
                        return
                    t, (after, src) = self._held.popitem(last=False)
                    self._fly(t)
                self._unhold(t, self.stream, after, src)

    def pump(self) -> None:
        """Held prefetches go on the copy stream from the calling thread as the window has room, every
        flying prefetch whose event has completed (a query, no wait) no longer counted in it. Else only
        the watcher issues them, once it has landed one, and a caller that keeps the GIL (the decode
        thread's Python between its torch calls) keeps it from doing so: the copy stream idles with
        prefetches held (bench/experiments/link_issue_cost.py --busy)."""
        if not self._held:  # a hint read without the lock: a prefetch held meanwhile waits for the next call
            return
        with self._lock:  # a stream completes its copies in order: query the oldest until one is not done
            for t in list(self._flying):
                if t._event is None or not t._event.query():
                    break
                self._land(t)  # the watcher's own _land later finds it gone (it still resolves the future)
        self._release()

    def hurry(self, t: Transfer) -> None:
        """Someone waits for held prefetch t: it leaves the FIFO for the urgent stream now, ahead of
        the prefetches still held (those it was queued behind are guesses; this one is needed)."""
        with self._lock:
            held = self._held.pop(t, None)
            self._hurrying += held is not None
        if held is not None:  # else issued or cancelled meanwhile
            try:
                self._unhold(t, self.urgent_stream, *held)
            finally:
                with self._lock:
                    self._hurrying -= 1

    def _unhold(self, t: Transfer, stream, after, src) -> None:
        """Put held transfer t on `stream` (a failure goes to whoever waits on it); its waiters wake."""
        try:
            self._issue(t, stream, after, src)
        except Exception as e:
            with self._lock:
                self._land(t)
            self._complete(t, busy_s=0.0, error=e)
        finally:
            t._issued.set()

    def cancel(self, t: Transfer) -> bool:
        """Withdraw a held prefetch (never issued: it resolves cancelled); False for any other."""
        with self._lock:
            if self._held.pop(t, None) is None:
                return False
            self._pending -= 1
            self._idle.notify_all()
        t._dst = t._src = None
        t._future.cancel()  # never set running, so this always succeeds; done() turns True
        t._issued.set()     # a waiter wakes to the cancelled future
        return True

    def _issue(self, t: Transfer, stream, after, src: list[torch.Tensor]) -> None:
        """Enqueue t's copies from `src` (pinned) on `stream`, after the event `after` (None: at once; a
        list: each, the last readers of a coalesced copy's slots)."""
        begin = self._cuda.event(timing=True)
        done = self._cuda.event(timing=True, blocking=True)  # blocking: the watcher sleeps
        with torch.no_grad(), self._cuda.use(stream):
            for ev in after if isinstance(after, list) else () if after is None else (after,):
                stream.wait_event(ev)
            begin.record(stream)
            coded = not isinstance(src[0], torch.Tensor)  # a store is all raw or all coded (offload/coded.py:
            if coded:                                       # its bytes cross the bus, then decode into the slots)
                type(src[0]).decode_all_on(t._dst, src)
            for d, s in () if coded else zip(t._dst, src):
                if d.dtype != s.dtype:  # the stored bytes cross the bus, then convert on the device
                    staged = torch.empty(s.shape, dtype=s.dtype, device=self.device)
                    staged.copy_(s, non_blocking=True)
                    s = staged
                d.copy_(s, non_blocking=True)
                if d.is_cuda:
                    d.record_stream(stream)
            done.record(stream)
        t._event = done  # only now: a transfer with an event is on a stream
        t.t_started = time.perf_counter()
        (self._watch_urgent if stream is self.urgent_stream else self._watch).put((t, begin))

    def _warn_unpinned(self) -> None:
        if not self._warned_unpinned:
            self._warned_unpinned = True
            warn("CudaLink: source tensor is not pinned; copies go through two pinned staging buffers "
                 "(slower). Keep the expert store in pinned memory.")

    def _run(self) -> None:
        """The copy stream's watcher: resolves its transfers as they land and issues held prefetches."""
        while True:
            item = self._watch.get()
            if item is None:  # close(): stop once nothing is held, being hurried or queued behind this marker
                self._release()
                if self._held or self._hurrying or not self._watch.empty():
                    if self._watch.empty():
                        time.sleep(1e-4)  # a waiter is putting a hurried one on the urgent stream
                    self._watch.put(None)
                    continue
                return
            self._landed(*item)
            self._release()

    def _run_urgent(self) -> None:
        """The urgent stream's watcher. At close it stops after the copy stream's watcher (a held
        prefetch can be hurried onto the urgent stream until that one has issued them all)."""
        while True:
            item = self._watch_urgent.get()
            if item is not None:
                self._landed(*item)
                continue
            self._watcher.join()
            while not self._watch_urgent.empty():  # what was hurried meanwhile
                if (item := self._watch_urgent.get()) is not None:
                    self._landed(*item)
            return

    def _landed(self, t: Transfer, begin) -> None:
        t._event.synchronize()
        with self._lock:
            self._land(t)
        self._complete(t, busy_s=begin.elapsed_time(t._event) / 1e3)

    def synchronize(self) -> None:
        self.stream.synchronize()
        self.urgent_stream.synchronize()
        super().synchronize()

    def drain_stall_s(self) -> float:
        """Seconds compute stalled on copies since the last call, over the waits whose events have
        completed (queried, never synchronised; later ones count next time)."""
        self._collect_stalls()
        total, self._stall_s = self._stall_s, 0.0
        return total

    def _collect_stalls(self) -> None:
        # a wait stalls from when compute reached it until the copy's event (0 if it had landed)
        waits = self._waits
        while waits and waits[0][0].query() and waits[0][1].query():
            reached, done = waits.popleft()
            self._stall_s += max(0.0, reached.elapsed_time(done)) / 1e3

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._staged.close()  # every staged copy is on its stream first
        self._watch.put(None)  # the watchers resolve every transfer queued and held, then stop
        self._watch_urgent.put(None)
        me = threading.current_thread()
        if me is not self._watcher:  # the urgent watcher stops after the copy stream's: never wait for it there
            for watcher in (self._watcher, self._urgent_watcher):
                if watcher is not me:
                    watcher.join()


def make_link(device, profile: str | None = None, *, expert_bytes: int | None = None,
              calibration=None) -> Link:
    """The link for `device`.

    cuda: a CudaLink (nominal bandwidth/latency from `profile`, else the profile matching the GPU).
    cpu:  an EmulatedLink whose bandwidth/latency are the profile's (default A100-40GB-PCIe4) scaled
          by this machine's expert throughput. `calibration` is that throughput in bytes/s (float),
          or the expert shape to measure it with: (hidden, intermediate[, dtype]) or a dict of
          measure_expert_throughput kwargs. Without it, a square fp32 expert of `expert_bytes`
          (default 12 MiB) is measured.
    """
    device = torch.device(device)
    if device.type == "cuda":
        p = load_profile(profile) if profile else None
        return CudaLink(device, bandwidth=p.pcie_bandwidth if p else None, latency=p.latency if p else 10e-6)
    if device.type != "cpu":
        raise ValueError(f"make_link: unsupported device {device}")
    p = load_profile(profile)
    throughput = _expert_throughput(calibration, expert_bytes)
    bandwidth, latency = emulated_link_params(p, throughput)
    link = EmulatedLink(bandwidth, latency, name=f"emulated:{p.name}")
    link.profile, link.expert_throughput = p, throughput
    link.time_scale = p.device_memory_bandwidth / throughput  # seconds here per second on the GPU
    link.decode_bandwidth = p.device_memory_bandwidth / link.time_scale  # coded experts decode at memory speed
    return link


def _expert_throughput(calibration, expert_bytes: int | None) -> float:
    if isinstance(calibration, (int, float)):
        return float(calibration)
    if (pinned := pinned_throughput()) is not None:  # one measurement for every process a bench starts
        return _measured(pinned, pinned=True)
    if isinstance(calibration, dict):
        return _measured(measure_expert_throughput(**calibration))
    if isinstance(calibration, (tuple, list)):
        return _measured(measure_expert_throughput(*calibration))
    if calibration is not None:
        raise TypeError(f"make_link: calibration must be a throughput, a shape or a dict, not {calibration!r}")
    side = max(16, math.isqrt((expert_bytes or 12 << 20) // 12))  # 3 * H * I * 4 bytes with H = I
    return _measured(measure_expert_throughput(side, side))


SLOW_CALIBRATION = 1e8  # B/s of expert compute: this 2-core box measures 1-2.5 GB/s on a tiny test model's experts,
                        # 10-25 on real shapes, 0.6 under a busy CI; 0.02-0.05 oversubscribed (a QA pass)


def pinned_throughput() -> float | None:
    """$SPECTER_EXPERT_THROUGHPUT (bytes/s of expert compute) as a number, None when unset; a ConfigError for
    a value that is not a positive number."""
    raw = os.environ.get("SPECTER_EXPERT_THROUGHPUT")
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"SPECTER_EXPERT_THROUGHPUT must be a number of bytes/s > 0 (e.g. 6.8e9, `specter profile`'s "
                          f"GB/s x 1e9), got {raw!r}")
    return value


def _measured(throughput: float, pinned: bool = False) -> float:
    """A measured throughput, warned about when it is implausibly slow: the link is emulated that much slower for
    the engine's life (a QA pass saw 0.05 GB/s at a busy load, a second a copy, a run that looked hung); a pinned
    one only below 1 MB/s: 6.84, `specter profile`'s GB/s given as bytes/s, emulated a copy in hours, silently."""
    slower = "every copy on the emulated link is that much slower for this engine's life"
    if pinned and throughput < 1e6:  # (the user's own figure, warned only where it must be GB/s given as bytes/s)
        warn(f"SPECTER_EXPERT_THROUGHPUT pins only {throughput:.3g} bytes/s of expert compute: {slower}; it is in "
             f"bytes/s (the GB/s `specter profile` prints x 1e9)")
    elif throughput < SLOW_CALIBRATION and not pinned:
        warn(f"this CPU measured only {throughput / 1e9:.2g} GB/s of expert compute at load (a busy machine?): "
             f"{slower}; rerun on a quieter box or pin it with SPECTER_EXPERT_THROUGHPUT in bytes/s (the GB/s "
             f"`specter profile` prints x 1e9)")
    return throughput
