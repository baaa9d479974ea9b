"""CudaLink's own Python a copy, on any machine: the link handed a CudaApi whose streams and events do
nothing, the tensors on meta (no byte moves), so what is timed is the link's code and torch's
dispatch of two copy_ calls, not a driver's. On the H200 (2026-12-04) a raw copy cost its issuing
thread 70-160 us; this says how much of that the link's Python could be.

    python bench/experiments/link_issue_cost.py [--copies 20000]
    python bench/experiments/link_issue_cost.py --busy     # the watcher beside a decode thread running Python

Lines (us a copy of a bundled expert's two tensors, best of three batches):
  urgent    copies issued back to back on the urgent stream, each dropped once issued (as the engine
            does), the watcher landing them meanwhile (its work competes for the GIL)
  prefetch  the same on the metered copy stream (held ones issued by the watcher)
  gated     every event held until the whole batch is issued (the watcher idle), the transfers kept
  gated_nogc  the same with the garbage collector off: what is left is the issuing thread's own code

--busy: 200 prefetches of a bundled expert on the metered copy stream (a 4-expert window), each copy
done COPY_S after the previous one on a simulated copy engine (events query done then; synchronize
sleeps until then), while the issuing thread, once they are issued, is idle (waits on the last one),
or runs pure Python (a decode thread's bookkeeping: it keeps the GIL), calling `link.pump()` every
millisecond as the manager does between layers, or never (the link's watcher alone issues the held
ones, and needs the GIL to). ms until the last lands, against the copies' own time.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import threading
import time

import torch

from specter.offload.cuda_link import CudaApi, CudaLink


class _Stream:
    def wait_event(self, event):
        pass

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


class _Event:
    def __init__(self, gate: threading.Event):
        self.gate = gate

    def record(self, stream=None):
        pass

    def query(self):
        return self.gate.is_set()

    def synchronize(self):
        self.gate.wait()

    def elapsed_time(self, other):
        return 0.0


class NullCuda(CudaApi):
    """Streams and events that do nothing; an event completes once `gate` is set."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()

    def device_index(self):
        return 0

    def device_name(self, device):
        return "null"

    def stream(self, device, priority=0):
        return _Stream()

    def event(self, timing=False, blocking=False):
        return _Event(self.gate)

    def current_stream(self, device):
        return _Stream()

    def use(self, stream):
        return contextlib.nullcontext()

    def is_pinned(self, t):
        return True

    def pinned_empty(self, nbytes):
        return torch.empty(nbytes, dtype=torch.uint8)


def timed(link: CudaLink, cuda: NullCuda, copies: int, mode: str) -> float:
    dst, src = ([torch.empty(384, 256, dtype=torch.bfloat16, device="meta"),
                 torch.empty(256, 192, dtype=torch.bfloat16, device="meta")] for _ in range(2))
    urgent = mode != "prefetch"
    best = float("inf")
    for _ in range(3):
        gated = mode.startswith("gated")
        if gated:
            cuda.gate.clear()
        if mode == "gated_nogc":
            gc.disable()
        t0 = time.perf_counter()
        if gated:
            kept = [link.copy(dst, src, urgent=True, after=None) for _ in range(copies)]
        else:
            for _ in range(copies):
                link.copy(dst, src, urgent=urgent, after=None)
        t1 = time.perf_counter()
        gc.enable()
        cuda.gate.set()
        link.synchronize()
        kept = None  # noqa: F841
        best = min(best, (t1 - t0) / copies * 1e6)
    return best


COPY_S = 20e-6  # --busy: a copy's time on the simulated copy engine


class _Engine:
    """--busy: copies done one after another, COPY_S each, in the order their events were recorded."""

    def __init__(self):
        self.free_at, self.lock = 0.0, threading.Lock()

    def schedule(self) -> float:
        with self.lock:
            self.free_at = max(self.free_at, time.perf_counter()) + COPY_S
            return self.free_at


class _TimedEvent:
    def __init__(self, engine: _Engine):
        self.engine, self.at = engine, None

    def record(self, stream=None):
        self.at = self.engine.schedule()

    def query(self):
        return self.at is not None and time.perf_counter() >= self.at

    def synchronize(self):
        if (wait := self.at - time.perf_counter()) > 0:
            time.sleep(wait)

    def elapsed_time(self, other):
        return 0.0


class TimedCuda(NullCuda):
    def __init__(self):
        super().__init__()
        self.engine = _Engine()

    def event(self, timing=False, blocking=False):
        return _TimedEvent(self.engine)


def busy_row(mode: str, n: int = 200) -> dict:
    """ms until n metered prefetches land with the issuing thread `idle`, `busy` (pure Python) or
    `busy_pump` (the same, pump() every millisecond)."""
    expert = 384 * 256 * 2 + 256 * 192 * 2
    link = CudaLink("meta", bandwidth=25e9, cuda=TimedCuda(), window_bytes=4 * expert)
    dst, src = ([torch.empty(384, 256, dtype=torch.bfloat16, device="meta"),
                 torch.empty(256, 192, dtype=torch.bfloat16, device="meta")] for _ in range(2))
    try:
        t0 = time.perf_counter()
        last = [link.copy(dst, src, urgent=False, after=None) for _ in range(n)][-1]
        while mode != "idle" and not last._future.done():
            t = time.perf_counter()
            x = 0
            while time.perf_counter() - t < 1e-3:  # a millisecond of Python between two layers
                for i in range(100):
                    x += i
            if mode == "busy_pump":
                link.pump()
        last._future.result()
        return {"mode": mode, "ms": round((time.perf_counter() - t0) * 1e3, 1), "copies_ms": round(n * COPY_S * 1e3, 1)}
    finally:
        link.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--copies", type=int, default=20000)
    ap.add_argument("--busy", action="store_true", help="prefetches landing beside a busy issuing thread instead")
    args = ap.parse_args(argv)
    if args.busy:
        for mode in ("idle", "busy", "busy_pump", "idle", "busy", "busy_pump"):
            print(json.dumps(busy_row(mode)), flush=True)
        return 0
    cuda = NullCuda()
    link = CudaLink("meta", bandwidth=25e9, cuda=cuda)
    try:
        timed(link, cuda, 200, "urgent")  # warm
        out = {mode: round(timed(link, cuda, args.copies, mode), 1)
               for mode in ("urgent", "prefetch", "gated", "gated_nogc")}
    finally:
        link.close()
    print(json.dumps({"issue_us": out, "copies": args.copies}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
