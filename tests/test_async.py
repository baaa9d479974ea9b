"""The asyncio driver (specter/sansio.py): one body per computation, driven blocking or on an event loop.

1. Bodies: `drive` and `adrive` give the same results; an error resolving an op is thrown into the
   body where it waited; closing an iterated body runs its cleanup.
2. Offload manager: `await mgr.acall(...)` computes exactly what `mgr(...)` does, the loop keeps running
   (another task ticks) while a copy is in flight, the stall is counted, a failing copy raises
   from the await and leaves the manager and the link usable.
3. Decoders: `arun` commits exactly `run`'s greedy tokens, which are plain (resident) decoding's, for
   on-demand, spec-lru and specter (fp32, tiny checkpoint); the planner task plans while the draft
   runs (copies issued before verification starts); an exception in the planner task, or a failing
   copy, surfaces from the generation and leaves no task and no hung loop; cancelling the consumer
   leaves the engine able to generate the same tokens again.
4. Engine: `astream` on the caller's running loop (driver="async") gives `stream`'s text, and two
   concurrent astreams on one loop take turns.

No timing asserts: tick counts and orders only.
"""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import specter
import specter.builder as builder
from specter import sansio
from specter.moe import ExpertWeights
from specter.offload.link import EmulatedLink
from specter.offload.manager import OffloadedExperts
from specter.sampling import SamplingParams

PROMPTS = [[1, 5, 9, 33, 2], [100, 3, 64, 12, 90, 45, 8]]
NEW = 24


# ------------------------------------------------------------------------------------------- bodies
class _Op:
    def __init__(self, value, error=None):
        self.value, self.error = value, error

    def wait(self):
        if self.error is not None:
            raise self.error
        return self.value

    async def landed(self):
        await asyncio.sleep(0)
        return self.wait()


def _body(log):
    a = yield _Op(2)
    yield sansio.Emit(a)
    try:
        yield _Op(None, ValueError("copy failed"))
    except ValueError as e:
        log.append(f"caught {e}")
    b = yield _Op(3)
    try:
        yield sansio.Emit(a * b)
    finally:
        log.append("cleanup")
    return a + b


def test_drivers_agree_and_throw_errors_into_the_body():
    log = []
    assert sansio.drive(_body(log), resolve=lambda op: None if isinstance(op, sansio.Emit) else op.wait()) == 5
    assert log == ["caught copy failed", "cleanup"]

    log = []
    assert list(sansio.iterate(_body(log))) == [2, 6]
    assert log == ["caught copy failed", "cleanup"]

    async def collect(stop_after=None):
        out = []
        async for v in sansio.aiterate(_body(log)):
            out.append(v)
            if len(out) == stop_after:
                break
        return out

    log = []
    assert asyncio.run(collect()) == [2, 6]
    assert log == ["caught copy failed", "cleanup"]
    log = []
    it = sansio.iterate(_body(log))
    assert next(it) == 2 and next(it) == 6
    it.close()  # the consumer leaves at the second value: the body's cleanup runs
    assert log == ["caught copy failed", "cleanup"]


# ------------------------------------------------------------------------------------------ manager
def make_store(L=2, E=8, H=32, I=16, seed=0) -> list[ExpertWeights]:
    g = torch.Generator().manual_seed(seed)
    return [ExpertWeights(torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)) for _ in range(L)]


def routed(T=4, k=2, E=8, H=32, seed=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    return x, ids, torch.softmax(torch.randn(T, k, generator=g), dim=-1)


def test_acall_computes_what_call_does_and_the_loop_runs_while_copies_fly():
    store = make_store()
    x, ids, w = routed()
    with EmulatedLink(bandwidth=1e9, latency=0.02, name="slow") as link:  # every copy takes >= 20 ms
        ref = OffloadedExperts(store, 4, torch.device("cpu"), link)
        want = [ref(layer, x, ids, w) for layer in (0, 1)]
        mgr = OffloadedExperts(store, 4, torch.device("cpu"), link)

        async def main():
            ticks = 0
            stop = asyncio.Event()

            async def ticker():
                nonlocal ticks
                while not stop.is_set():
                    ticks += 1
                    await asyncio.sleep(0.001)

            task = asyncio.create_task(ticker())
            await asyncio.sleep(0)
            out = [await mgr.acall(layer, x, ids, w) for layer in (0, 1)]
            stop.set()
            await task
            return out, ticks

        got, ticks = asyncio.run(main())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    st = mgr.stats()
    assert st["expert_misses"] == ref.stats()["expert_misses"] > 4  # more than fit: copies waited on
    assert st["stall_s"] >= 0.02 * 2  # at least the two layers' first waits
    assert ticks >= 10  # ~100 ms of copies: the ticker ran meanwhile


def test_a_failing_copy_raises_from_the_await_and_the_manager_goes_on():
    store = make_store()
    x, ids, w = routed()
    with EmulatedLink(bandwidth=1e9, name="test") as link:
        mgr = OffloadedExperts(store, 8, torch.device("cpu"), link)
        real = link.copy

        failed = []

        def failing(dst, src, **kw):  # the first copy meets a source the worker cannot read
            if not failed:
                failed.append(kw.get("tag"))
                src = [torch.empty(s.shape, device="meta") for s in src]
            return real(dst, src, **kw)

        link.copy = failing
        with pytest.raises(Exception, match="meta"):
            asyncio.run(_acall(mgr, 0, x, ids, w))
        layer, e = failed[0]
        assert mgr.slots.slot_of(layer, e) is None and (layer, e) not in mgr.inflight  # free for a new copy
        ref = OffloadedExperts(store, 8, torch.device("cpu"), link)
        for _ in range(2):  # the failed expert is copied again; then everything is resident
            out = asyncio.run(_acall(mgr, 0, x, ids, w))
            torch.testing.assert_close(out, ref(0, x, ids, w), rtol=0, atol=0)
        assert len(failed) == 1 and link.pending() == 0


def test_a_cancelled_waiter_leaves_its_copy_to_land():
    store = make_store()
    x, ids, w = routed()
    with EmulatedLink(bandwidth=1e9, latency=0.05, name="slow") as link:
        mgr = OffloadedExperts(store, 8, torch.device("cpu"), link)

        async def main():
            task = asyncio.create_task(mgr.acall(0, x, ids, w))
            await asyncio.sleep(0.01)  # inside its first wait
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert mgr.inflight  # still on their way, still the manager's
            return await mgr.acall(0, x, ids, w)

        out = asyncio.run(main())
        ref = OffloadedExperts(store, 8, torch.device("cpu"), link)
        torch.testing.assert_close(out, ref(0, x, ids, w), rtol=0, atol=0)
        assert mgr.stats()["h2d_bytes"] == ref.stats()["h2d_bytes"]  # nothing copied twice


async def _acall(mgr, *args):
    return await mgr.acall(*args)
