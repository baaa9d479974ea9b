"""Expert offloading: lossless against `resident`, and the slot cache's invariants under a slow link.

Losslessness: `on-demand`, `next-layer` and `host` at several budgets produce exactly the greedy tokens of
`resident` (fp32, CPU) on tiny checkpoints of three architectures (one with a shared expert and a
dense first layer each: deepseek_v2 and qwen2_moe with mlp_only_layers=[0]; mixtral with neither),
and on the bundled default model when it is present.

Invariants: `Watch` wraps an `OffloadedExperts` as the model's expert provider and, through a
patched `expert_rows`, inspects every expert at the moment a grouped call computes it: its copy
has completed (the link's transfer is done, the expert is ready and remapped), it is computed from
its device slot through the remap table, the slot holds exactly the store's weights, no expert is
computed twice in one layer call, and the slot is still its own (not evicted, not overwritten)
when the call ends. After every layer call it runs `SlotCache.check()` and
checks that in-flight copies and loading slots agree and that every ready slot holds its expert.
A deliberately slow `EmulatedLink` keeps copies in flight while layers run.
"""
from __future__ import annotations

import random
import threading

import pytest
import torch

import specter
import specter.builder as builder
import specter.offload.plan as plan
import specter.offload.manager as manager_mod
from specter.moe import ExpertWeights, ResidentExperts
from specter.offload.link import EmulatedLink
from specter.offload.manager import OffloadedExperts

CASES = [("deepseek_v2", {}), ("qwen2_moe", {"mlp_only_layers": [0]}), ("mixtral", {})]
IDS = [a for a, _ in CASES]
PROMPTS = [[1, 5, 9, 33, 2], [7, 7, 7], list(range(10, 40)), [100, 3, 64, 12, 90, 45, 8]]
NEW = 24
# (budget, slots per layer) for 8 experts, top-2, on the shared pool (the default) unless slot_pool="layer".
# expert_memory is given here in slots and turned into the bytes of that many slots in every MoE layer;
# pool_slots into the bytes of that many slots in all: 2 (one layer's top-2) is below the per-layer
# rule's floor (2 in every layer), and every layer's experts then take turns in the same slots. The
# lfu budgets also switch the slot cache to LFU eviction.
BUDGETS = [({"residency": 0.25}, 2), ({"residency": 0.5}, 4), ({"residency": 1.0}, 8), ({"expert_memory": 3}, 3),
           ({"residency": 0.375, "eviction": "lfu"}, 3), ({"residency": 0.25, "slot_pool": "layer"}, 2),
           ({"pool_slots": 2}, None), ({"pool_slots": 3, "eviction": "lfu", "slot_pool": "open"}, None)]
POLICIES = ["on-demand", "next-layer"]
LOSSLESS_POLICIES = POLICIES + ["host"]  # host: the experts not resident computed on the host lane


def expert_bytes_fp32(ref) -> tuple[int, int]:
    """(bytes of one fp32 routed expert, MoE layers), from the transformers config: 3 * hidden * inter * 4."""
    c = ref.config
    if c.model_type == "deepseek_v2":
        return 3 * c.hidden_size * c.moe_intermediate_size * 4, c.num_hidden_layers - c.first_k_dense_replace
    if c.model_type == "qwen2_moe":
        return 3 * c.hidden_size * c.moe_intermediate_size * 4, c.num_hidden_layers - len(c.mlp_only_layers)
    return 3 * c.hidden_size * c.intermediate_size * 4, c.num_hidden_layers


def budget_kwargs(ref, budget: dict) -> dict:
    eb, L = expert_bytes_fp32(ref)
    if "expert_memory" in budget:  # slots per layer -> bytes, written with a unit
        return {**budget, "expert_memory": f"{budget['expert_memory'] * L * eb}B"}
    if "pool_slots" in budget:  # slots in all -> bytes
        kw = dict(budget)
        kw["expert_memory"] = f"{kw.pop('pool_slots') * eb}B"
        return kw
    return dict(budget)


def pool_slots(ref, budget: dict, slots: int | None) -> int:
    """The slots the budget buys in all (per layer x MoE layers, or given in all)."""
    return budget["pool_slots"] if slots is None else slots * expert_bytes_fp32(ref)[1]


@pytest.fixture
def emulated_link(monkeypatch):
    """Engines built in this test get an EmulatedLink of the given speed instead of the calibrated one."""
    made = []

    def use(bandwidth=100e6, latency=2e-4):
        def make_link(device, profile=None, **kw):
            link = EmulatedLink(bandwidth, latency, name="test")
            made.append(link)
            return link

        monkeypatch.setattr(builder, "make_link", make_link)
        return made

    yield use
    for link in made:
        link.close()


@pytest.fixture(scope="module")
def resident_tokens(tiny):
    done = {}

    def get(arch, kw):
        key = (arch, tuple(sorted(kw)))
        if key not in done:
            path, _ = tiny(arch, **kw)
            engine = specter.load(path, device="cpu", policy="resident")
            try:
                done[key] = [engine.generate(p, max_new_tokens=NEW).token_ids for p in PROMPTS]
            finally:
                engine.close()
            # the reference is not degenerate: comparing against it can fail
            assert sum(len(t) for t in done[key]) >= 2 * NEW and len({t for ts in done[key] for t in ts}) > 5
        return done[key]

    return get


# ------------------------------------------------------------------------------------------ losslessness
@pytest.mark.parametrize("policy", LOSSLESS_POLICIES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_offloaded_greedy_equals_resident(tiny, resident_tokens, emulated_link, case, policy):
    arch, kw = case
    path, ref = tiny(arch, **kw)
    want = resident_tokens(arch, kw)
    emulated_link()
    for budget, slots in BUDGETS:
        engine = specter.load(path, device="cpu", policy=policy, **budget_kwargs(ref, budget))
        try:
            assert engine.dtype == torch.float32 and engine.plan.pool_slots == pool_slots(ref, budget, slots), budget
            assert engine.plan.pool == budget.get("slot_pool", "shared")
            assert engine.decoder.experts.slots.policy == budget.get("eviction", "lru")
            outs = [engine.generate(p, max_new_tokens=NEW) for p in PROMPTS]
        finally:
            engine.close()
        for p, out, w in zip(PROMPTS, outs, want):
            assert out.token_ids == w, f"{arch} {policy} {budget}, prompt {p}: {out.token_ids} != resident {w}"
        misses = sum(o.stats["expert_misses"] for o in outs)
        if slots != 8 and policy == "host":  # computed on the host lane, never copied
            assert misses > 0 and sum(o.stats["host_experts"] for o in outs) == misses, budget
            assert sum(o.stats["h2d_bytes"] for o in outs) == 0, budget
        elif slots != 8:  # the offload path really ran: experts were missing and copied
            assert misses > 0 and sum(o.stats["h2d_bytes"] for o in outs) > 0, budget
            if policy == "next-layer" and slots is not None:  # (a pool of top-k slots has no room for a guess)
                assert sum(o.stats["prefetch_issued"] for o in outs) > 0
        else:  # everything resident after warm-up: no miss, no copy
            assert misses == 0 and sum(o.stats["h2d_bytes"] for o in outs) == 0


DEFAULT_PROMPTS = ["def fibonacci(n):", "import os\n\ndef read_lines(path):"]


@pytest.fixture(scope="module")
def default_resident():
    """The bundled model's resident greedy tokens for DEFAULT_PROMPTS (the reference of the tests below)."""
    engine = specter.load(None, device="cpu", policy="resident")
    try:
        want = [engine.generate(p, max_new_tokens=NEW, temperature=0.0).token_ids for p in DEFAULT_PROMPTS]
    finally:
        engine.close()
    return want


@pytest.mark.skipif(not (specter.default_model_path() / "model.safetensors").exists(),
                    reason="the bundled default model is not built")
def test_default_model_offloaded_greedy_equals_resident(emulated_link, default_resident):
    prompts, want = DEFAULT_PROMPTS, default_resident
    assert all(len(w) > 0 for w in want)
    emulated_link()
    for policy in LOSSLESS_POLICIES:
        for residency in (0.25, 0.5):
            engine = specter.load(None, device="cpu", policy=policy, residency=residency)
            try:
                outs = [engine.generate(p, max_new_tokens=NEW, temperature=0.0) for p in prompts]
            finally:
                engine.close()
            for p, out, w in zip(prompts, outs, want):
                assert out.token_ids == w, f"{policy} residency={residency}, prompt {p!r}"
                assert out.text == engine.decode(w)
            assert sum(o.stats["expert_misses"] for o in outs) > 0


@pytest.mark.skipif(not (specter.default_model_path() / "model.safetensors").exists(),
                    reason="the bundled default model is not built")
def test_default_model_below_the_per_layer_floor_equals_resident(emulated_link, default_resident):
    """2 MiB of expert memory is 3 fp32 experts of 576 KiB for 4 layers of top-2: below the per-layer
    rule's floor (4.5 MiB, 2 a layer), a plan only the shared pool has. on-demand and specter decode
    the resident tokens through it."""
    prompts, want = DEFAULT_PROMPTS, default_resident
    with pytest.raises(specter.BudgetError, match="4.50 MiB"):
        specter.load(None, device="cpu", policy="on-demand", expert_memory="2MiB", slot_pool="layer")
    emulated_link()
    for policy in ("on-demand", "specter"):
        engine = specter.load(None, device="cpu", policy=policy, expert_memory="2MiB")
        try:
            assert engine.plan.pool_slots == 3 and engine.plan.pool == "shared"
            outs = [engine.generate(p, max_new_tokens=NEW, temperature=0.0) for p in prompts]
        finally:
            engine.close()
        for p, out, w in zip(prompts, outs, want):
            assert out.token_ids == w, f"{policy} at 2 MiB, prompt {p!r}"
        assert sum(o.stats["expert_misses"] for o in outs) > 0


# ------------------------------------------------------------------------------------- invariant watcher
class Watch:
    """An expert provider wrapping `mgr` that checks the cache's invariants on every layer call and at
    every grouped expert computation (install `checked_expert_rows` in the manager module for that)."""

    def __init__(self, mgr: OffloadedExperts):
        self.mgr = mgr
        self.layer = None
        self.calls = self.computed = 0
        self.transfers = {}  # (layer, expert) -> the latest Transfer the manager started for it
        copy = mgr.link.copy

        def recording_copy(dst, src, *, urgent=False, tag=None):
            t = copy(dst, src, urgent=urgent, tag=tag)
            layer, which = tag
            for e in which if isinstance(which, tuple) else (which,):  # a coalesced copy: (layer, experts)
                self.transfers[(layer, e)] = t
            return t

        mgr.link.copy = recording_copy

    def __getattr__(self, name):  # stats(), reset_stats(), close(), ...
        return getattr(self.mgr, name)

    def __call__(self, layer, x, ids, weights, guess=None):
        self.layer, self.done = layer, set()
        try:
            out = self.mgr(layer, x, ids, weights, guess)
        finally:
            self.layer = None
        self.after_call()
        self.calls += 1
        return out

    def after_call(self) -> None:
        mgr, slots = self.mgr, self.mgr.slots
        slots.check()  # residents <= slots, remap == bookkeeping, free list, owners, pins
        for l in range(len(mgr.store)):
            residents = slots.residents(l)
            assert len(residents) <= slots.n_slots
            loading = {(l, e) for e in residents if not slots.is_ready(l, e)}
            assert loading == {key for key in mgr.inflight if key[0] == l}, "in-flight copies != loading slots"
            for e in slots.ready_experts(l):  # a ready expert's row (its slot, or aliased its store row) holds it
                r = slots.row(l, e)
                assert r == (e if mgr.alias else slots.slot_of(l, e)), (l, e, r)
                assert torch.equal(mgr.rows[l].w13[r], mgr.store[l].w13[e]), (l, e, r)
                assert torch.equal(mgr.rows[l].w2[r], mgr.store[l].w2[e]), (l, e, r)

    def checked_expert_rows(self, real):
        def run(x, ids, weights, w13, w2, *, remap=None, backend=None):
            mgr, layer = self.mgr, self.layer
            assert layer is not None, "expert_rows called outside a watched layer call"
            store, pool, slots = mgr.store[layer], mgr.rows[layer], mgr.slots  # rows: the pool, or aliased the store
            assert w13.data_ptr() == pool.w13.data_ptr() and w2.data_ptr() == pool.w2.data_ptr(), \
                "not computed from the slot pool (or, aliased, the store)"
            assert remap is not None, "a call over the slot pool without its remap row"
            used = [(e, int(remap[e])) for e in sorted(set(ids.reshape(-1).tolist())) if int(remap[e]) >= 0]

            def intact(e, s, when):
                assert slots.slot_of(layer, e) is not None and slots.row(layer, e) == s, \
                    f"expert {e} lost row {s} {when}"
                assert torch.equal(pool.w13[s], store.w13[e]) and torch.equal(pool.w2[s], store.w2[e]), \
                    f"slot {s} does not hold expert {e}'s weights {when}"

            for e, s in used:
                t = self.transfers.get((layer, e))
                assert t is None or t.done(), f"expert {e} computed before its copy completed"
                assert slots.is_ready(layer, e) and (layer, e) not in mgr.inflight
                assert int(slots.remap[layer, e]) == s
                assert e not in self.done, f"expert {e} computed twice in one layer call"
                intact(e, s, "at compute time")
            out = real(x, ids, weights, w13, w2, remap=remap, backend=backend)
            for e, s in used:
                intact(e, s, "after its computation")
            self.done.update(e for e, _ in used)
            self.computed += len(used)
            return out

        return run


@pytest.fixture
def watch(monkeypatch):
    """watch(mgr) -> Watch, with the manager's expert_rows checked (one watched manager per test)."""
    def install(mgr):
        w = Watch(mgr)
        monkeypatch.setattr(mgr, "expert_rows", w.checked_expert_rows(mgr.expert_rows))
        return w

    return install


def make_store(L=2, E=8, H=32, I=16, seed=0) -> list[ExpertWeights]:
    g = torch.Generator().manual_seed(seed)
    return [ExpertWeights(torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)) for _ in range(L)]


def routed(T, k, E, gen, H=32):
    """x [T, H], ids [T, k] (distinct per token), weights [T, k]."""
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, k, generator=gen), dim=-1)
    return x, ids, w


def slow_link(bandwidth=2e6, latency=1e-3):
    return EmulatedLink(bandwidth=bandwidth, latency=latency, name="slow")  # 6 KiB expert: ~4 ms a copy


# ------------------------------------------------------------------------------------ manager, directly
# every manager test runs with a real pool and with an aliased one (the CPU pool of a big model: compute
# reads the store's rows, copies are only timed), whose residency the same checks must hold to
ALIAS = pytest.mark.parametrize("alias", [False, True], ids=["copy", "alias"])
# ... and on both rules of the pool: n slots in every layer, or n slots in all (shared by every layer)
POOL = pytest.mark.parametrize("pool", ["layer", "shared"])


def make_mgr(store, n: int, link, pool: str, **kw) -> OffloadedExperts:
    if pool == "layer":
        return OffloadedExperts(store, n, torch.device("cpu"), link, **kw)
    mgr = OffloadedExperts(store, None, torch.device("cpu"), link, pool=n, **kw)
    assert mgr.slots.pool_slots == n and all(p is mgr.pool[0] for p in mgr.pool)
    return mgr


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
@ALIAS
@POOL
def test_more_distinct_experts_than_slots_in_one_call(watch, eviction, alias, pool):
    """8 tokens x top-2 touch all 8 experts of a layer through 2 slots: every expert is computed from
    its own landed copy, none is evicted while in use, and the output is resident's, bit for bit."""
    store = make_store()
    resident = ResidentExperts(store)
    with slow_link() as link:
        mgr = make_mgr(store, 2, link, pool, eviction=eviction, alias=alias)
        w = watch(mgr)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(8, 32, generator=gen)
        ids = torch.tensor([[t, (t + 3) % 8] for t in range(8)])
        weights = torch.softmax(torch.randn(8, 2, generator=gen), dim=-1)
        for start in ("cold", "warm"):
            if start == "warm":
                mgr.warm()
            for layer in (0, 1, 0):
                assert torch.equal(w(layer, x, ids, weights), resident(layer, x, ids, weights)), (start, layer)
        assert w.computed == 6 * 8 and w.calls == 6
        assert mgr.stats()["expert_misses"] >= 6 * 6 and mgr.slots.stats["evictions"] > 0


@ALIAS
@POOL
def test_random_calls_with_prefetches_in_flight(watch, alias, pool):
    """Layer calls interleaved with prefetches that are still copying when the layer runs."""
    store = make_store(L=3)
    resident = ResidentExperts(store)
    rng, gen = random.Random(0), torch.Generator().manual_seed(2)
    with slow_link() as link:
        mgr = make_mgr(store, 3, link, pool, alias=alias)
        w = watch(mgr)
        for step in range(14):
            layer = rng.randrange(3)
            if step % 2:
                want = rng.sample(range(8), rng.randint(1, 4))
                mgr.prefetch(rng.randrange(3), want, protect=set(want))
                mgr.prefetch(layer, rng.sample(range(8), 2))
            x, ids, weights = routed(rng.choice([1, 2, 5]), 2, 8, gen)
            assert torch.equal(w(layer, x, ids, weights), resident(layer, x, ids, weights)), step
        st = mgr.stats()
        assert st["prefetch_issued"] > 0 and st["expert_misses"] > 0 and w.computed > 14
    mgr.slots.check()


@ALIAS
@POOL
def test_every_slot_loading_when_the_layer_runs(watch, alias, pool):
    """Both slots hold unrelated prefetches still in flight; the layer needs two other experts."""
    store = make_store()
    resident = ResidentExperts(store)
    with slow_link(latency=0.02) as link:
        mgr = make_mgr(store, 2, link, pool, alias=alias)
        w = watch(mgr)
        assert mgr.prefetch(0, [6, 7]) == 2
        assert not mgr.slots.is_ready(0, 6) and not mgr.slots.is_ready(0, 7)
        x, ids, weights = routed(1, 2, 8, torch.Generator().manual_seed(3))
        ids = torch.tensor([[0, 1]])
        assert torch.equal(w(0, x, ids, weights), resident(0, x, ids, weights))
        assert mgr.slots.residents(0) == [0, 1] and mgr.stats()["prefetch_used"] == 0
        # a prefetched expert still in flight when it is needed is waited for, not computed early
        assert mgr.prefetch(0, [5]) == 1 and (0, 5) in mgr.inflight
        ids = torch.tensor([[5, 1]])
        assert torch.equal(w(0, x, ids, weights), resident(0, x, ids, weights))
        assert mgr.stats()["prefetch_used"] == 1


@ALIAS
@POOL
def test_experts_only_rejected_drafts_needed_are_evicted_first(alias, pool):
    """After a verification whose rows from 2 on ran on rejected drafted tokens, demote_rejected(2) puts
    the experts only those rows needed first in line: the next miss evicts them, not an expert the
    committed rows used (even one used longer ago)."""
    store = make_store(L=1)
    with slow_link(bandwidth=1e9, latency=0.0) as link:
        mgr = make_mgr(store, 4, link, pool, alias=alias)
        x = torch.randn(3, 32)
        w = torch.full((3, 2), 0.5)
        mgr(0, x[:1], torch.tensor([[0, 1]]), w[:1])                     # 0, 1 resident
        mgr(0, x, torch.tensor([[2, 3], [2, 3], [4, 5]]), w)             # rows 0-1 commit 2, 3; row 2 rejected
        assert sorted(mgr.slots.residents(0)) == [2, 3, 4, 5]
        mgr.demote_rejected(2)
        mgr(0, x[:1], torch.tensor([[6, 7]]), w[:1])
        assert sorted(mgr.slots.residents(0)) == [2, 3, 6, 7]            # 4, 5 went, not 2, 3
        mgr.demote_rejected(3)                                           # nothing recorded since: no-op
        mgr.slots.check()


class _GateClock:
    """An emulated link's clock (EmulatedLink(clock=...)) whose worker sleeps out a copy's time only
    once the test opens the gate: what is in flight stays in flight whatever the machine's load."""

    def __init__(self):
        self.t, self.gate = 0.0, threading.Event()

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float, wake: threading.Event) -> bool:
        while not self.gate.is_set() and not wake.wait(0.005):
            pass
        self.t += seconds
        return wake.is_set()


def test_link_cancel_withdraws_only_copies_not_started():
    """A queued copy is withdrawn (never written, resolves cancelled, pending() drops); the one the
    worker has started, and a landed one, cannot be."""
    src = [torch.full((1024,), float(i)) for i in range(3)]
    dst = [torch.zeros(1024) for _ in range(3)]
    clock = _GateClock()
    with EmulatedLink(bandwidth=1e6, latency=0.05, name="slow", clock=clock) as link:
        ts = [link.copy(d, s) for d, s in zip(dst, src)]
        while ts[0].t_started is None:  # the worker has it: copied, it sleeps on the gate
            pass
        assert link.pending() == 3
        assert link.cancel(ts[2]) and ts[2].cancelled() and ts[2].done() and link.pending() == 2
        assert not link.cancel(ts[0]) and not link.cancel(ts[2])  # started; already withdrawn
        clock.gate.set()
        link.synchronize()
        assert not link.cancel(ts[1])  # landed
        assert torch.equal(dst[0], src[0]) and torch.equal(dst[1], src[1])
        assert not dst[2].any(), "a cancelled copy wrote its destination"
        assert link.stats["transfers"] == 2 and not ts[0].cancelled()
        assert "cancelled" in repr(ts[2])


@ALIAS
def test_warm_fills_the_pool_without_the_emulated_links_time(alias):
    """A load's warm-up is no copy the emulation is about: on an emulated link it lands at once, uncounted
    (it used to sleep ~10 s a GB of pool, aliased pools too), and the link's first real copy is charged."""
    from test_link import VirtualClock

    store, clock = make_store(), VirtualClock()
    with EmulatedLink(bandwidth=1e3, latency=1e-3, clock=clock) as link:  # 6 KiB expert: 6 s a copy
        mgr = OffloadedExperts(store, 3, torch.device("cpu"), link, alias=alias)
        mgr.warm()
        assert clock.now() == 0.0 and link.stats == {"transfers": 0, "bytes": 0, "busy_s": 0.0}
        assert all(mgr.slots.is_ready(layer, e) for layer in range(2) for e in range(3))
        x, w = torch.randn(1, 32, generator=torch.Generator().manual_seed(0)), torch.tensor([[0.25, 0.75]])
        for layer in range(2):  # the bytes are in the slots all the same: a call on them hits and is exact
            ids = torch.tensor([[0, 2]])
            torch.testing.assert_close(mgr(layer, x, ids, w), ResidentExperts(store)(layer, x, ids, w), rtol=0, atol=0)
        assert mgr.stats()["expert_misses"] == 0 and clock.now() == 0.0
        assert link.copy_seconds(mgr.expert_bytes) == pytest.approx(mgr.expert_bytes / 1e3 + 1e-3)
        assert mgr.prefetch(0, [5]) == 1
        link.synchronize()
        assert clock.now() == pytest.approx(mgr.expert_bytes / 1e3 + 1e-3) and link.stats["transfers"] == 1


@ALIAS
def test_cancel_prefetches_undoes_reservations_and_never_lands(watch, alias):
    """Prefetches still queued when a cycle ends are withdrawn: out of flight, their reservations
    undone (the experts they evicted ready again, bytes intact), their bytes not counted; the one
    the link has started lands as usual. The next call hits the restored expert."""
    store = make_store()
    resident = ResidentExperts(store)
    with slow_link(latency=0.05) as link:
        mgr = OffloadedExperts(store, 2, torch.device("cpu"), link, alias=alias)
        mgr.prefetch_batch = 1                       # a copy each (coalesced: test_a_coalesced_prefetch_...)
        w = watch(mgr)
        mgr.warm()                                   # layer 0: experts 0, 1
        mgr.slots.touch(0, [1])                      # 0 is evicted first
        assert mgr.prefetch(0, [6, 7]) == 2          # 6 evicts 0, 7 evicts 1
        while w.transfers[(0, 6)].t_started is None:
            pass
        bytes_before = mgr.stats()["h2d_bytes"]
        assert mgr.cancel_prefetches() == 1          # 7 was queued behind 6
        assert w.transfers[(0, 7)].cancelled() and set(mgr.inflight) == {(0, 6)}
        assert mgr.slots.is_ready(0, 1) and mgr.slots.slot_of(0, 7) is None
        st = mgr.stats()
        assert st["prefetch_cancelled"] == 1 and st["h2d_bytes"] == bytes_before - mgr.expert_bytes
        w.after_call()                               # slots hold their experts' bytes; loading == in flight
        link.synchronize()
        mgr.poll()
        w.after_call()                               # 7's copy never wrote 1's slot
        assert mgr.slots.ready_experts(0) == [1, 6]
        x, ids, weights = routed(1, 2, 8, torch.Generator().manual_seed(4))
        ids = torch.tensor([[1, 6]])
        assert torch.equal(w(0, x, ids, weights), resident(0, x, ids, weights))
        assert mgr.stats()["expert_misses"] == 0


@ALIAS
def test_a_coalesced_prefetch_crosses_once_and_is_withdrawn_expert_by_expert(watch, alias):
    """Where an expert's bytes are a small part of a copy's fixed cost, a layer's prefetches cross in one
    transfer (`prefetch_batch` of them a latency). Withdrawing one cancels that transfer as a whole, every
    reservation undone (the experts they evicted ready again), and issues the others again, still
    prefetches; cancel_prefetches withdraws the rest. A started copy lands; reads stay exact."""
    store = make_store()
    resident = ResidentExperts(store)
    with slow_link(latency=0.05) as link:  # 6 KiB experts: 3 ms of bytes behind a 50 ms fixed cost
        mgr = OffloadedExperts(store, 3, torch.device("cpu"), link, alias=alias)
        assert mgr.prefetch_batch == int(0.05 * 2e6 // mgr.expert_bytes) == 16
        w = watch(mgr)
        mgr.warm()                                   # every layer: 0, 1, 2
        mgr.reset_stats()
        assert mgr.prefetch(1, [6]) == 1             # starts at once: the link is busy for 53 ms
        while mgr.inflight[(1, 6)].t_started is None:
            pass
        assert mgr.prefetch(0, [5, 6, 7]) == 3       # one transfer, queued behind it
        first = mgr.inflight[(0, 5)]
        assert first is mgr.inflight[(0, 6)] is mgr.inflight[(0, 7)] and first.tag == (0, (5, 6, 7))
        assert mgr.withdraw(0, [6]) == 1
        again = mgr.inflight[(0, 5)]
        assert first.cancelled() and again is mgr.inflight[(0, 7)] and again.tag == (0, (5, 7))
        assert (0, 6) not in mgr.inflight and mgr.slots.slot_of(0, 6) is None
        assert {(0, 5), (0, 7)} <= mgr.prefetched and len(set(mgr.slots.ready_experts(0)) & {0, 1, 2}) == 1
        mgr.slots.check()
        assert mgr.cancel_prefetches() == 2          # 5 and 7; layer 1's copy has started
        assert set(mgr.inflight) == {(1, 6)} and mgr.slots.ready_experts(0) == [0, 1, 2]
        st = mgr.stats()
        assert st["prefetch_cancelled"] == 3 and st["h2d_bytes"] == mgr.expert_bytes
        link.synchronize()
        mgr.poll()
        w.after_call()
        x, ids, weights = routed(1, 2, 8, torch.Generator().manual_seed(4))
        ids = torch.tensor([[1, 2]])
        assert torch.equal(w(0, x, ids, weights), resident(0, x, ids, weights))
        assert mgr.stats()["expert_misses"] == 0
        mgr.slots.check()


def test_reset_and_warm():
    store = make_store()
    with slow_link(bandwidth=50e6, latency=0) as link:
        mgr = OffloadedExperts(store, 3, torch.device("cpu"), link)
        mgr.warm()
        for l in range(2):
            assert mgr.slots.ready_experts(l) == [0, 1, 2]
            for e in range(3):
                s = mgr.slots.slot_of(l, e)
                assert torch.equal(mgr.pool[l].w13[s], store[l].w13[e]) and int(mgr.slots.remap[l, e]) == s
        assert not mgr.inflight
        mgr.prefetch(1, [5, 6])
        mgr.reset()
        mgr.slots.check()
        assert not mgr.inflight and all(mgr.slots.residents(l) == [] for l in range(2))
        assert (mgr.slots.remap == -1).all()
        x, ids, weights = routed(3, 2, 8, torch.Generator().manual_seed(4))
        assert torch.equal(mgr(1, x, ids, weights), ResidentExperts(store)(1, x, ids, weights))
        mgr.slots.check()


def _once(monkeypatch, owner, name, n, exc, after=False):
    """owner.name raises `exc` at its n-th call (after running, with after=True), then runs as before."""
    real, calls = getattr(owner, name), []

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == n and not after:
            raise exc
        out = real(*a, **kw)
        if len(calls) == n:
            raise exc
        return out

    monkeypatch.setattr(owner, name, flaky)
    return calls


# where a layer call is cut short: a copy that fails to issue (CUDA: out of memory for its staging), coalesced
# or not; a Ctrl-C as a landed copy is marked ready; a Ctrl-C right after a slot is reserved
CUTS = {"copy": ("link", "copy", RuntimeError("CUDA out of memory (a stand-in)"), False, False),
        "copy-coalesced": ("link", "copy", RuntimeError("CUDA out of memory (a stand-in)"), False, True),
        "mark_ready": ("slots", "mark_ready", KeyboardInterrupt(), False, False),
        "reserve": ("slots", "reserve", KeyboardInterrupt(), True, False)}


@pytest.mark.parametrize("cut", list(CUTS))
@POOL
def test_a_call_cut_short_leaves_no_slot_loading_with_no_copy(monkeypatch, pool, cut):
    """A copy that raised as it was issued, or a call interrupted as it landed or reserved one, left the
    expert loading with no copy coming: every later call read its rows as zeros through the remap row,
    and its slot was never evicted. The call fails; the next ones compute resident's output."""
    owner, name, exc, after, coalesce = CUTS[cut]
    store = make_store()
    with slow_link(bandwidth=1e12, latency=0) as link:
        mgr = make_mgr(store, 3, link, pool)
        mgr.warm()
        monkeypatch.setattr(mgr, "coalesce", coalesce)
        x, ids, weights = routed(4, 2, 8, torch.Generator().manual_seed(7))
        calls = _once(monkeypatch, link if owner == "link" else mgr.slots, name, 2, exc, after=after)
        with pytest.raises(type(exc)):
            mgr(1, x, ids, weights)
        monkeypatch.undo()
        assert len(calls) == 2
        mgr.slots.check()
        stuck = [e for e in range(8) if mgr.slots.slot_of(1, e) is not None and not mgr.slots.is_ready(1, e)
                 and (1, e) not in mgr.inflight]
        assert not stuck, stuck
        for l in range(2):
            assert torch.equal(mgr(l, x, ids, weights), ResidentExperts(store)(l, x, ids, weights))
        mgr.slots.check()


def test_prefetch_used_counts_only_prefetches_that_served():
    store = make_store()
    with slow_link(bandwidth=1e9, latency=0) as link:
        mgr = OffloadedExperts(store, 2, torch.device("cpu"), link)
        assert mgr.prefetch(0, [5]) == 1
        link.synchronize()
        mgr.poll()
        x, _, weights = routed(1, 2, 8, torch.Generator().manual_seed(6))
        mgr(0, x, torch.tensor([[0, 1]]), weights)  # two slots, both needed: the prefetched 5 is evicted unused
        assert not mgr.is_resident(0, 5)
        mgr.reset_stats()
        mgr(0, x, torch.tensor([[5, 0]]), weights)  # 5 is a plain miss now
        st = mgr.stats()
        assert st["expert_misses"] == 1 and st["prefetch_issued"] == 0
        assert st["prefetch_used"] == 0, "an evicted, never-used prefetch was counted as used"


class EagerLanding(OffloadedExperts):
    """A broken manager: marks a copy ready without waiting for it to complete."""

    def _land(self, layer, e):  # never waits for the copy
        if self.inflight.pop((layer, e), None) is not None:
            self.slots.mark_ready(layer, e)


@ALIAS
def test_the_watch_catches_compute_before_the_copy_lands(watch, alias):
    """The compute-time check has teeth: a manager that does not wait for its copies is caught."""
    store = make_store()
    with EmulatedLink(bandwidth=1e9, latency=0.5, name="slow") as link:  # copies land 0.5 s apart
        mgr = EagerLanding(store, 8, torch.device("cpu"), link, alias=alias)
        w = watch(mgr)
        x, ids, weights = routed(4, 2, 8, torch.Generator().manual_seed(5))
        ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
        with pytest.raises(AssertionError, match="before its copy completed"):
            w(0, x, ids, weights)


def test_an_aliased_pool_holds_no_bytes_and_reads_only_landed_experts():
    """Aliased, the pool is shapes without storage; a copy is timed by the bytes a real pool would
    receive and moves none; and an expert is read from its store row only once its copy has landed:
    until then its remap entry is -1 and it computes nothing, although the store holds its bytes."""
    store = make_store()
    x, _, weights = routed(1, 2, 8, torch.Generator().manual_seed(7))
    ids = torch.tensor([[3, 5]])
    with EmulatedLink(bandwidth=1e12, latency=60.0, name="stuck") as link:  # lands when the link closes
        mgr = OffloadedExperts(store, 2, torch.device("cpu"), link, alias=True)
        mgr.prefetch_batch = 1  # a copy each
        assert all(ew.w13.is_meta and ew.w2.is_meta for ew in mgr.pool) and mgr.rows is store
        assert mgr.prefetch(0, [3, 5]) == 2
        t = mgr.inflight[(0, 3)]
        assert t.dst_nbytes == t.nbytes == mgr.expert_bytes and not t.done()
        rows = manager_mod.expert_rows(x, ids, weights, store[0].w13, store[0].w2, remap=mgr.slots.remap[0])
        assert not mgr.slots.is_ready(0, 3) and int(mgr.slots.remap[0, 3]) == -1 and not rows.any()
        link.close()  # queued copies land at once
        mgr.poll()
        assert mgr.slots.ready_experts(0) == [3, 5] and mgr.slots.remap[0, [3, 5]].tolist() == [3, 5]
        assert mgr.slots.slot_of(0, 3) in (0, 1) and link.stats["bytes"] == 2 * mgr.expert_bytes
        assert torch.equal(mgr(0, x, ids, weights), ResidentExperts(store)(0, x, ids, weights))
        assert mgr.stats()["expert_hits"] == 2
    with pytest.raises(ValueError, match="CPU only"):
        OffloadedExperts(store, 2, torch.device("cuda"), link, alias=True)


# ---------------------------------------------------------------------------------- through the engine
@pytest.mark.parametrize("policy", ["on-demand", "next-layer", "spec-lru", "specter"])
def test_aliased_pool_decodes_like_the_copying_pool(tiny, emulated_link, monkeypatch, policy):
    """A big model's CPU pool aliases the store (offload/plan.py's alias_pool); forced on a tiny one, every
    policy gives the copying pool's tokens and the very same logits, at every forward."""
    path, _ = tiny("qwen2_moe", mlp_only_layers=[0])
    emulated_link(bandwidth=20e6, latency=1e-3)  # copies in flight across layers
    runs = []
    for alias in (False, True):
        monkeypatch.setattr(plan, "alias_pool", lambda *a, alias=alias, **k: alias)
        engine = specter.load(path, device="cpu", policy=policy, residency=0.25, draft_cache="off")
        mgr = getattr(engine.decoder, "experts", None) or engine.decoder.experts
        assert mgr.alias is alias and mgr.pool[0].w13.is_meta is alias
        if hasattr(engine.decoder, "governor"):  # the same drafted widths both times, whatever the timing
            from specter.speculative.governor import Governor
            engine.decoder.governor = Governor(6, fixed=4)
        logits, real = [], engine.model.head
        engine.model.head = lambda *a, **k: logits.append(real(*a, **k)) or logits[-1]
        try:
            outs = [engine.generate(p, max_new_tokens=12) for p in PROMPTS[:2]]
        finally:
            engine.close()
        assert sum(o.stats["expert_misses"] for o in outs) > 0
        runs.append(([o.token_ids for o in outs], logits))
    (tokens, a), (tokens_alias, b) = runs
    assert tokens == tokens_alias and len(a) == len(b) >= 24
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_residency_computes_on_the_residents_tensors(tiny, dtype):
    """A CPU budget that holds every expert aliases: after warm-up nothing is copied, and compute reads
    the tensors the resident policy reads (a pool copy of them runs up to 9% apart from resident, by
    where its pages fall) -- the store's own when it has the compute dtype, else the one fp32 copy
    that resident builds (Loaded.resident_experts), made once for every engine on the load."""
    path, _ = tiny("qwen3_moe") if dtype == torch.float32 else tiny("qwen3_moe", dtype=dtype)
    resident = specter.load(path, device="cpu", policy="resident", draft_cache="off")
    want = [resident.generate(p, max_new_tokens=NEW).token_ids for p in PROMPTS]
    copy = resident.shared.resident_experts()
    assert (copy[0].w13 is resident.shared.store[0].w13) is (dtype == torch.float32)
    for policy in ("on-demand", "specter"):
        engine = specter.load(path, device="cpu", policy=policy, residency=1.0, shared=resident.shared)
        try:
            mgr = engine.decoder.experts
            assert mgr.all_resident and mgr.alias and mgr.pool[0].w13.is_meta
            assert all(r.w13 is c.w13 and r.w2 is c.w2 for r, c in zip(mgr.rows, copy))
            outs = [engine.generate(p, max_new_tokens=NEW) for p in PROMPTS]
            assert [o.token_ids for o in outs] == want
            assert sum(o.stats["h2d_bytes"] for o in outs) == 0
        finally:
            engine.close()
    resident.close()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CASES[:2], ids=IDS[:2])
@pytest.mark.parametrize("budget", [{"residency": 0.25}, {"pool_slots": 3}], ids=["quarter", "3slots"])
@ALIAS
def test_engine_invariants_on_a_slow_link(tiny, resident_tokens, emulated_link, watch, monkeypatch, case, policy, alias,
                                          budget):
    arch, kw = case
    path, ref = tiny(arch, **kw)
    monkeypatch.setattr(plan, "alias_pool", lambda *a, **k: alias)
    emulated_link(bandwidth=20e6, latency=1e-3)  # 24 KiB experts: ~2 ms a copy, in flight across layers
    engine = specter.load(path, device="cpu", policy=policy, **budget_kwargs(ref, budget))
    try:
        mgr = engine.decoder.experts
        want_slots = pool_slots(ref, budget, 2 if "residency" in budget else None)
        assert isinstance(mgr, OffloadedExperts) and mgr.slots.pool_slots == want_slots and mgr.alias is alias
        w = watch(mgr)
        engine.decoder.experts = w
        outs = [engine.generate(p, max_new_tokens=12) for p in PROMPTS[:2]]
    finally:
        engine.close()
    want = resident_tokens(arch, kw)
    for out, full in zip(outs, want):
        assert out.token_ids == full[:12]
    L = expert_bytes_fp32(ref)[1]
    assert w.calls > 0 and w.calls % L == 0 and w.computed >= w.calls
    assert sum(o.stats["expert_misses"] for o in outs) > 0
    if policy == "next-layer" and "residency" in budget:  # (3 slots: no room for a guess beside a layer's own)
        assert sum(o.stats["prefetch_issued"] for o in outs) > 0


def test_engine_close_closes_the_link(tiny):
    path, _ = tiny("mixtral")
    engine = specter.load(path, device="cpu", policy="on-demand", residency=0.5)
    link = engine.decoder.experts.link
    try:
        engine.close()
        with pytest.raises(RuntimeError, match="closed"):  # a closed link refuses new copies
            link.copy(torch.zeros(4), torch.ones(4))
    finally:
        link.close()


class OrderLink(EmulatedLink):
    """An emulated link that plays the CUDA ordering contract: `read_event()` is the number of
    expert computes queued so far, and every copy checks that its `after` covers the last compute
    that read its destination slot (what a per-slot event must guarantee on a GPU)."""

    def __init__(self, mgr_ref):
        super().__init__(bandwidth=2e6, latency=1e-3, name="order")
        self.mgr_ref, self.queued, self.last_reader, self.checked = mgr_ref, 0, {}, 0

    def read_event(self):
        return self.queued

    def copy(self, dst, src, *, urgent=False, tag=None, after="all"):
        mgr = self.mgr_ref()
        if mgr is not None and tag is not None:
            layer = tag[0]
            afters = after if isinstance(after, list) else [after]  # a coalesced copy: one per slot (w13, w2 pairs)
            assert len(afters) == len(dst) // 2
            for d, aft in zip(dst[::2], afters):
                slot = (d.data_ptr() - mgr.pool[layer].w13.data_ptr()) // d[0].nbytes // d.shape[0]
                need = self.last_reader.get(slot)  # whichever layer's compute read the pool slot last
                if need is not None:
                    assert aft != "all", "the manager must name the slot's last reader, not wait for all compute"
                    assert aft is not None and aft >= need, \
                        f"copy for layer {layer} into slot {slot} ordered after {aft}, but compute {need} reads it"
                    self.checked += 1
        return super().copy(dst, src, urgent=urgent, tag=tag, after=after)


@POOL
def test_copies_wait_for_the_last_reader_of_their_slot(monkeypatch, pool):
    """Per-slot ordering (CUDA's contract, checked on CPU): a copy into a slot is ordered after the
    compute that last read it -- including an expert computed earlier in the same layer call whose
    slot a later miss takes, and in a shared pool another layer's -- instead of after all queued compute."""
    store = make_store(L=2)
    resident = ResidentExperts(store)
    holder = {}
    link = OrderLink(lambda: holder.get("mgr"))
    real = manager_mod.expert_rows

    def run(x, ids, weights, w13, w2, *, remap=None, backend=None):
        link.queued += 1  # this grouped call's compute is queued now
        for e in set(ids.reshape(-1).tolist()):
            if int(remap[e]) >= 0:
                link.last_reader[int(remap[e])] = link.queued
        return real(x, ids, weights, w13, w2, remap=remap, backend=backend)

    monkeypatch.setattr(manager_mod, "expert_rows", run)
    with link:
        mgr = make_mgr(store, 2 if pool == "layer" else 3, link, pool)
        holder["mgr"] = mgr
        gen, rng = torch.Generator().manual_seed(3), random.Random(3)
        for step in range(10):
            layer = rng.randrange(2)
            if step % 3 == 1:
                mgr.prefetch(layer, rng.sample(range(8), 2))
            x, ids, weights = routed(rng.choice([1, 4]), 2, 8, gen)
            assert torch.equal(mgr(layer, x, ids, weights), resident(layer, x, ids, weights)), step
    assert link.checked > 5 and any(v is not None for v in mgr.last_read)


class GreedyGuess:
    """A next-layer router stand-in that, while layer l computes, prefetches every expert of another
    layer it can get: in a shared pool those copies look for victims in every layer."""

    def __init__(self, mgr, target):
        self.mgr, self.target, self.issued = mgr, target, 0

    def settle(self, layer, need):
        pass

    def __call__(self, layer, x):
        other = self.target(layer)
        self.issued += self.mgr.prefetch(other, range(8))


@ALIAS
def test_a_running_call_s_experts_are_held_against_other_layers_copies(watch, alias):
    """Shared pool of 6 slots, 2 layers: a layer's residents must survive the copies a guess issues for
    the other layer between the call's routing read and its grouped call (SlotCache.held); evicting
    one would drop its rows, or compute them from another expert's bytes."""
    store = make_store()
    resident = ResidentExperts(store)
    with slow_link(bandwidth=1e9, latency=0.0) as link:
        mgr = make_mgr(store, 6, link, "shared", alias=alias)
        w = watch(mgr)
        guess = GreedyGuess(mgr, lambda layer: 1 - layer)
        gen = torch.Generator().manual_seed(7)
        for step in range(8):
            layer = step % 2
            x, ids, weights = routed(2, 2, 8, gen)
            assert torch.equal(w(layer, x, ids, weights, guess), resident(layer, x, ids, weights)), step
        assert guess.issued > 0 and mgr.slots.stats["evictions"] > 0
