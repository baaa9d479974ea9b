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
from specter.builder import _compiled_draft_step, _compiled_verify_step
from specter import sansio
from specter.moe import ExpertWeights
from specter.offload.link import EmulatedLink
from specter.offload.manager import OffloadedExperts
from specter.sampling import SamplingParams
from specter.speculative.governor import Governor
from specter.testing import make_tiny_checkpoint

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


def _body(log, emit=True):
    a = yield _Op(2)
    if emit:
        yield sansio.Emit(a)
    try:
        yield _Op(None, ValueError("copy failed"))
    except ValueError as e:
        log.append(f"caught {e}")
    b = yield _Op(3)
    try:
        if emit:
            yield sansio.Emit(a * b)
    finally:
        log.append("cleanup")
    return a + b


def test_drivers_agree_and_throw_errors_into_the_body():
    log = []
    assert sansio.drive(_body(log, emit=False)) == 5
    assert log == ["caught copy failed", "cleanup"]
    log = []
    assert asyncio.run(sansio.adrive(_body(log, emit=False))) == 5
    assert log == ["caught copy failed", "cleanup"]
    with pytest.raises(TypeError, match="emitted"):
        sansio.drive(_body([]))

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


def test_poll_lets_other_tasks_run_between_checks():
    async def main(spin):
        ticks, checks = 0, 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        def ready():
            nonlocal checks
            checks += 1
            return ticks >= 5

        task = asyncio.create_task(ticker())
        await asyncio.wait_for(sansio.poll(ready, spin=spin, every=1e-3), timeout=10)
        task.cancel()
        return checks

    assert 2 <= asyncio.run(main(spin=1.0)) <= 10  # spinning: one check a loop turn
    assert asyncio.run(main(spin=0.0)) >= 2        # sleeping between checks


# ------------------------------------------------------------------------------------------ manager
def make_store(L=2, E=8, H=32, I=16, seed=0) -> list[ExpertWeights]:
    g = torch.Generator().manual_seed(seed)
    return [ExpertWeights(torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)) for _ in range(L)]


def routed(T=4, k=2, E=8, H=32, seed=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    return x, ids, torch.softmax(torch.randn(T, k, generator=g), dim=-1)


class Gate:
    """An EmulatedLink clock (see the link's docstring) whose sleeps wait, up to 10 s of wall time,
    for the test to open the gate: copies cannot land before a task on the loop has run."""

    def __init__(self):
        self.t, self.open, self.timed_out = 0.0, threading.Event(), False

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float, wake: threading.Event) -> bool:
        self.timed_out |= not self.open.wait(10.0)
        self.t += seconds
        return wake.is_set()


def test_acall_computes_what_call_does_and_the_loop_runs_while_copies_fly():
    store = make_store()
    x, ids, w = routed()
    with EmulatedLink(bandwidth=1e9, latency=0.02, name="ref") as fast:
        ref = OffloadedExperts(store, 4, torch.device("cpu"), fast)
        want = [ref(layer, x, ids, w) for layer in (0, 1)]
    gate = Gate()
    with EmulatedLink(bandwidth=1e9, latency=0.02, name="gated", clock=gate) as link:  # lands once the loop ran
        mgr = OffloadedExperts(store, 4, torch.device("cpu"), link)

        async def main():
            ticks = 0
            stop = asyncio.Event()

            async def ticker():
                nonlocal ticks
                while not stop.is_set():
                    if link.pending():  # a copy is in flight while this task runs
                        ticks += 1
                        gate.open.set()
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
    assert st["stall_s"] > 0  # the waits were timed
    assert ticks >= 1 and not gate.timed_out  # the ticker ran while copies were in flight, and let them land


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


# ----------------------------------------------------------------------------------------- decoders
@pytest.fixture
def fast_link(monkeypatch):
    """A fast emulated link (a tiny expert takes ~0.5 ms: copies are in flight while layers compute)."""
    made = []

    def make_link(device, profile=None, **kw):
        made.append(EmulatedLink(100e6, 2e-4, name="test"))
        return made[-1]

    monkeypatch.setattr(builder, "make_link", make_link)
    yield made


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    make_tiny_checkpoint(path, "qwen3_moe")
    return path


@pytest.fixture(scope="module")
def plain_tokens(checkpoint):
    eng = specter.load(checkpoint, device="cpu", policy="resident")
    try:
        return [eng.generate(p, max_new_tokens=NEW).token_ids for p in PROMPTS]
    finally:
        eng.close()


def _specter(checkpoint):
    eng = specter.load(checkpoint, device="cpu", policy="specter", residency=0.25, k_max=6)
    eng.decoder.governor = Governor(6, fixed=4)
    return eng


def _arun(decoder, prompt, n=NEW, params=SamplingParams()):
    async def collect():
        return [t async for chunk in decoder.arun(prompt, params, n) for t in chunk]

    return asyncio.run(collect())


@pytest.mark.parametrize("policy", ["on-demand", "spec-lru", "specter"])
def test_async_greedy_tokens_are_the_sync_ones_and_plain_decodings(checkpoint, plain_tokens, fast_link, policy):
    eng = specter.load(checkpoint, device="cpu", policy=policy, residency=0.25, k_max=6)
    if policy != "on-demand":
        eng.decoder.governor = Governor(6, fixed=4)  # speculate every cycle (this random model's draft is poor)
    try:
        for prompt, want in zip(PROMPTS, plain_tokens):
            sync = [t for chunk in eng.decoder.run(prompt, SamplingParams(), NEW) for t in chunk]
            eng.decoder.reset_stats()
            got = _arun(eng.decoder, prompt)
            st = eng.decoder.stats()
            assert sync == want and got == want
            assert st["expert_misses"] > 0  # offloaded for real
            if policy != "on-demand":
                assert st["drafted_tokens"] > 0
            if policy == "specter":
                assert st["prefetch_issued"] > 0
        eng.driver = "async"  # the blocking API over the async driver (a loop of its own)
        assert [eng.generate(p, max_new_tokens=NEW).token_ids for p in PROMPTS] == plain_tokens
        sampled = SamplingParams(temperature=0.9, top_k=20, seed=3)  # the same draws, in the same order
        assert _arun(eng.decoder, PROMPTS[0], params=sampled) == \
            [t for chunk in eng.decoder.run(PROMPTS[0], sampled, NEW) for t in chunk]
    finally:
        eng.close()


@pytest.mark.parametrize("steps", ["eager", "sync-free"])
def test_the_planner_task_issues_copies_while_the_draft_runs(checkpoint, plain_tokens, fast_link, steps):
    """sync-free: the draft step and the verifier's pieces CUDA runs (uncompiled here): the draft
    publishes lookahead rows to the host mirror, the planner task awaits them by `ready()`."""
    eng = _specter(checkpoint)
    dec, events = eng.decoder, []
    if steps == "sync-free":
        dec.draft_step = _compiled_draft_step(eng.model, dec.draft, compile=False)
        dec.verify_step = _compiled_verify_step(eng.model, 6, compile=False)
    real_plan, real_acall = dec.planner.plan, dec.target.acall

    def plan(upto, host=False):
        assert host == (steps == "sync-free")
        issued = real_plan(upto, host)
        events.append(("plan", asyncio.current_task().get_name(), upto, dec.planner.k, issued))
        return issued

    async def acall(*a):
        events.append(("verify", asyncio.current_task().get_name()))
        return await real_acall(*a)

    dec.planner.plan, dec.target.acall = plan, acall

    async def main():
        asyncio.current_task().set_name("driver")
        return [t async for chunk in dec.arun(PROMPTS[1], SamplingParams(), NEW) for t in chunk]

    try:
        assert asyncio.run(main()) == plain_tokens[1]
        if steps == "sync-free":
            assert dec.stats()["compiled"] == [] and dec._step_drafted > 0 and dec._step_verified > 0
    finally:
        eng.close()
    plans = [e for e in events if e[0] == "plan"]
    assert plans and all(e[1] != "driver" for e in plans)  # planning ran in its own task
    verifies = [i for i, e in enumerate(events) if e[0] == "verify"]
    assert verifies and all(events[i][1] == "driver" for i in verifies)
    # mid-draft plans (rows < K) that issued copies, each followed by its cycle's verification
    early = [i for i, e in enumerate(events) if e[0] == "plan" and e[2] < e[3] and e[4] > 0]
    assert early and all(any(v > i for v in verifies) for i in early)


def test_a_planner_error_or_a_failing_copy_surfaces_and_leaves_nothing_running(checkpoint, plain_tokens, fast_link):
    eng = _specter(checkpoint)
    dec = eng.decoder
    real_plan, real_copy = dec.planner.plan, dec.target.link.copy

    async def main():
        try:
            async for _ in dec.arun(PROMPTS[0], SamplingParams(), NEW):
                pass
        finally:
            left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return left

    def broken_plan(upto, host=False):
        raise RuntimeError("planner broke")

    failed = []

    def failing_copy(dst, src, **kw):
        if not failed:
            failed.append(kw.get("tag"))
            src = [torch.empty(s.shape, device="meta") for s in src]
        return real_copy(dst, src, **kw)

    try:
        dec.planner.plan = broken_plan
        with pytest.raises(RuntimeError, match="planner broke"):
            asyncio.run(main())
        dec.planner.plan = real_plan
        dec.target.link.copy = failing_copy
        with pytest.raises(Exception, match="meta"):
            asyncio.run(main())
        dec.target.link.copy = real_copy
        assert failed and threading.active_count() < 50
        for prompt, want in zip(PROMPTS, plain_tokens):  # the engine goes on, lossless
            assert _arun(dec, prompt) == want
        assert asyncio.run(main()) == []  # a clean run leaves no task behind
    finally:
        eng.close()


def test_cancelling_the_consumer_leaves_the_engine_whole(checkpoint, plain_tokens, fast_link):
    eng = _specter(checkpoint)
    dec = eng.decoder

    async def main():
        got = []

        async def consume():
            async for chunk in dec.arun(PROMPTS[1], SamplingParams(), NEW):
                got.extend(chunk)
                await asyncio.sleep(0)

        task = asyncio.create_task(consume())
        while len(got) < 3:
            await asyncio.sleep(0.0005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)
        return got, [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    try:
        got, left = asyncio.run(main())
        assert left == [] and got == plain_tokens[1][:len(got)]
        for prompt, want in zip(PROMPTS, plain_tokens):
            assert _arun(dec, prompt) == want
    finally:
        eng.close()


# ------------------------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def bundled():
    eng = specter.load(None, device="cpu", policy="on-demand", residency=0.25, driver="async")
    yield eng
    eng.close()


PROMPT = "def fibonacci(n):"


def test_astream_runs_on_the_callers_loop_and_streams_take_turns(bundled):
    want = bundled.generate(PROMPT, max_new_tokens=16, temperature=0).text
    threads = threading.active_count()

    async def one(prompt, stats=None):
        return "".join([p async for p in bundled.astream(prompt, max_new_tokens=16, stats=stats, temperature=0)])

    async def main():
        stats = {}
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        tick = asyncio.create_task(ticker())
        a, b = await asyncio.gather(one(PROMPT, stats), one(PROMPT))
        tick.cancel()
        return a, b, stats, ticks

    a, b, stats, ticks = asyncio.run(main())
    assert a == b == want and stats["new_tokens"] == 16 and stats["finish_reason"] == "length"
    assert threading.active_count() == threads  # no thread of its own: it ran on this loop
    assert ticks > 16  # the loop ran other tasks between its waits


def test_a_coroutine_cancelled_while_waiting_for_its_turn_gives_it_up(bundled):
    async def main():
        first = bundled.astream(PROMPT, max_new_tokens=8, temperature=0)
        piece = await first.__anext__()  # holds the turn
        waiter = asyncio.create_task(anext(bundled.astream(PROMPT, max_new_tokens=8, temperature=0)))
        await asyncio.sleep(0.02)
        assert not waiter.done()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        rest = [p async for p in first]
        return piece + "".join(rest)

    text = asyncio.run(main())
    assert text == bundled.generate(PROMPT, max_new_tokens=8, temperature=0).text  # the turn passed on, nobody stuck
    assert bundled.turns.waiting == 0
