"""asyncio: one body per generation (a decoder's `run`), on a thread of its own under the loop.

1. `streaming.in_thread`: the items of a blocking iterator on the running loop, which keeps running
   meanwhile; an error in the iterator raises at the consumer; leaving early (break, cancellation)
   closes the iterator in its thread and waits for it; `link.poll` lets other tasks run.
2. Offload manager: a failing copy raises from the layer's call and leaves the manager and the link
   usable.
3. Decoders driven through `in_thread` commit exactly `run`'s greedy tokens, which are plain
   (resident) decoding's, for on-demand, spec-lru and specter (fp32, tiny checkpoint); the planner
   issues copies while the draft runs (before its cycle's verification); an exception in the
   planner, or a failing copy, surfaces and leaves no thread and no task behind; cancelling the
   consumer leaves the engine able to generate the same tokens again.
4. Engine: `astream` gives `stream`'s text with the loop free, and two concurrent astreams on one
   loop take turns.

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
from specter.moe import ExpertWeights
from specter.offload.link import EmulatedLink, poll
from specter.offload.manager import OffloadedExperts
from specter.sampling import SamplingParams
from specter.speculative.governor import Governor
from specter.streaming import in_thread
from specter.testing import make_tiny_checkpoint

PROMPTS = [[1, 5, 9, 33, 2], [100, 3, 64, 12, 90, 45, 8]]
NEW = 24


# ---------------------------------------------------------------------------------------- in_thread
def _items(log, n=4, fail_at=None, gate=None):
    try:
        for i in range(n):
            if gate is not None:
                gate.wait(10)
            if i == fail_at:
                raise ValueError("copy failed")
            yield i
    finally:
        log.append(("closed", threading.current_thread().name))


def test_in_thread_hands_items_over_and_raises_the_iterators_error():
    log = []

    async def collect(**kw):
        return [i async for i in in_thread(lambda: _items(log, **kw))]

    assert asyncio.run(collect()) == [0, 1, 2, 3]
    assert log == [("closed", "specter-generation")]  # iterated (and closed) on its own thread
    with pytest.raises(ValueError, match="copy failed"):
        asyncio.run(collect(fail_at=2))


@pytest.mark.parametrize("fail_at", [None, 2])
def test_in_thread_ends_or_raises_only_once_its_thread_has_ended(monkeypatch, fail_at):
    """A consumer that iterates to the end (or to the iterator's error) without aclose finds nothing
    running: the thread's last steps after handing the end over (held here) are waited for."""
    import specter.streaming as streaming

    real_put, release, threads = streaming.InThread._put, threading.Event(), []

    def slow_put(self, item):  # the thread lingers after its last item, until released or 1 s
        threads.append(self._thread)
        real_put(self, item)
        if item is self._end:
            release.wait(1.0)

    monkeypatch.setattr(streaming.InThread, "_put", slow_put)

    async def collect():
        try:
            return [i async for i in in_thread(lambda: _items([], fail_at=fail_at))]
        finally:
            assert not threads[-1].is_alive()
            release.set()

    if fail_at is None:
        assert asyncio.run(collect()) == [0, 1, 2, 3]
    else:
        with pytest.raises(ValueError, match="copy failed"):
            asyncio.run(collect())


def test_in_thread_keeps_the_loop_running_and_stops_the_iterator_when_left():
    log, gate = [], threading.Event()

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                if ticks > 5:
                    gate.set()  # the iterator goes on only once the loop has run other tasks
                await asyncio.sleep(0)

        tick = asyncio.create_task(ticker())
        run, got = in_thread(lambda: _items(log, n=100, gate=gate)), []
        async for i in run:
            got.append(i)
            if len(got) == 3:
                break
        await run.aclose()  # waits for the thread: the iterator is closed when this returns
        tick.cancel()
        return got, ticks

    got, ticks = asyncio.run(main())
    assert got == [0, 1, 2] and ticks > 5 and log == [("closed", "specter-generation")]


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
        await asyncio.wait_for(poll(ready, spin=spin, every=1e-3), timeout=10)
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


def test_a_failing_copy_raises_from_the_call_and_the_manager_goes_on():
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
            mgr(0, x, ids, w)
        layer, which = failed[0]  # a coalesced copy (layer, experts): every one of them failed with it
        for e in which if isinstance(which, tuple) else (which,):
            assert mgr.slots.slot_of(layer, e) is None and (layer, e) not in mgr.inflight  # free for a new copy
        ref = OffloadedExperts(store, 8, torch.device("cpu"), link)
        for _ in range(2):  # the failed expert is copied again; then everything is resident
            torch.testing.assert_close(mgr(0, x, ids, w), ref(0, x, ids, w), rtol=0, atol=0)
        assert len(failed) == 1 and link.pending() == 0


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
        return [t async for chunk in in_thread(lambda: decoder.run(prompt, params, n)) for t in chunk]

    return asyncio.run(collect())


@pytest.mark.parametrize("policy", ["on-demand", "spec-lru", "specter"])
def test_async_greedy_tokens_are_the_sync_ones_and_plain_decodings(checkpoint, plain_tokens, fast_link, policy):
    eng = specter.load(checkpoint, device="cpu", policy=policy, residency=0.25,
                       **({} if policy == "on-demand" else {"k_max": 6}))  # on-demand does not draft
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
        sampled = SamplingParams(temperature=0.9, top_k=20, seed=3)  # the same draws, in the same order
        assert _arun(eng.decoder, PROMPTS[0], params=sampled) == \
            [t for chunk in eng.decoder.run(PROMPTS[0], sampled, NEW) for t in chunk]
    finally:
        eng.close()


@pytest.mark.parametrize("steps", ["eager", "sync-free"])
def test_the_planner_issues_copies_while_the_draft_runs(checkpoint, plain_tokens, fast_link, steps):
    """sync-free: the draft step and the verifier's pieces CUDA runs (uncompiled here): the draft
    publishes lookahead rows to the host mirror, the planner reads those that have landed."""
    eng = _specter(checkpoint)
    dec, events = eng.decoder, []
    if steps == "sync-free":
        dec.draft_step = _compiled_draft_step(eng.model, dec.draft, compile=False)
        dec.verify_step = _compiled_verify_step(eng.model, 6, compile=False)
    real_plan, real_end = dec.planner.plan, dec.planner.end_cycle
    verified = []  # the verifier's pieces ran (sync-free)

    def plan(upto, host=False):
        assert host == (steps == "sync-free")
        issued = real_plan(upto, host)
        events.append(("plan", upto, dec.planner.k, issued, dec.experts.link.pending()))
        return issued

    def end_cycle():  # the decoder ends a cycle's planning right after its verification
        events.append(("verify",))
        real_end()

    dec.planner.plan, dec.planner.end_cycle = plan, end_cycle
    if steps == "sync-free":
        real_step = dec.verify_step.step
        dec.verify_step.step = lambda *a: verified.append(1) or real_step(*a)
    try:
        assert _arun(dec, PROMPTS[1]) == plain_tokens[1]
        if steps == "sync-free":
            assert dec.stats()["compiled"] == [] and dec._step_drafted > 0 and verified
    finally:
        eng.close()
    verifies = [i for i, e in enumerate(events) if e[0] == "verify"]
    # mid-draft plans (rows < K) that issued copies, each followed by its cycle's verification
    early = [i for i, e in enumerate(events) if e[0] == "plan" and e[1] < e[2] and e[3] > 0]
    assert early and all(any(v > i for v in verifies) for i in early)


def test_a_planner_error_or_a_failing_copy_surfaces_and_leaves_nothing_running(checkpoint, plain_tokens, fast_link):
    eng = _specter(checkpoint)
    dec = eng.decoder
    real_plan, real_copy = dec.planner.plan, dec.experts.link.copy
    threads = threading.active_count()

    async def main():
        try:
            async for _ in in_thread(lambda: dec.run(PROMPTS[0], SamplingParams(), NEW)):
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
        dec.experts.link.copy = failing_copy
        with pytest.raises(Exception, match="meta"):
            asyncio.run(main())
        dec.experts.link.copy = real_copy
        assert failed and threading.active_count() == threads  # no generation thread left
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
            run = in_thread(lambda: dec.run(PROMPTS[1], SamplingParams(), NEW))
            try:
                async for chunk in run:
                    got.extend(chunk)
                    await asyncio.sleep(0)
            finally:
                await run.aclose()

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
    eng = specter.load(None, device="cpu", policy="on-demand", residency=0.25)
    yield eng
    eng.close()


PROMPT = "def fibonacci(n):"


def test_astream_leaves_the_loop_free_and_streams_take_turns(bundled):
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
    assert threading.active_count() == threads  # each generation's thread has ended
    assert ticks > 16  # the loop ran other tasks while the generations computed


@pytest.mark.parametrize("served", [False, True], ids=["waiting", "just-served"])
def test_a_thread_interrupted_while_waiting_for_its_turn_gives_it_up(served):
    """A Ctrl-C in a blocking generate() queued behind another lost its ticket: the turn never passed
    it, and every later generation on the engine waited forever."""
    from specter.engine import Turns

    turns = Turns()
    holder, go = threading.Event(), threading.Event()

    def hold():
        with turns.turn():
            holder.set()
            go.wait()

    t = threading.Thread(target=hold)
    t.start()
    holder.wait()
    real = turns._cv.wait

    def interrupted(timeout=None):  # the waiter's Ctrl-C (just as the holder released, with `served`)
        if served:  # as a real wait does, the lock is let go meanwhile
            turns._cv.release()
            go.set()
            t.join()
            turns._cv.acquire()
        raise KeyboardInterrupt

    turns._cv.wait = interrupted
    with pytest.raises(KeyboardInterrupt):
        with turns.turn():
            pass
    turns._cv.wait = real
    go.set()
    t.join()
    done = threading.Event()
    later = threading.Thread(target=lambda: (turns.turn().__enter__(), done.set()))
    later.start()
    assert done.wait(5), "the next generation waits forever"
    later.join()


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


def test_asyncio_run_ending_on_a_live_astream_keeps_the_turn_until_its_thread_ends(bundled, caplog, monkeypatch):
    """asyncio.run's end closes every live async generator at once: the abandoned astream, its
    generation (in_thread) and its turn (then an asynccontextmanager) together. The turn passed on
    while the generation's thread still decoded: a generate() waiting on another thread ran beside it
    (two decoder runs at once on one engine), and the close logged "already running" errors."""
    want = bundled.generate(PROMPT, max_new_tokens=12, temperature=0).token_ids
    real, active, peak, lock = bundled.decoder.run, [0], [0], threading.Lock()

    def counted(*a, **kw):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            yield from real(*a, **kw)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(bundled.decoder, "run", counted)
    got = []

    async def leave():
        stream = bundled.astream(PROMPT, max_new_tokens=200, temperature=0)
        await anext(stream)
        leave.kept = stream  # alive when asyncio.run ends
        threading.Thread(target=lambda: got.append(bundled.generate(PROMPT, max_new_tokens=12,
                                                                     temperature=0).token_ids)).start()
        await asyncio.sleep(0.05)

    with caplog.at_level("ERROR", logger="asyncio"):
        asyncio.run(leave())
    assert poll_until(lambda: got, 60), "the waiting generate() never ran"
    assert got == [want] and peak[0] == 1, (peak, got)
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text
    del leave.kept


def poll_until(done, seconds: float) -> bool:
    import time
    end = time.monotonic() + seconds
    while not done() and time.monotonic() < end:
        time.sleep(0.01)
    return bool(done())


def test_break_out_of_an_astream_then_stream_again_in_the_same_task(bundled):
    """README: leaving the loop early ends the generation. After `break` the loop closes the stream in a
    task of its own, later: the same task's next astream was refused ("this thread is already
    generating") instead of queueing behind that close. A stream the task still holds is refused."""
    want = bundled.generate(PROMPT, max_new_tokens=8, temperature=0).text

    async def main():
        async for _ in bundled.astream(PROMPT, max_new_tokens=64, temperature=0):
            break
        again = "".join([p async for p in bundled.astream(PROMPT, max_new_tokens=8, temperature=0)])
        held = bundled.astream(PROMPT, max_new_tokens=64, temperature=0)
        await anext(held)
        with pytest.raises(specter.ConfigError, match="already generating"):
            await anext(bundled.astream(PROMPT, max_new_tokens=8, temperature=0))
        await held.aclose()
        return again

    assert asyncio.run(main()) == want and bundled.turns.waiting == 0


def test_a_generation_waiting_for_its_turn_when_the_engine_closes_generates_nothing():
    """close() while a generate() waited behind a suspended stream: the waiter then ran its prefill and
    one step on the closed engine (README: nothing is generated after close). It ends "cancelled" with
    no token, as one whose cancel is set while it waits."""
    engine = specter.load(None, device="cpu", policy="resident")
    holder = engine.stream_ids("def add(a, b):", max_new_tokens=50, temperature=0)
    next(holder)  # a stream left suspended holds the turn
    out = {}
    waiter = threading.Thread(target=lambda: out.update(o=engine.generate("class Stack:", max_new_tokens=20,
                                                                            temperature=0)))
    waiter.start()
    while engine.turns.waiting == 0:
        waiter.join(0.01)
    engine.close()
    list(holder)  # the holder ends (cancelled) and passes the turn on
    waiter.join()
    stats = out["o"].stats
    assert stats["finish_reason"] == "cancelled" and stats["new_tokens"] == 0 and out["o"].token_ids == [], stats


LEFT_RUNNING = """
import asyncio, specter
e = specter.load(None, device="cpu", policy="{policy}")
agen = e.astream("def add(a, b):", max_new_tokens=300, temperature=0.0)
loop = asyncio.new_event_loop()
print(repr(loop.run_until_complete(agen.__anext__())), flush=True)
"""


@pytest.mark.parametrize("policy", ["resident", "specter"])
def test_a_loop_left_with_an_astream_running_exits_cleanly(policy):
    """A script whose loop stopped (run_until_complete, no asyncio.run clean-up) with an astream mid-way
    aborted at exit (status 134, "terminate called without an active exception"): its generation thread
    was inside a torch op at finalization. That thread is stopped and joined at exit now, first."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", LEFT_RUNNING.format(policy=policy)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and "terminate" not in p.stderr, (p.returncode, p.stdout, p.stderr[-2000:])
