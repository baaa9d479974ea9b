"""`next-layer`'s rule (specter/speculative/draft.py), driven through the offload manager with the
routing and the next layer's guesses chosen by the test: no model, and no verdict that depends on
time (a copy that must be in flight is waited for until the link has started it).

1. Hot residents are never displaced: a full pool whose residents every call uses takes no guess
   once the calls have shown it, and never misses.
2. A guess queues behind its layer's own misses: the miss starts first even on an idle link.
3. A guess its layer does not need is withdrawn if its copy has not started (the resident it
   displaced is ready again in its untouched slot) and otherwise first in line for eviction.
4. A guess is issued only where it pays: p h > (1 - p) (s - h + s q).
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from specter.moe import ExpertWeights, ResidentExperts
from specter.offload.link import EmulatedLink
from specter.offload.manager import OffloadedExperts
from specter.speculative.draft import NextLayerPrefetch

E, H, I, K = 8, 32, 16, 2


class Guesses:
    """A stand-in for layer l+1's router: it picks the experts the test says."""

    def __init__(self):
        self.ids = [0, 1]

    def route(self, x):
        ids = torch.tensor([self.ids] * x.shape[0])
        return ids, torch.full(ids.shape, 1.0 / len(self.ids))


def setup(n_slots=2, L=2, link=None):
    g = torch.Generator().manual_seed(0)
    store = [ExpertWeights(torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)) for _ in range(L)]
    mgr = OffloadedExperts(store, n_slots, torch.device("cpu"), link or EmulatedLink(bandwidth=1e9, name="fast"))
    mgr.warm()  # residents 0 .. n_slots-1 in every layer, 0 least recently used
    mgr.reset_stats()
    routers = [Guesses() for _ in range(L)]
    model = SimpleNamespace(model=SimpleNamespace(layers=[SimpleNamespace(is_moe=True, mlp=r) for r in routers]))
    nl = NextLayerPrefetch(model, mgr)
    mgr.guess = nl  # the test's own note of it: each call passes it, as a plain decoder does
    return mgr, nl, routers, ResidentExperts(store)


def call(mgr, ref, layer, experts):
    """One token through `layer`, routed to `experts`; checks the output against resident weights."""
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(layer))
    ids, w = torch.tensor([experts]), torch.full((1, len(experts)), 1.0 / len(experts))
    assert torch.equal(mgr(layer, x, ids, w, guess=mgr.guess), ref(layer, x, ids, w))


def started(t, timeout=10.0):
    deadline = time.monotonic() + timeout
    while t.t_started is None:
        assert time.monotonic() < deadline, "the link never started the copy"
        time.sleep(1e-3)


def test_a_pool_of_hot_residents_takes_no_guess():
    mgr, nl, routers, ref = setup()
    routers[1].ids = [5, 6]  # always wrong: layer 1 only ever uses its residents 0 and 1
    try:
        for _ in range(4):  # the first calls: nothing measured yet, a guess may go out
            call(mgr, ref, 0, [0, 1])
            call(mgr, ref, 1, [0, 1])
        mgr.link.synchronize()
        before = mgr.stats()
        assert nl.hot(1, 0) > nl.precision(1) and nl.hot(1, 1) > nl.precision(1)
        for _ in range(40):
            call(mgr, ref, 0, [0, 1])
            call(mgr, ref, 1, [0, 1])
        after = mgr.stats()
        assert after["prefetch_issued"] == before["prefetch_issued"]
        assert after["expert_misses"] == before["expert_misses"] and after["h2d_bytes"] == before["h2d_bytes"]
        assert mgr.slots.residents(1) == [0, 1]
        mgr.slots.check()
    finally:
        mgr.close()


def test_a_guess_queues_behind_its_layers_misses():
    mgr, nl, routers, ref = setup(link=EmulatedLink(bandwidth=1e9, latency=0.02, name="slow"))
    routers[1].ids = [4, 5]
    issued = []
    real = mgr.link.copy
    mgr.link.copy = lambda *a, **kw: issued.append((kw["tag"], real(*a, **kw))) or issued[-1][1]
    try:
        call(mgr, ref, 0, [0, 3])  # 3 is missing in layer 0; the guesses 4, 5 go to layer 1
        tags = [tag for tag, _ in issued]
        guessed = {(layer, e) for layer, es in tags[1:] for e in (es if isinstance(es, tuple) else (es,))}
        assert tags[0] == (0, 3) and guessed == {(1, 4), (1, 5)}, tags  # in one transfer here (latency-bound)
        miss, guesses = issued[0][1], [t for _, t in issued[1:]]
        mgr.link.synchronize()
        assert all(miss.t_started <= t.t_started for t in guesses)
    finally:
        mgr.close()


def test_an_unneeded_guess_is_withdrawn_or_first_to_go():
    mgr, nl, routers, ref = setup(n_slots=3, link=EmulatedLink(bandwidth=1e9, latency=0.5, name="slow"))
    mgr.prefetch_batch = 1  # a copy each, as experts larger than a fixed cost's bytes go
    routers[1].ids = [6, 7]  # both wrong; 6 starts copying at once (the link is idle), 7 queues behind it
    try:
        call(mgr, ref, 0, [0, 1])  # all resident in layer 0: no miss, the guesses go out
        assert mgr.slots.residents(1) == [2, 6, 7]  # they displaced 0 and 1, the least recently used
        started(mgr.inflight[(1, 6)])
        call(mgr, ref, 1, [1, 2])  # layer 1 wants neither guess
        st = mgr.stats()
        assert st["prefetch_issued"] == 2 and st["prefetch_cancelled"] == 1 and st["prefetch_used"] == 0
        # 7 was withdrawn: 1, which it displaced, was ready again in its untouched slot (a hit);
        # 6 had started: it landed first in line for eviction, and 0 is not needed
        assert st["expert_misses"] == 0 and 7 not in mgr.slots.residents(1)
        assert mgr.slots.recency(1)[0] == 6
        mgr.link.synchronize()
        call(mgr, ref, 1, [0, 2])  # the next miss evicts 6, not a resident the text used
        assert mgr.slots.residents(1) == [0, 1, 2]
        mgr.slots.check()
    finally:
        mgr.close()


def test_a_guess_goes_out_only_where_it_pays():
    mgr, nl, routers, ref = setup(n_slots=2)
    routers[1].ids = [4, 5]
    try:
        # measured so far: every guess had started, with a fifth of its copy done, when its layer ran
        nl.head, nl.started, nl.timed = 0.2, 1.0, 1.0
        assert not nl.pays(0.5, 0.0)    # 0.5 * 0.2 < 0.5 * 0.8: a wrong one costs more than a right one saves
        assert nl.pays(0.85, 0.0)       # 0.85 * 0.2 > 0.15 * 0.8
        assert not nl.pays(0.85, 1.0)   # ... but not over a victim sure to be needed: 0.17 < 0.15 * 1.8
        call(mgr, ref, 0, [0, 1])
        assert mgr.stats()["prefetch_issued"] == 0 and mgr.slots.residents(1) == [0, 1]
        nl.head = 0.9  # a head start of nine tenths of a copy (compute-bound): now it pays
        call(mgr, ref, 0, [0, 1])
        assert mgr.stats()["prefetch_issued"] == 2
    finally:
        mgr.close()


def test_a_layer_that_misses_nothing_is_guessed_for_only_every_16th_call():
    """Its router, run ahead of it, would find nothing to copy: it runs once in `remeasure` calls (to keep
    p measured) until the layer reads an expert that is not resident, and then on every call again. The
    third slot's resident goes unused, so a guess could displace it: only the misses stop the router."""
    mgr, nl, routers, ref = setup(n_slots=3)
    runs = []
    route = routers[1].route
    routers[1].route = lambda x: runs.append(nl.calls[1]) or route(x)
    routers[1].ids = [0, 1]  # right, and resident: nothing to copy
    try:
        for _ in range(64):
            call(mgr, ref, 0, [0, 1])
            call(mgr, ref, 1, [0, 1])
        assert mgr.stats()["expert_misses"] == 0
        assert runs == list(range(1, 17)) + [32, 48, 64]  # its first 16 calls, then every 16th
        call(mgr, ref, 0, [0, 1])
        call(mgr, ref, 1, [0, 5])  # a miss (5 displaces 2): the router runs ahead of the next calls again
        del runs[:]
        for _ in range(3):
            call(mgr, ref, 0, [0, 1])
            call(mgr, ref, 1, [0, 1])
        assert runs[0] == 66 and mgr.stats()["expert_misses"] == 1  # not first at 80, the next 16th
        mgr.slots.check()
    finally:
        mgr.close()
