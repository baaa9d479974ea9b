"""Speculative decoding over offloaded experts: one cycle, as data flows.

    pending token t at position n (cache committed to [0, n))
    draft   t, d1 .. d_{K-1} at n .. n+K-1   -> d1 .. dK, lookahead rows 0..K-1, q (draft probs)
            every `chunk` steps: planner reads new rows -> copies for the target start now
    verify  [t, d1 .. dK] at n .. n+K in one target pass (experts grouped; resident first)
    accept  m drafted tokens + one target token; cache is committed to n+m+1 (the rest is scratch)

The draft writes its K/V into the same cache past the committed length; verification overwrites
those positions with the target's own, so there is never a second cache and rollback is free.

A generation is written once, as a body (specter/sansio.py): it yields each committed chunk (`Emit`),
each planning request of the draft (`Plan`) and each wait of verification (routing reads, copies).
Two drivers run it:
    run()   blocking: plans where the draft asks, waits for copies on the spot (the synchronous engine)
    arun()  asyncio (an async generator): a planner task awaits the lookahead rows each request
            names and issues copies while the draft coroutine goes on; verification awaits exactly
            the copies each MoE layer needs, the loop free meanwhile
"""
from __future__ import annotations

import asyncio
import threading
from collections import Counter
from typing import AsyncIterator, Iterator

import torch

from .. import sansio

from ..layers import KVCache
from ..model import MoETransformer
from ..offload.manager import OffloadedExperts
from ..profiling import span
from ..sampling import History, SamplingParams, penalize, probs, sample
from .acceptance import accept_greedy, accept_on_device, accept_sampling
from .draft import DraftExperts
from .governor import Governor
from .planner import PrefetchPlanner
from .timing import CycleTimes, clock_for


class SpeculativeDecoder:
    def __init__(self, model: MoETransformer, target: OffloadedExperts, draft: DraftExperts, device, dtype, *,
                 governor: Governor, planner: PrefetchPlanner | None = None, fallback=None):
        self.model, self.target, self.draft = model, target, draft
        self.device, self.dtype = device, dtype
        self.planner = planner                  # None: spec-lru (verify fetches on demand)
        self.governor = governor                # picks each cycle's K (0..K_max)
        self.fallback = fallback                # prefetcher candidate for K = 0 steps (next-layer)
        self.plain = governor.plain_arms        # K = 0: with or without it, whichever measures faster
        self.plan_backlog = 1                   # plan again when at most this many copies are queued
        self.cancel_leftovers = True            # withdraw a cycle's prefetches still queued when it ends
        self.draft_step = None                  # a sync-free draft step (specter.compiled.draft_step), if any
        self._last_plain = None                 # (token, its [1] tensor) from the last plain step
        self.verify_step = None                 # a piecewise-compiled verifier (specter.compiled.verify_step), if any
        self.times = CycleTimes(clock_for(device))  # draft and verify times: CUDA events on CUDA, else wall clock
        self.graph_warmups: list[dict] = []     # CUDA graphs recorded before generating: per thread and KV cache
        self._warm = threading.local()          # .caches: numbers of the caches whose graphs this thread recorded
        self._caches = 0                        # KV caches made so far (numbers them)
        self.reset_stats()

    @property
    def experts(self):
        return self.target

    def run(self, prompt: list[int], params: SamplingParams, max_new: int) -> Iterator[list[int]]:
        """Lists of committed token ids, the first one after prefill, then one a cycle (blocking)."""
        return sansio.iterate(self._body(prompt, params, max_new), self._resolve)

    async def arun(self, prompt: list[int], params: SamplingParams, max_new: int) -> AsyncIterator[list[int]]:
        """`run` on the running event loop (see the module docstring)."""
        planning = _PlannerTask(self)
        try:
            async for chunk in sansio.aiterate(self._body(prompt, params, max_new), planning.resolve):
                yield chunk
        finally:
            await planning.close()

    def _resolve(self, op):
        """The blocking driver's ops: a planning request is served on the spot, with the rows there are."""
        if isinstance(op, Plan):
            with span("plan"):
                return self.planner.plan(self.draft_step.lookahead.ready() if op.host else op.upto, host=op.host)
        return op.wait()

    def _body(self, prompt: list[int], params: SamplingParams, max_new: int):
        # no scratch beyond the plan's context: K <= remaining - 1 keeps drafts and verification inside
        # positions [0, len(prompt) + max_new - 1)
        headroom = self.verify_step.headroom if self.verify_step is not None else 0  # it pads to a width bucket
        cache = self._kv_cache(len(prompt) + max_new + headroom)
        self._record_graphs(cache)
        gen = params.generator(self.device)
        hist = params.history(prompt, self.device)  # what penalties look at
        prompt_ids = torch.tensor(prompt, device=self.device)
        logits = yield from self.model.body(prompt_ids, 0, cache, self.target, logits_for="last")
        t = int(sample(logits, params, gen, hist))
        hist.commit([t])
        n, produced = len(prompt), 0
        yield sansio.Emit([t])
        produced += 1
        while produced < max_new:
            k = self.governor.next_k(max_new - produced)
            if k == 0:  # one generator fewer between the step's ops and the driver
                new = yield from self._plain_step(t, n, cache, params, gen, hist)
            else:
                new = yield from self._cycle(t, n, k, cache, params, gen, hist)
            hist.commit(new)
            n += len(new)
            t = new[-1]
            produced += len(new)
            yield sansio.Emit(new)

    def _kv_cache(self, need: int) -> KVCache:
        """The KV cache, kept across generations (one generation runs at a time) and grown only when
        a generation needs more: a captured draft step then replays on the same buffer addresses
        instead of re-recording its CUDA graphs every generation. Stale rows past the committed
        length are scratch, as within a generation."""
        cache = getattr(self, "_cache", None)
        if cache is None or cache.max_len < need:  # grow geometrically, within the model's context
            size = need if cache is None else max(need, min(2 * cache.max_len, self.model.spec.max_position))
            if self._graph_steps():  # each new cache is a new set of recordings: start at a useful size
                size = max(size, min(GRAPH_CACHE_MIN, self.model.spec.max_position))
            cache = self._cache = KVCache(self.model.spec, size, self.device, self.dtype)
            self._caches += 1
        return cache

    def record_graphs(self, tokens: int = 0) -> None:
        """Record the CUDA graphs now, on the calling thread, for a KV cache of at least `tokens`
        positions (the one generations will use): for a thread that will generate (a server's engine
        thread) to call before its first request. Generations do it themselves when needed."""
        if self._graph_steps():
            self._record_graphs(self._kv_cache(max(tokens, 1)))

    def _graph_steps(self) -> list:
        return [s for s in (self.draft_step, self.verify_step) if s is not None and getattr(s, "graphs", False)]

    def _record_graphs(self, cache: KVCache) -> None:
        """Record every CUDA graph the compiled steps can replay on `cache`, on this thread, before the
        generation times anything: cudagraph trees keep graphs per thread and record one per static
        address set (recording one syncs the device), so a graph first met mid-generation would be
        recorded inside a timed cycle, and one recorded on the loading thread is never replayed by a
        server's engine thread. A bounded number: each step's `recordings()` per thread and cache
        (the cache grows geometrically, from GRAPH_CACHE_MIN tokens). Nothing to do without graphs."""
        steps = self._graph_steps()
        warm = self._warm.__dict__.setdefault("caches", set())
        if not steps or self._caches in warm:
            return
        before = (_graph_memory(self.device), _recorded_graphs(self.device))
        for step in steps:
            step.warmup(cache=cache, repeat=2)
        after = (_graph_memory(self.device), _recorded_graphs(self.device))
        warm.add(self._caches)
        self.graph_warmups.append(dict(
            thread=threading.current_thread().name, cache_len=cache.max_len,
            recordings=sum(s.recordings() for s in steps),  # the bound
            recorded=None if before[1] is None or after[1] is None else after[1] - before[1],  # counted (CUDA)
            bytes=None if before[0] is None else after[0] - before[0]))

    def _cycle(self, t: int, n: int, k: int, cache: KVCache, params: SamplingParams, gen, hist: History):
        """Body of one speculative cycle (K >= 1) -> the committed tokens (m accepted drafts + the
        target's own); K = 0 is `_plain_step`."""
        st = self._stats
        st["k_histogram"][k] += 1
        st["cycles"] += 1
        m0 = self.times.mark()
        sync_free = self.draft_step is not None and not params.penalized
        if sync_free:  # drafted tokens stay on the device until acceptance
            tokens, q = yield from self._draft_on_device(t, n, k, cache, params, gen)
            self._step_drafted += k
        else:
            drafted, q_rows = yield from self._draft(t, n, k, cache, params, gen, hist)
            tokens = torch.tensor([t] + drafted, device=self.device)
        m1 = self.times.mark()
        before = self.target.stats()
        with span("verify"):
            logits = yield from self._verify(tokens, n, cache)  # [K+1, V]
        if self.cancel_leftovers:  # what verification did not wait for, it did not need:
            self.target.cancel_prefetches()  # the next cycle must not queue behind it nor be billed for it
        if self.planner is not None:
            self.planner.end_cycle()
        # row i of the target sees the history plus drafted[:i], exactly as the draft's step i did
        with span("accept"):
            if sync_free:  # no penalties: nothing depends on the history
                m, nxt, drafted = accept_on_device(tokens, logits, q, params, gen)  # one host read
            elif params.greedy:
                m, nxt = accept_greedy(drafted, penalize(logits, params, hist, drafted))
            else:
                p = probs(logits, params, hist, drafted)
                m, nxt = accept_sampling(drafted, torch.stack(q_rows) if q_rows else None, p, gen)
        self.target.demote_rejected(m + 1)  # rows 0..m ran on committed tokens, the rest on rejected drafts
        m2 = self.times.mark()
        after = self.target.stats()  # recall: share of verification's experts resident or in flight when it reached them
        stall = after["stall_s"] - before["stall_s"]
        hits = after["expert_hits"] - before["expert_hits"]
        st["recall_hits"] += hits
        st["recall_total"] += hits + after["expert_misses"] - before["expert_misses"]
        st["drafted_tokens"] += k
        st["accepted_tokens"] += m
        st["rejections"] += m < k
        self.times.submit((m0, m1, m2), lambda draft_s, verify_s: self._observe_cycle(
            k, m, draft_s, verify_s, stall))
        return drafted[:m] + [nxt]

    def _observe_cycle(self, k: int, m: int, draft_s: float, verify_s: float, stall: float) -> None:
        """A speculative cycle's times, once readable (timing.py): into the stats and the governor."""
        st = self._stats
        st["draft_s"] += draft_s
        st["verify_s"] += verify_s
        self.governor.observe_cycle(k, m, draft_s, verify_s, stall)

    def _plain_step(self, t: int, n: int, cache: KVCache, params: SamplingParams, gen, hist: History):
        """Body: K = 0, one target step taken as PlainDecoder takes it (through the compiled verifier's
        pieces when there are some), plus what the governor and the plain arms learn from it. At full
        residency a step is a millisecond or two on a CPU, so the cycle's bookkeeping for drafts,
        acceptance and recall would cost several percent."""
        st = self._stats
        st["k_histogram"][0] += 1
        st["cycles"] += 1
        fallback = self.fallback is not None and not self.target.all_resident  # nothing to prefetch when all resident
        use_fallback = fallback and self.plain.pick()
        copied0 = self.target.offloaded_bytes  # copies and host-lane reads: either way not all resident
        m1 = self.times.mark()
        self.target.next_layer_router = self.fallback if use_fallback else None
        last = self._last_plain  # the token the previous plain step sampled, still a tensor: no new one
        x = last[1] if last is not None and last[0] == t else torch.tensor([t], device=self.device)
        try:
            with span("verify"):
                logits = yield from self._verify(x, n, cache)  # [1, V]
        finally:
            self.target.next_layer_router = None
        if use_fallback and self.cancel_leftovers:  # only next-layer prefetches: misses are never withdrawn
            self.target.cancel_prefetches()
        with span("accept"):  # a plain step's "acceptance" is its sample
            tok = sample(logits, params, gen, hist)  # [1]
            nxt = int(tok)
        self._last_plain = (nxt, tok)
        m2 = self.times.mark()
        observed = not (fallback and self.plain.probing)  # as in _cycle: a probe is not what K = 0 costs
        copied = max(0, self.target.offloaded_bytes - copied0)
        arm = use_fallback if fallback else None
        self.times.submit((m1, m2), lambda verify_s: self._observe_plain(verify_s, observed, copied, arm))
        return [nxt]

    def _observe_plain(self, verify_s: float, observed: bool, copied: int, arm: bool | None) -> None:
        """A plain step's time, once readable (timing.py): into the stats, the governor (unless the
        step probed a plain arm) and the plain arms (`arm`: the one it ran, None without arms)."""
        self._stats["verify_s"] += verify_s
        if observed:
            self.governor.observe_cycle(0, 0, 0.0, verify_s, 0.0, copied=copied)
        if arm is not None:
            self.plain.observe(arm, verify_s)

    def _verify(self, tokens: torch.Tensor, n: int, cache: KVCache):
        """Body: the target over tokens [T] at positions n .. n+T-1 -> logits [T, V], through the
        compiled verifier's pieces when there are some."""
        if self.verify_step is None:
            return (yield from self.model.body(tokens, n, cache, self.target))
        self._step_verified += 1
        return (yield from self.verify_step.body(tokens, n, cache, self.target))

    def _draft_on_device(self, t: int, n: int, k: int, cache: KVCache, params: SamplingParams, gen):
        """Body: K draft steps without a host sync (compiled/draft_step.py) -> tokens [K+1] (the pending
        token, then the drafted ones) and q [K, V] (sampling) or None, all on the device. The planner
        reads only lookahead rows whose copies to the host have landed."""
        ds, planner = self.draft_step, self.planner
        ds.begin(t, n, params)
        if k and planner is not None:
            planner.begin_cycle(k)
            chunk = planner.chunk_size(self.governor.draft_s or 0.0, k)
            for i in range(k):
                with span("draft step"):
                    ds.step(cache, gen)
                if self._plan_now(i, chunk):
                    yield Plan(i + 1, host=True)
            yield Plan(k, host=True, final=True)
        else:
            for _ in range(k):
                with span("draft step"):
                    ds.step(cache, gen)
        return ds.tokens[:k + 1], (None if params.greedy else ds.q[:k])

    def _draft(self, t: int, n: int, k: int, cache: KVCache, params: SamplingParams, gen, hist: History):
        """Body: K eager draft steps -> drafted tokens, their draft probabilities (sampling)."""
        drafted, q_rows = [], []
        if k == 0:
            return drafted, q_rows
        planner = self.planner
        if planner is not None:
            planner.begin_cycle(k)
        chunk = planner.chunk_size(self.governor.draft_s or 0.0, k) if planner else k
        tok = t
        for i in range(k):
            with span("draft step"):
                token = torch.tensor([tok], device=self.device)
                self.draft.row = i
                logits = self.model(token, n + i, cache, self.draft)  # [1, V]
                if params.greedy:
                    tok = int(sample(logits, params, None, hist, drafted))
                else:
                    q = probs(logits, params, hist, drafted)[0]
                    tok = int(torch.multinomial(q, 1, generator=gen))
                    q_rows.append(q)
            drafted.append(tok)
            if planner is not None and self._plan_now(i, chunk):
                yield Plan(i + 1)
        self.draft.row = None
        if planner is not None:
            yield Plan(k, final=True)
        return drafted, q_rows

    def _plan_now(self, i: int, chunk: int) -> bool:
        """After draft step i: the first row at once (copies should start as early as possible); later
        chunks only when the link is about to run dry: planning into a backlog costs draft time, buys nothing."""
        return i == 0 or ((i + 1) % chunk == 0 and self.target.link.pending() <= self.plan_backlog)

    # ------------------------------------------------------------------------------ stats
    def reset_stats(self) -> None:
        self.times.poll()  # what earlier cycles measured still reaches the governor, not the new stats
        self.target.reset_stats()
        if self.planner is not None:
            self.planner.reset_stats()
        self._stats = dict(cycles=0, drafted_tokens=0, accepted_tokens=0, rejections=0,
                           draft_s=0.0, verify_s=0.0, recall_hits=0, recall_total=0, k_histogram=Counter())
        self._step_drafted = 0  # tokens drafted by draft_step (it does not run with penalties)
        self._step_verified = 0  # verifications verify_step ran

    def stats(self) -> dict:
        self.times.poll()  # cycles whose events completed since they were submitted
        s = {**self.target.stats(), **self._stats}
        if self.planner is not None:
            s["cover_hits"], s["cover_total"] = self.planner.cover_hits, self.planner.cover_total
            s["route_coverage"] = s["cover_hits"] / s["cover_total"] if s["cover_total"] else None
        s["k_histogram"] = {int(k): v for k, v in sorted(s["k_histogram"].items())}
        spec_cycles = sum(v for k, v in s["k_histogram"].items() if k > 0)
        s.update(acceptance_stats(s["accepted_tokens"], s["drafted_tokens"], s["rejections"], spec_cycles))
        prefetched = self.planner is not None and s.get("prefetch_issued")  # spec-lru never prefetches
        s["prefetch_recall"] = s["recall_hits"] / s["recall_total"] if prefetched and s["recall_total"] else None
        s["cuda_graphs"] = graph_summary(self.graph_warmups)
        s["compiled"] = [name for name, ran, step in (("draft", self._step_drafted, self.draft_step),
                                                      ("verify", self._step_verified, self.verify_step))
                         if ran and getattr(step, "compiled", False)]
        return s

    def close(self) -> None:
        self.target.close()


def acceptance_stats(accepted: int, drafted: int, rejections: int, spec_cycles: int) -> dict:
    """acceptance_rate is alpha, the probability that a drafted token is accepted given that the
    ones before it were: accepted / (accepted + rejected), where a cycle rejects at most one token
    and drafts after it are never tried. It measures the draft and does not depend on K.
    draft_efficiency = accepted / drafted also counts the drafts past a rejection, so it falls as
    the governor picks a longer K (which it does when copies, not drafting, bound the cycle).
    Each is None when nothing was drafted (not applicable, rather than a measured zero)."""
    tried = accepted + rejections
    return dict(acceptance_rate=accepted / tried if tried else None,
                draft_efficiency=accepted / drafted if drafted else None,
                accepted_per_cycle=accepted / spec_cycles if spec_cycles else None)


GRAPH_CACHE_MIN = 1024  # tokens: the smallest KV cache made while the steps run as CUDA graphs


def _graph_memory(device) -> int | None:
    """Device memory the caching allocator holds (CUDA graphs' pools included); None off CUDA."""
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.memory_reserved(device)


def _recorded_graphs(device) -> int | None:
    """CUDA graphs cudagraph trees hold for this thread (their nodes); None off CUDA or if unknown."""
    if torch.device(device).type != "cuda":
        return None
    try:
        from torch._inductor import cudagraph_trees

        index = torch.device(device).index
        mgr = cudagraph_trees.get_container(torch.cuda.current_device() if index is None else index).tree_manager
        if mgr is None:
            return 0
        todo, n = [node for nodes in mgr.roots.values() for node in nodes], 0
        while todo:
            node = todo.pop()
            n += 1
            todo.extend(c for cs in node.children.values() for c in cs)
        return n
    except Exception:  # noqa: BLE001 -- a private structure: report unknown rather than fail a generation
        return None


def graph_summary(warmups: list[dict]) -> dict | None:
    """What the CUDA graphs recorded before generating cost, over threads and caches: recordings (the
    steps' bound), recorded (counted in cudagraph trees, CUDA), device bytes the allocator took."""
    if not warmups:
        return None
    total = lambda key: None if any(w[key] is None for w in warmups) else sum(w[key] for w in warmups)  # noqa: E731
    return dict(recordings=total("recordings"), recorded=total("recorded"), bytes=total("bytes"),
                warmups=len(warmups), threads=len({w["thread"] for w in warmups}))


class Plan:
    """The draft's request to plan: read lookahead rows up to `upto` and issue the copies they newly
    predict. host: from the host mirror the sync-free draft publishes to. final: the draft is done;
    its copies are all issued before verification starts."""

    __slots__ = ("upto", "host", "final")

    def __init__(self, upto: int, host: bool = False, final: bool = False):
        self.upto, self.host, self.final = upto, host, final


class _PlannerTask:
    """The async driver's ops. A `Plan` goes to a planner task (one a cycle), which awaits the rows it
    names (published rows' events, polled: a completed future's worth on CPU) and plans, while the
    draft coroutine goes on launching steps; the final request waits for the task, so its error, if
    any, surfaces in the cycle. Every other op is awaited (`op.landed()`)."""

    def __init__(self, decoder: SpeculativeDecoder):
        self.decoder = decoder
        self.requests: asyncio.Queue[Plan] = asyncio.Queue()
        self.task: asyncio.Task | None = None

    async def resolve(self, op):
        if not isinstance(op, Plan):
            return await op.landed()
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._plan())
        elif self.task.done():
            self.task.result()  # it failed: raise its error here, in the cycle
        self.requests.put_nowait(op)
        if op.final:
            task, self.task = self.task, None
            return await task
        await asyncio.sleep(0)  # the planner's turn, if its rows are there

    async def _plan(self) -> None:
        dec = self.decoder
        while True:
            op = await self.requests.get()
            upto = op.upto
            if op.host:
                lookahead = dec.draft_step.lookahead
                if not op.final:
                    await sansio.poll(lambda: lookahead.ready() >= op.upto)
                upto = lookahead.ready()
            with span("plan"):
                dec.planner.plan(upto, host=op.host)
            if op.final:
                return

    async def close(self) -> None:
        """On every way out of a generation (its end, an error, cancellation): no task left behind."""
        task, self.task = self.task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
