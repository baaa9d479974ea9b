"""The decoders: plain (one target step a token) and speculative (draft K, verify K+1, accept).

One speculative cycle, as data flows:

    pending token t at position n (cache committed to [0, n))
    draft   t, d1 .. d_{K-1} at n .. n+K-1   -> d1 .. dK (d_i: position n+i's noise), lookahead rows 0..K-1
            at chunk boundaries the planner reads the new rows and starts the target's copies
    verify  [t, d1 .. dK] at n .. n+K in one target pass (experts grouped; resident first)
    accept  m drafted tokens + one target token (the target's own draws at n+1 .. n+K+1, the same noise);
            cache is committed to n+m+1 (the rest is scratch)

The draft writes its K/V into the same cache past the committed length; verification overwrites
those positions with the target's own, so there is never a second cache and rollback is free.

`run()` is the one body of a generation: a generator of committed chunks. It blocks only where the
hardware makes it: an offload manager's layer waits for copies it needs (a stream wait on CUDA,
the emulated link's sleep on CPU); the copies themselves run concurrently (the link's stream or
thread), overlapping the draft. asyncio callers get it through `streaming.in_thread`.
"""
from __future__ import annotations

import time
from collections import Counter
from functools import partial
from typing import Iterator

import torch

from specter.compiled.capture import GraphRecordings

from ..layers import KVCache
from ..model import MoETransformer
from ..offload.manager import OffloadedExperts
from .. import profiling
from ..profiling import NULL, span
from ..sampling import History, SamplingParams, accept_on_device, accept_prefix, sample
from .draft import DraftExperts, PrefetchPlanner
from .governor import Governor
from .timing import CycleTimes, clock_for


LANE_PROBE = 4  # plain steps a probe of the other host-lane arm runs (one step sees only what a copy costs)


def plain_steps(model: MoETransformer, experts, tok: torch.Tensor, pos: int, cache: KVCache, params: SamplingParams,
                draws, hist, n: int) -> Iterator[list[int]]:
    """n target steps, the first on `tok` (the last sampled token, [1]) at position `pos`: yields
    each step's sampled token (for position pos + 1, ...; `draws`: sampling.Draws) as a one-id list, committed to
    `hist` (None: no penalty). The plain decoder's loop, and the speculative decoder's K = 0 steps: the same code,
    so that K = 0 is plain decoding's work."""
    for pos in range(pos, pos + n):
        logits = model(tok, pos, cache, experts)  # [1, V]
        tok = sample(logits, params, draws, hist, pos=pos + 1)  # [1]
        t = int(tok)
        if hist is not None:
            hist.commit([t])
        yield [t]


class KeptCache:
    """A decoder's KV cache kept across generations (one generation runs at a time) and grown only
    when a generation needs more: its compiled steps (`compiled_steps()`) then replay their CUDA graphs
    on the same buffer addresses instead of re-recording them every generation. Stale rows past the
    committed length are scratch, as within a generation. Needs `model`, `device`, `dtype` and
    `graphs` (GraphRecordings)."""

    _cache: KVCache | None = None  # the cache kept
    _caches = 0                    # how many made so far
    context: int | None = None     # the most positions it grows to (the engine's context; None: the model's)

    def compiled_steps(self) -> tuple:
        return ()

    def _kv_cache(self, need: int) -> KVCache:
        cache = self._cache
        if cache is None or cache.max_len < need:  # grow geometrically, within the model's context
            max_pos = self.context or self.model.spec.max_position
            size = need if cache is None else max(need, min(2 * cache.max_len, max_pos))
            if self.graphs.needed(self.compiled_steps()):  # each new cache is a new set of recordings: a useful size
                size = max(size, min(self.graphs.CACHE_MIN, max_pos))
            cache = self._cache = KVCache(self.model.spec, size, self.device, self.dtype)
            self._caches += 1
        return cache

    def record_graphs(self, tokens: int = 0) -> None:
        """Record the CUDA graphs now, on the calling thread, for a KV cache of at least `tokens`
        positions (the one generations will use): for a thread that will generate (a server's engine
        thread) to call before its first request. Generations do it themselves when needed."""
        steps = self.compiled_steps()
        if self.graphs.needed(steps):
            self.graphs.record(steps, self._kv_cache(max(tokens, 1)), self._caches)


class PlainDecoder(KeptCache):
    """Prefill, then one target step per token. `experts` decides where expert bytes come from;
    `guess`: the next-layer policy (draft.NextLayerPrefetch) the offload manager runs with every step;
    `step`: a compiled one-token step (compiled/verify_step.py's VerifyStep at width 1, CUDA graphs
    on CUDA) the steps after prefill run through, as the speculative decoder's K = 0 steps do."""

    def __init__(self, model: MoETransformer, experts, device, dtype, *, guess=None, step=None):
        self.model, self.experts, self.device, self.dtype, self.guess = model, experts, device, dtype, guess
        self.step = step
        self.graphs = GraphRecordings(device)  # CUDA graphs recorded before generating

    def compiled_steps(self) -> tuple:
        return (self.step,)

    def run(self, prompt: list[int], params: SamplingParams, max_new: int) -> Iterator[list[int]]:
        """Lists of one committed token id."""
        experts = self.experts if self.guess is None else partial(self.experts, guess=self.guess)
        if self.step is None:
            cache = KVCache(self.model.spec, len(prompt) + max_new, self.device, self.dtype)
        else:  # kept, so that its graphs replay; the step pads nothing (one width: 1)
            cache = self._kv_cache(len(prompt) + max_new + self.step.headroom)
            self.graphs.record(self.compiled_steps(), cache, self._caches)
        draws = params.draws(self.device)
        hist = History(prompt, self.device) if params.penalized else None  # what penalties look at
        tokens = torch.tensor(prompt, device=self.device)
        logits = self.model(tokens, 0, cache, experts, logits_for="last")  # [1, V]
        tok = sample(logits, params, draws, hist, pos=len(prompt))  # [1]
        t = int(tok)
        if hist is not None:
            hist.commit([t])
        yield [t]
        step = self.model if self.step is None else self.step.step
        yield from plain_steps(step, experts, tok, len(prompt), cache, params, draws, hist, max_new - 1)

    def stats(self) -> dict:
        s = dict(getattr(self.experts, "stats", lambda: {})())
        if self.step is not None:
            s["compiled"] = ["verify"] if getattr(self.step, "compiled", False) else []
            s["cuda_graphs"] = self.graphs.summary()
        return s

    def reset_stats(self) -> None:
        if hasattr(self.experts, "reset_stats"):
            self.experts.reset_stats()

    def close(self) -> None:
        getattr(self.experts, "close", lambda: None)()


class SpeculativeDecoder(KeptCache):
    """`experts`: the target's expert provider (the offload manager); `draft`: the INT4 one. Optional
    collaborators: `planner` (None: spec-lru, verification fetches on demand), `fallback` (next-layer
    prefetch for K = 0 steps, used when it measures faster), `draft_step` / `verify_step` (the
    sync-free draft and the piecewise verifier of compiled/, else the eager model)."""

    def __init__(self, model: MoETransformer, experts: OffloadedExperts, draft: DraftExperts, device, dtype, *,
                 governor: Governor, planner: PrefetchPlanner | None = None, fallback=None,
                 draft_step=None, verify_step=None):
        self.model, self.experts, self.draft = model, experts, draft
        self.device, self.dtype = device, dtype
        self.governor, self.planner, self.fallback = governor, planner, fallback
        self.draft_step, self.verify_step = draft_step, verify_step
        self._guessing = None                   # the offload manager with next-layer guesses (set by run)
        self.plan_backlog = 1                   # plan after the first drafted row at once (copies should start
                                                # early), later at chunk boundaries only when at most this many
                                                # copies are queued (planning into a backlog costs draft time)
        self.cancel_leftovers = True            # withdraw a cycle's prefetches still queued when it ends
        self.times = CycleTimes(clock_for(device))  # draft and verify times: CUDA events on CUDA, else wall clock
        self.graphs = GraphRecordings(device)   # CUDA graphs recorded before generating
        self.reset_stats()

    def run(self, prompt: list[int], params: SamplingParams, max_new: int) -> Iterator[list[int]]:
        """Lists of committed token ids, the first one after prefill, then one a cycle."""
        # no scratch beyond the plan's context: K <= remaining - 1 keeps drafts and verification inside
        # positions [0, len(prompt) + max_new - 1)
        headroom = self.verify_step.headroom if self.verify_step is not None else 0  # it pads to a width bucket
        cache = self._kv_cache(len(prompt) + max_new + headroom)
        self._guessing = None if self.fallback is None else partial(self.experts, guess=self.fallback)
        if self.draft_step is not None or self.verify_step is not None:
            self.graphs.record(self.compiled_steps(), cache, self._caches)
        draws = params.draws(self.device)
        hist = History(prompt, self.device) if params.penalized else None  # what penalties look at
        if self.planner is not None:  # a new context: what earlier text used predicts it as little as T steps ago
            self.planner.begin_prefill(len(prompt))
        logits = self.model(torch.tensor(prompt, device=self.device), 0, cache, self.experts, logits_for="last")
        t = int(sample(logits, params, draws, hist, pos=len(prompt)))
        if hist is not None:
            hist.commit([t])
        n, produced = len(prompt), 1
        yield [t]
        gov, mgr = self.governor, self.experts
        gov.new_context()  # an earlier prompt's backed-off probes must not keep speculation out of this one
        if gov.arm is None and mgr.all_resident:  # a prior: nothing to copy, so nothing for a draft to hide
            gov.start_plain()
        # K = 0 runs plain decoding's own loop (plain_steps) for as many steps as the governor will not
        # reconsider, timed around it (each step reads its token on the host: a sync, so wall time)
        step = self.model if self.verify_step is None else self.verify_step.step
        clock = time.perf_counter
        choice = getattr(mgr, "host_choice", None)  # both lanes (LaneChoice): plain steps measure it against copying
        while produced < max_new:
            k = gov.next_k(max_new - produced)
            if k:
                new = self._cycle(t, n, k, cache, params, draws, hist)
                if hist is not None:
                    hist.commit(new)
                n += len(new)
                t = new[-1]
                produced += len(new)
                yield new
                continue
            steps = gov.steps
            arm = lane = None  # with or without next-layer guesses, when there is something to prefetch:
            # a guess only saves a copy a step would make, so while plain steps copy nothing none is made
            if self._guessing is not None and not mgr.all_resident and not gov.plain_copies_nothing:
                arms = gov.plain_arms
                arm = arms.pick()
                steps = 1 if arms.probing else max(1, min(steps, arms.next - arms.n))  # up to its next probe
            if choice is not None:  # with the host lane for misses, or every miss copied (lane True)
                lanes = gov.lane_arms
                lane = lanes.pick()
                # a probe runs LANE_PROBE steps (copying pays back over the steps after its copies), but one of an
                # arm no run measured runs them all while plain steps copy nothing: without a miss either arm costs
                # the same, and capped, every run would be its probe where nothing misses
                if lanes.probing and not (gov.plain_copies_nothing and lanes.t[lane] is None):
                    steps = min(steps, LANE_PROBE)
                elif not lanes.probing:
                    steps = max(1, min(steps, lanes.next - lanes.n))
                mgr.host_choice = None if lane else choice
            done, spent, before = 0, 0.0, mgr.stats()  # what the run copies and reads on the host lane, and misses
            x = torch.tensor([t], device=self.device)
            t0 = clock()
            try:
                for new in plain_steps(step, self._guessing if arm else mgr, x, n, cache, params, draws, hist, steps):
                    spent += clock() - t0
                    done += 1
                    yield new
                    t0 = clock()
            finally:  # also when the caller stops early: the steps that ran are measured
                mgr.host_choice = choice  # verification keeps both lanes
                self._observe_plain(done, spent, before, arm, lane)
            n += done
            t = new[0]
            produced += done

    def compiled_steps(self) -> tuple:
        return (self.draft_step, self.verify_step)

    def _cycle(self, t: int, n: int, k: int, cache: KVCache, params: SamplingParams, draws, hist) -> list[int]:
        """One speculative cycle (K >= 1) -> the committed tokens (m accepted drafts + the target's own)."""
        st, mgr = self._stats, self.experts
        st["k_histogram"][k] += 1
        st["cycles"] += 1
        m0 = self.times.mark()
        sync_free = self.draft_step is not None and not params.penalized
        if sync_free:  # drafted tokens stay on the device until acceptance
            tokens = self._draft_on_device(t, n, k, cache, params, draws)
            self._step_drafted += k
        else:
            drafted = self._draft(t, n, k, cache, params, draws, hist)
            tokens = torch.tensor([t] + drafted, device=self.device)
        m1 = self.times.mark()
        before = mgr.stats()  # stall_s drains the link's measured waits (CUDA: stream waits timed by events)
        with span("verify") if profiling.ON else NULL:  # the target over [t, d1 .. dK], as a K = 0 step runs it
            logits = (self.model if self.verify_step is None else self.verify_step.step)(tokens, n, cache, mgr)
        if self.cancel_leftovers:  # what verification did not wait for, it did not need:
            mgr.cancel_prefetches()  # the next cycle must not queue behind it nor be billed for it
        if self.planner is not None:
            self.planner.end_cycle()
        # row i of the target sees the history plus drafted[:i], exactly as the draft's step i did
        with span("accept") if profiling.ON else NULL:
            if sync_free:  # no penalties: nothing depends on the history
                m, nxt, drafted = accept_on_device(tokens, logits, params, draws, n + 1)  # one host read
            else:  # the target's token at each row (its draw for n+1+i, row i's history with drafted[:i])
                m, nxt = accept_prefix(drafted, sample(logits, params, draws, hist, drafted, pos=n + 1).tolist())
        mgr.demote_rejected(m + 1)  # rows 0..m ran on committed tokens, the rest on rejected drafts
        m2 = self.times.mark()
        stall = self._count_verification(before, k, m)
        if self.times.wall:  # CPU: wall-clock readings, known now
            self._observe_cycle(k, m, stall, m1 - m0, m2 - m1)
        else:  # CUDA: events, read once they have completed (timing.py)
            self.times.submit((m0, m1, m2), partial(self._observe_cycle, k, m, stall))
        return drafted[:m] + [nxt]

    def _count_verification(self, before: dict, k: int, m: int) -> float:
        """A verification of k drafts that accepted m, the manager's stats read `before` it: recall (the
        share of its experts resident or in flight when it reached them) and acceptance into the stats.
        -> its stall seconds."""
        st, after = self._stats, self.experts.stats()
        hits = after["expert_hits"] - before["expert_hits"]
        st["recall_hits"] += hits
        st["recall_total"] += hits + after["expert_misses"] - before["expert_misses"]
        st["drafted_tokens"] += k
        st["accepted_tokens"] += m
        st["rejections"] += m < k
        return after["stall_s"] - before["stall_s"]

    def _observe_cycle(self, k: int, m: int, stall: float, draft_s: float, verify_s: float) -> None:
        """A speculative cycle's times, once readable (timing.py): into the stats and the governor."""
        st = self._stats
        st["draft_s"] += draft_s
        st["verify_s"] += verify_s
        self.governor.observe_cycle(k, m, draft_s, verify_s, stall)

    def _observe_plain(self, steps: int, seconds: float, before: dict, arm: bool | None,
                       lane: bool | None = None) -> None:
        """A run of `steps` plain steps took `seconds` since the manager's stats read `before`: into the
        stats, the governor (unless the run probed a plain arm) and the plain arms (`arm`: the
        next-layer arm it ran, `lane`: True when it copied every miss, False when the host lane took
        some, rated per miss; None: no such arms)."""
        st, mgr, gov = self._stats, self.experts, self.governor
        st["k_histogram"][0] += steps
        st["cycles"] += steps
        st["verify_s"] += seconds
        if arm and self.cancel_leftovers:  # only next-layer prefetches: misses are never withdrawn
            mgr.cancel_prefetches()
        if not steps:
            return
        after = mgr.stats()
        missed = after["expert_misses"] - before["expert_misses"]
        # a probe is not what K = 0 costs (as in _cycle); the lanes act on misses only, so a run that
        # missed nothing ran as either lane arm would: no lane probe (else, where plain steps never
        # miss, every run probes an arm it cannot measure and the governor never sees K = 0)
        probing = ((arm is not None and gov.plain_arms.probing)
                   or (lane is not None and missed > 0 and gov.lane_arms.probing))
        if not probing:
            gov.observe_cycle(0, 0, 0.0, seconds / steps, 0.0, steps=steps,
                              copied=max(0, after["offloaded_bytes"] - before["offloaded_bytes"]))
        if arm is not None:
            gov.plain_arms.observe(arm, seconds / steps, steps)
        if lane is not None:
            gov.lane_arms.observe(lane, seconds / steps, steps, missed)
        if self.times.pending:  # CUDA: speculative cycles whose events completed meanwhile
            self.times.poll()

    def _draft_on_device(self, t: int, n: int, k: int, cache: KVCache, params: SamplingParams, draws):
        """K draft steps without a host sync (compiled/draft_step.py) -> tokens [K+1] (the pending token,
        then the drafted ones), on the device. The planner reads only lookahead rows whose copies to the
        host have landed."""
        ds, planner, link = self.draft_step, self.planner, self.experts.link
        ds.begin(t, n, params)
        if planner is not None:
            chunk = planner.begin_cycle(k, self.governor.draft_s or 0.0)
        for i in range(k):
            with span("draft step") if profiling.ON else NULL:
                ds.step(cache, draws)
            if planner is not None and (i == 0 or ((i + 1) % chunk == 0 and link.pending() <= self.plan_backlog)):
                with span("plan") if profiling.ON else NULL:
                    planner.plan(ds.lookahead.ready(), host=True)
        if planner is not None:
            with span("plan") if profiling.ON else NULL:
                planner.plan(ds.lookahead.ready(), host=True)
        return ds.tokens[:k + 1]

    def _draft(self, t: int, n: int, k: int, cache: KVCache, params: SamplingParams, draws, hist) -> list[int]:
        """K eager draft steps -> the drafted tokens (d_i drawn for position n+1+i)."""
        drafted = []
        planner, link = self.planner, self.experts.link
        if planner is not None:
            chunk = planner.begin_cycle(k, self.governor.draft_s or 0.0)
        draft, tok = self.draft, t
        for i in range(k):
            with span("draft step") if profiling.ON else NULL:
                draft.row = i
                logits = self.model(torch.tensor([tok], device=self.device), n + i, cache, draft)  # [1, V]
                tok = int(sample(logits, params, draws, hist, drafted, pos=n + 1 + i))
            drafted.append(tok)
            if planner is not None and (i == 0 or ((i + 1) % chunk == 0 and link.pending() <= self.plan_backlog)):
                with span("plan") if profiling.ON else NULL:
                    planner.plan(i + 1)
        draft.row = None
        if planner is not None:
            with span("plan") if profiling.ON else NULL:
                planner.plan(k)
        return drafted

    # ------------------------------------------------------------------------------ stats
    def reset_stats(self) -> None:
        if self.times.pending:
            self.times.poll()  # what earlier cycles measured still reaches the governor, not the new stats
        self.experts.reset_stats()  # the planner's route coverage starts over at each prefill (begin_prefill)
        self._stats = dict(cycles=0, drafted_tokens=0, accepted_tokens=0, rejections=0,
                           draft_s=0.0, verify_s=0.0, recall_hits=0, recall_total=0, k_histogram=Counter())
        self._step_drafted = 0  # tokens drafted by draft_step (it does not run with penalties)

    def stats(self) -> dict:
        if self.times.pending:
            self.times.poll()  # cycles whose events completed since they were submitted
        s = {**self.experts.stats(), **self._stats}
        if self.planner is not None:
            s["cover_hits"], s["cover_total"] = self.planner.cover_hits, self.planner.cover_total
            s["route_coverage"] = s["cover_hits"] / s["cover_total"] if s["cover_total"] else None
        s["k_histogram"] = dict(sorted(s["k_histogram"].items()))
        spec_cycles = s["cycles"] - s["k_histogram"].get(0, 0)
        s.update(acceptance_stats(s["accepted_tokens"], s["drafted_tokens"], s["rejections"], spec_cycles))
        prefetched = self.planner is not None and s.get("prefetch_issued")  # spec-lru never prefetches
        s["prefetch_recall"] = s["recall_hits"] / s["recall_total"] if prefetched and s["recall_total"] else None
        s["cuda_graphs"] = self.graphs.summary() if self.graphs.warmups else None
        s["compiled"] = []
        for name, ran, step in (("draft", self._step_drafted, self.draft_step),  # every cycle and K = 0 step
                                ("verify", s["cycles"], self.verify_step)):     # verifies through verify_step
            if ran and getattr(step, "compiled", False):
                s["compiled"].append(name)
        return s

    def close(self) -> None:
        self.experts.close()


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
