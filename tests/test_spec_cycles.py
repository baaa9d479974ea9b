"""Governor-driven cycles, end to end (the governor alone: tests/test_governor.py): an engine whose
draft returns garbage decodes with K = 0 almost always (and is still lossless); K_max = 0 is plain
decoding and a bad K_max a ConfigError; an exact draft's routers cover verification's experts; a
cycle withdraws the prefetches it did not need.
"""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

import specter
import specter.builder as builder
import specter.speculative.decoder as decoder_mod
from specter.layers import KVCache
from specter.moe import ExpertWeights, ResidentExperts
from specter.offload.link import EmulatedLink
from specter.offload.manager import OffloadedExperts
from specter.sampling import SamplingParams, probs
from specter.sampling import accept_greedy, accept_on_device
from specter.speculative.draft import DraftExperts, Lookahead, PrefetchPlanner
from specter.speculative.governor import Governor

from speculative_common import *  # noqa: F401,F403 -- constants, helpers and fixtures of these tests
from speculative_common import fast_link, resident_tokens  # noqa: F401 -- fixtures


# ---------------------------------------------------------------------------------------------- 4. governor
# (the governor alone, against simulated cycle costs: tests/test_governor.py)
def settled(decisions, last: int = 50) -> Counter:
    return Counter(k for k, probe in decisions[-last:] if not probe)


def test_engine_with_garbage_draft_settles_on_plain_decoding(tiny, fast_link, resident_tokens, monkeypatch):
    """The draft's experts return large noise: its tokens are garbage, so the governor must decode
    with K = 0 almost all the time (probes aside) -- and the output is still the resident one. The
    governor reads injected costs (under load, measured ones once made it speculate 7 of 26 times)."""
    path, _ = tiny("qwen3_moe", eos_token_id=None)
    engine = load(path, "specter", residency=0.5, k_max=6)
    try:
        g = torch.Generator().manual_seed(0)
        real_call = DraftExperts.__call__

        def garbage(self, layer, x, ids, weights):
            out = real_call(self, layer, x, ids, weights)  # keeps recording the lookahead
            return torch.randn(out.shape, generator=g, dtype=out.dtype) * 100.0

        monkeypatch.setattr(DraftExperts, "__call__", garbage)
        decisions = []
        next_k = engine.decoder.governor.next_k

        def recording_next_k(remaining):
            k = next_k(remaining)
            decisions.append((k, engine.decoder.governor.probe))
            return k

        engine.decoder.governor.next_k = recording_next_k
        observe = engine.decoder.governor.observe_cycle

        def costed(k, accepted, draft_s, verify_s, stall_s, **kw):  # injected costs, not this machine's load:
            return observe(k, accepted, 2e-3 * k, 10e-3 + 1e-3 * k, 0.0, **kw)  # a plain step 10 ms, a draft 2

        engine.decoder.governor.observe_cycle = costed
        prompt, n = [1, 5, 9, 33, 2], 96
        out = engine.generate(prompt, max_new_tokens=n)
    finally:
        engine.close()
    ref = load(path, "resident")
    try:
        assert out.token_ids == ref.generate(prompt, max_new_tokens=n).token_ids
    finally:
        ref.close()
    hist = out.stats["k_histogram"]
    assert out.stats["acceptance_rate"] < 0.2 and sum(v for k, v in hist.items() if k > 0) > 0, out.stats
    assert hist.get(0, 0) >= 0.7 * out.stats["cycles"], hist
    got = settled(decisions, 40)
    assert got[0] >= 0.8 * sum(got.values()), (got, hist)


# ------------------------------------------------------------------------------------------ configuration
@pytest.mark.parametrize("bad", [-1, "3", 2.5, True])
def test_bad_k_max_is_a_config_error(tiny, fast_link, bad):
    path, _ = tiny("qwen3_moe", eos_token_id=None)
    with pytest.raises(specter.ConfigError, match="k_max"):
        load(path, "specter", residency=0.5, k_max=bad)


def test_k_max_zero_is_plain_decoding(tiny, fast_link, resident_tokens):
    """K_max = 0: the speculative engine never drafts, and is still exact."""
    path, _ = tiny("qwen3_moe", eos_token_id=None)
    engine = load(path, "specter", residency=0.5, k_max=0)
    try:
        out = engine.generate(PROMPTS[0], max_new_tokens=NEW)
    finally:
        engine.close()
    assert out.token_ids == resident_tokens("qwen3_moe")[0]
    assert out.stats["drafted_tokens"] == 0 and set(out.stats["k_histogram"]) == {0}


def test_k_max_zero_holds_no_draft(tiny, fast_link, resident_tokens):
    """K_max = 0 quantised, planned and held a draft it never runs: in a device budget its bytes are the
    pool's now, and no draft is made (tokens as exact)."""
    path, _ = tiny("qwen3_moe", eos_token_id=None)
    budget = specter.load(path, device="cpu", policy="on-demand", residency=0.5).plan.total_bytes
    plans = {}
    for k_max in (0, 32):
        engine = specter.load(path, device="cpu", policy="specter", device_memory=budget, k_max=k_max)
        try:
            plans[k_max] = engine.plan
            assert (engine.shared.draft is None) == (k_max == 0)
            if k_max == 0:
                out = engine.generate(PROMPTS[0], max_new_tokens=NEW)
        finally:
            engine.close()
    assert plans[0].draft_bytes == 0 < plans[32].draft_bytes
    with pytest.raises(specter.ConfigError, match="k_max=0 makes no draft, so draft_bits=2 would be ignored"):
        specter.load(path, device="cpu", policy="specter", residency=0.5, k_max=0, draft_bits=2)
    assert plans[0].pool_slots > plans[32].pool_slots
    assert out.token_ids == resident_tokens("qwen3_moe")[0] and set(out.stats["k_histogram"]) == {0}



@pytest.mark.parametrize("residency", [0.5, 1.0])
def test_k_zero_is_plain_decodings_loop_in_runs(tiny, fast_link, resident_tokens, monkeypatch, residency):
    """K = 0 runs plain decoding's own loop (decoder.plain_steps) for the governor's `steps` in a row,
    reported to it once a run (steps=n); a generation stopped early still reports the steps that
    ran. With every expert resident, a new engine decodes a short first generation plainly (the
    governor's start_plain prior), without a speculative cycle."""
    path, _ = tiny("qwen3_moe", eos_token_id=None)
    want = resident_tokens("qwen3_moe")[0]
    engine = load(path, "specter", residency=residency, k_max=4)
    calls, runs = [], []
    real = decoder_mod.plain_steps

    def counting(*a):
        runs.append(a[-1])
        return real(*a)

    monkeypatch.setattr(decoder_mod, "plain_steps", counting)
    try:
        if residency < 1:  # plain decoding forced, without next-layer's arms (their probes cut runs)
            engine.decoder.governor, engine.decoder.fallback = Governor(4, fixed=0), None
            engine.decoder.governor.lane_arms = one_lane_arm(False)  # ... and the host lane's arm throughout
        gov = engine.decoder.governor
        observe = gov.observe_cycle
        gov.observe_cycle = lambda *a, **k: calls.append((a[0], k.get("steps", 1))) or observe(*a, **k)
        n = 16
        out = engine.generate(PROMPTS[0], max_new_tokens=n)
        assert out.token_ids == want[:n]
        assert out.stats["drafted_tokens"] == 0 and out.stats["k_histogram"] == {0: n - 1}
        assert sum(runs) == n - 1 and len(runs) == 1 and calls == [(0, n - 1)], (runs, calls)
        if residency < 1:
            calls.clear()
            ids = []
            for piece in engine.stream_ids(PROMPTS[0], max_new_tokens=n):  # stopped after 4 tokens
                ids += piece
                if len(ids) >= 4:
                    break
            assert calls == [(0, 3)], calls
    finally:
        engine.close()


def test_route_coverage_of_an_exact_draft(tiny, fast_link):
    """A draft whose experts are the target's own full-precision weights routes exactly like the
    target: every expert verification uses for t, d1 .. d_{K-1} was predicted; only d_K (never drafted)
    can surprise. So coverage >= K / (K + 1) with a fixed K, and every drafted token is accepted."""
    path, _ = tiny("qwen3_moe", eos_token_id=None)
    engine = load(path, "specter", residency=0.5, k_max=4)
    try:
        dec = engine.decoder
        dec.governor = Governor(4, fixed=4)
        dec.draft.layers = [ExpertWeights(w.w13.clone(), w.w2.clone()) for w in dec.experts.store]
        out = engine.generate([1, 5, 9, 33, 2], max_new_tokens=41)
        # penalties too: the draft's step i must see the drafted prefix exactly as target row i does
        pen = engine.generate([1, 5, 9, 33, 2], max_new_tokens=41, repetition_penalty=1.5, frequency_penalty=0.7)
    finally:
        engine.close()
    s = out.stats
    assert s["acceptance_rate"] == 1.0 and s["draft_efficiency"] == 1.0, s
    assert s["route_coverage"] >= 4 / 5 and s["route_coverage"] <= 1.0, s
    assert pen.stats["acceptance_rate"] == 1.0 and pen.token_ids != out.token_ids, pen.stats


class GuessLink(EmulatedLink):
    """An emulated link on which a copy issued while `guessing` takes GUESS_S more."""

    guessing = False
    GUESS_S = 0.1

    def seconds(self, dst, src):
        return super().seconds(dst, src) + (self.GUESS_S if self.guessing else 0.0)


def test_a_cycle_leaves_no_queued_prefetch_behind(tiny, resident_tokens, monkeypatch):
    """Prefetches still queued when verification ends were guesses it did not need (it waits for
    every copy it needs): the cycle withdraws them, so the steps after it queue behind nothing.
    A wrong guess is forced: after the draft's last plan, the last layer prefetches experts the draft
    did not predict, each guess taking 0.1 s on the link, so that whatever the machine's load all but
    the first are still queued when verification ends (its own copies go before any not started).
    After every cycle, each copy in flight has started, the slots' bookkeeping holds, and the tokens
    are exact."""
    link = GuessLink(5e6, 1e-3, name="slow")
    monkeypatch.setattr(builder, "make_link", lambda device, profile=None, **kw: link)
    path, _ = tiny("qwen3_moe", eos_token_id=None)
    engine = load(path, "specter", residency=0.5, k_max=2)
    try:
        dec = engine.decoder
        dec.governor = Governor(2, fixed=2)
        mgr, planner, cycle, queued = dec.experts, dec.planner, dec._cycle, []
        plan, last = planner.plan, mgr.slots.n_layers - 1

        def plan_and_guess(upto, host=False):
            n = plan(upto, host)
            if upto == planner.k:  # the draft is over: guess wrong on the layer verification reaches last
                unpredicted = [e for e in reversed(range(mgr.slots.n_experts)) if e not in planner.demand[last]]
                link.guessing = True
                try:
                    n += mgr.prefetch(last, unpredicted, protect=set(planner.demand[last]))
                finally:
                    link.guessing = False
            return n

        def checked(*a, **kw):
            out = cycle(*a, **kw)
            queued.append(sum(t.t_started is None for t in mgr.inflight.values()))
            mgr.slots.check()
            return out

        planner.plan, dec._cycle = plan_and_guess, checked
        outs = [engine.generate(p, max_new_tokens=NEW, temperature=0.0) for p in PROMPTS[:2]]
    finally:
        engine.close()
    assert [o.token_ids for o in outs] == resident_tokens("qwen3_moe")[:2]
    assert queued and max(queued) == 0, queued
    assert total(outs, "prefetch_cancelled") > 0


def one_lane_arm(copy_only: bool, seen: list | None = None):
    """A stand-in for the governor's lane_arms that always picks `copy_only` (observations into `seen`)."""
    import types

    def observe(arm, step_s, steps=1, misses=None):
        if seen is not None:
            seen.append((arm, steps))
    return types.SimpleNamespace(pick=lambda: copy_only, probing=False, next=10 ** 9, n=0, observe=observe)


class _AllToHost:
    """An injected lane choice: every missing expert to the host lane."""

    def __init__(self, mgr, params, planner=None):
        pass

    def __call__(self, layer, missing, routed):
        return list(missing)


def test_plain_steps_measure_the_host_lane_against_copying(tiny, resident_tokens, monkeypatch):
    """specter's K = 0 runs pick the host lane for their misses or copy every one (the governor's
    lane_arms, copying the arm that must prove faster): copying, plain steps send nothing to the
    host; with the lane, the injected choice sends every miss there; the choice is back for
    verification and prefill after every run, and the tokens are resident's."""
    path, _ = tiny("mixtral", eos_token_id=None)
    want = resident_tokens("mixtral")[0][:12]  # greedy: the first 12 of its NEW tokens
    monkeypatch.setattr(builder, "LaneChoice", _AllToHost)
    stats = {}
    for copy_only in (True, False):
        engine = load(path, "specter", residency=0.25, k_max=4)
        gov = engine.decoder.governor = Governor(4, fixed=0)
        engine.decoder.fallback = None
        choice = engine.decoder.experts.host_choice
        seen = []
        gov.lane_arms = one_lane_arm(copy_only, seen)
        try:
            engine.generate(PROMPTS[1], max_new_tokens=8)  # warm-up: the slots hold the prompt's experts
            out = engine.generate(PROMPTS[0], max_new_tokens=12)
            assert engine.decoder.experts.host_choice is choice  # restored after every run
        finally:
            engine.close()
        assert out.token_ids == want
        assert seen and all(arm == copy_only for arm, _ in seen) and sum(n for _, n in seen) == 7 + 11
        stats[copy_only] = out.stats
    # the prefill sends its misses to the host either way; the plain steps only with the lane
    assert stats[True]["h2d_bytes"] > 0 == stats[False]["h2d_bytes"], stats
    assert stats[True]["host_experts"] < stats[False]["host_experts"], stats


def test_no_next_layer_arm_while_plain_steps_copy_nothing(tiny, resident_tokens):
    """A next-layer guess only saves a copy that a plain step would make: while the governor's window of
    plain runs copied nothing (plain_copies_nothing), K = 0 runs neither guesses nor picks between
    the next-layer arms (whose timing races then cost the router for nothing); once a plain run has
    copied, they pick again. The tokens are resident's either way."""
    path, _ = tiny("mixtral", eos_token_id=None)
    want = [ts[:10] for ts in resident_tokens("mixtral")[:2]]  # greedy: the first 10 of its NEW tokens
    engine = load(path, "specter", residency=0.25, k_max=4)
    gov = engine.decoder.governor = Governor(4, fixed=0)
    gov.lane_arms = one_lane_arm(True)  # every miss copied, no lane probes
    picks, real = [], gov.plain_arms.pick
    gov.plain_arms.pick = lambda: picks.append(1) or real()
    try:
        for _ in range(8):  # the latest plain runs copied nothing
            gov.observe_cycle(0, 0, 0.0, 3e-3, 0.0, copied=0)
        assert gov.plain_copies_nothing
        out = engine.generate(PROMPTS[0], max_new_tokens=10)
        assert out.token_ids == want[0] and picks == [] and out.stats["prefetch_issued"] == 0
        gov.observe_cycle(0, 0, 0.0, 3e-3, 0.0, copied=1)  # a plain run copied: there may be something to prefetch
        assert not gov.plain_copies_nothing
        out = engine.generate(PROMPTS[1], max_new_tokens=10)
        assert out.token_ids == want[1] and picks
    finally:
        engine.close()


def test_an_unmeasured_lane_arm_caps_no_run_while_plain_steps_copy_nothing(tiny, resident_tokens):
    """The lane arms act on misses only. Where plain steps copy nothing, the copy-all arm that no run
    has measured is probed by every lane pick: capped at LANE_PROBE steps, each such probe cut every
    plain run to 4 steps (a decision, both arm sets and the stats read each time). While the
    governor's window of plain runs copied nothing, that probe runs the governor's full `steps`;
    once a plain run copies, it is capped again. The tokens are resident's either way."""
    from specter.speculative.governor import PlainArms

    path, _ = tiny("mixtral", eos_token_id=None)
    want = resident_tokens("mixtral")[0][:12]  # greedy: the first 12 of its NEW tokens
    runs = {}
    for clean in (True, False):
        class Forced(Governor):  # the window of plain runs as the case says, whatever the runs copy
            plain_copies_nothing = property(lambda self: clean, lambda self, value: None)

        engine = load(path, "specter", residency=0.25, k_max=4)
        if engine.decoder.experts.host_choice is None:
            engine.close()
            pytest.skip("no host lane at this budget")
        gov = engine.decoder.governor = Forced(4, fixed=0)  # K = 0 throughout: steps = what is left
        engine.decoder.fallback = None  # no next-layer arms
        lanes = gov.lane_arms = PlainArms(margin=0.03)
        lanes.t[False] = 1e-3  # the host lane measured, copying every miss never (as after a prefill's misses)
        seen, real = [], lanes.observe
        lanes.observe = lambda arm, step_s, steps=1, misses=None: seen.append((arm, steps)) or real(
            arm, step_s, steps, misses)
        try:
            out = engine.generate(PROMPTS[0], max_new_tokens=12)
        finally:
            engine.close()
        assert out.token_ids == want
        assert seen[0][0] is True  # the first run probes the unmeasured copy-all arm
        runs[clean] = seen
    assert runs[True][0][1] == 11, runs  # all the steps left, in one run
    assert runs[False][0][1] == decoder_mod.LANE_PROBE, runs
