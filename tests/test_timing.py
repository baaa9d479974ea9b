"""Cycle timing (specter/speculative/timing.py): on CUDA a cycle's draft and verify times come from
events on the compute stream, read only once they have completed (no host sync added). Checked on
CPU with stand-in events stamped by a simulated device clock: wall time never enters.

1. CycleTimes delivers a cycle only when all its events have completed, oldest first, in seconds;
   it never waits on an event, and reuses delivered ones.
2. The speculative decoder's stats and governor get the event times, also when the device runs
   behind the host (cycles delivered late, by a later poll or by stats()).
"""
from __future__ import annotations

import pytest

import specter
from specter.speculative.timing import CycleTimes, EventClock, WallClock


class Device:
    """A simulated stream: each recorded event is stamped `step_ms` after the previous one, and has
    completed once `done_ms` has reached its stamp."""

    def __init__(self, step_ms: float = 1.0):
        self.now, self.step, self.done = 0.0, step_ms, float("inf")
        self.made = 0

    def event(self):
        self.made += 1
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, device: Device):
        self.device, self.stamp = device, None

    def record(self):
        d = self.device
        d.now += d.step
        self.stamp = d.now

    def query(self) -> bool:
        return self.stamp <= self.device.done

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.query() and end.query(), "elapsed_time on an event that has not completed"
        return end.stamp - self.stamp  # ms

    def synchronize(self):
        raise AssertionError("a host sync")


def test_cycles_are_delivered_in_order_once_their_events_completed():
    dev = Device(step_ms=2.0)
    times, got = CycleTimes(EventClock(dev.event)), []
    dev.done = 0.0  # the device has run nothing yet
    for i in range(3):
        marks = tuple(times.mark() for _ in range(3))
        times.submit(marks, lambda a, b, i=i: got.append((i, a, b)))
    assert got == [] and times.poll() == 3
    dev.done = 8.0  # the first cycle's three events (2, 4, 6) and the second's first (8)
    assert times.poll() == 2 and got == [(0, 0.002, 0.002)]
    dev.done = float("inf")
    assert times.poll() == 0 and got == [(0, 0.002, 0.002), (1, 0.002, 0.002), (2, 0.002, 0.002)]
    marks = tuple(times.mark() for _ in range(3))  # delivered events are recorded again, not new ones
    assert dev.made == 9
    times.submit(marks, lambda a, b: got.append((3, a, b)))
    assert got[-1] == (3, 0.002, 0.002)


def test_wall_clock_is_ready_at_once():
    times, got = CycleTimes(WallClock()), []
    times.submit((times.mark(), times.mark()), got.append)
    assert len(got) == 1 and got[0] >= 0.0 and times.poll() == 0


@pytest.mark.parametrize("lag", [False, True], ids=["device-done", "device-behind"])
def test_decoder_stats_and_governor_take_the_event_times(tiny, lag):
    """Every mark 1 ms of device time after the last: each speculative cycle drafts in 1 ms and
    verifies in 1 ms, each plain step verifies in 1 ms, whatever the wall clock says."""
    path, _ = tiny("qwen3_moe", eos_token_id=None)
    eng = specter.load(path, device="cpu", policy="specter", residency=0.5)
    dec = eng.decoder
    dev = Device(step_ms=1.0)
    if lag:  # the device completes each event only after the host has recorded four more
        dev.event = _lagging(dev, behind=4)
    dec.times = CycleTimes(EventClock(dev.event))
    dec.governor.fixed = 3
    seen, observe = [], dec.governor.observe_cycle
    def observing(k, m, d, v, *a, **kw):
        seen.append((k > 0, d, v))
        return observe(k, m, d, v, *a, **kw)
    dec.governor.observe_cycle = observing
    try:
        dec.reset_stats()
        eng.generate([1, 5, 9, 33], max_new_tokens=24)
        if lag:
            assert dec.times.pending  # the newest cycles are not readable yet: nothing waited for them
            dev.done = float("inf")
        st = dec.stats()
        assert not dec.times.pending
        spec = sum(v for k, v in st["k_histogram"].items() if k > 0)
        assert spec > 0
        assert st["draft_s"] == pytest.approx(spec * 1e-3)
        assert st["verify_s"] == pytest.approx(st["cycles"] * 1e-3)
        assert len(seen) == st["cycles"]  # every cycle observed once (fixed K: no plain-arm probes)
        assert [(d, v) for _, d, v in seen] == [(pytest.approx(1e-3 if spec else 0.0), pytest.approx(1e-3))
                                                for spec, _, _ in seen]
    finally:
        eng.close()


def _lagging(dev: Device, behind: int):
    make = Device.event.__get__(dev)

    def event():
        e = make()
        record = e.record

        def rec():
            record()
            dev.done = dev.now - behind * dev.step
        e.record = rec
        return e

    dev.done = 0.0
    return event
