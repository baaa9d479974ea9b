"""Device slot cache bookkeeping: which routed expert of which layer occupies which slot of the one
expert pool every MoE layer shares, and which one to evict when a new expert needs a slot.

All state lives on the host except `remap` ([n_layers, n_experts] int32 on the device, expert -> slot,
-1 = absent), which kernels read: a layer's row maps its expert ids into the shared pool. The host
table `slot[layer][expert]` (-1 = absent, else the slot of a loading or ready expert) is the one
callers read directly, in their per-expert loops, and `held` the one they set (the experts a running
call reads); every other query or change is a method. `remap` is
allocated once and only written in place, one entry at a time, never read back in a hot path (graph
safety: see docs/ARCHITECTURE.md). An expert moves through three states:

    absent --reserve--> loading --mark_ready--> ready --(evicted by a later reserve)--> absent
    absent <--cancel--- loading   (cancel(restore=True): the expert it displaced is ready again)

remap[layer, expert] holds the slot only while the expert is ready, so a kernel never reads a slot
whose copy has not landed. With `alias=True` (a CPU pool that is the host store itself: see
OffloadedExperts) it holds the expert's own id, its row in the store, under exactly the same rule:
residency and eviction are unchanged, only the row compute reads differs. Ordering those writes against
copies and kernels (events) is the caller's job; pinned experts (refcounted) are never evicted, so
their slots stay valid while in use.

The pool: `pool` slots (default n_layers x n_slots), any layer's expert in any slot; `n_slots` is the
most one layer may hold (its quota). The per-layer pool of old is the rule pool = n_layers x quota:
a layer at its quota evicts one of its own, and no layer can then take another's slot. The memory
plan's shared pool sets the quota to a layer's share, ceil(pool / n_layers) or top-k if more (a
pool below every layer's top-k then still runs, each layer's top-k taking turns in it); with a quota
of n_experts (`SlotCache.shared`, the plan's "open" pool) a layer takes as many slots as eviction
gives it.

Eviction ranks the residents of every layer by predicted next use. Within a layer that is recency
(the least recently used first, LRU), or use counts (LFU). Across layers it is the distance to the
next read: layers are read in order, 0..L-1 and again, so after layer `now` was used, layer m is
read again in d(m) = (m - now - 1) mod L layer calls, and an expert its layer's last `age` calls
did not use is predicted to be next used about d(m) + L x age calls from now. The victim is the
resident farthest in that order (Belady's rule on the prediction); a layer's own experts thus go
before those of the layer about to run. A planner rank (set_planner: the lookahead's demand, the
oracle's true next use) comes first when set, the prediction breaking its ties.
"""
from __future__ import annotations

import math
from collections import Counter, OrderedDict
from typing import Callable, Collection, Iterable, Sequence

import torch

ABSENT, LOADING, READY = 0, 1, 2
POLICIES = ("lru", "lfu")
_DEMOTED = -(1 << 40)  # the use stamp of an expert put first in line: older than any use


class SlotCache:
    """Residency bookkeeping for one pool of device slots shared by `n_layers` layers."""

    def __init__(self, n_layers: int, n_experts: int, n_slots: int, device="cpu", policy: str = "lru",
                 alias: bool = False, *, pool: int | None = None):
        """`n_slots`: the most experts one layer may hold; `pool`: the slots all layers share (default
        n_layers x n_slots: the per-layer pool)."""
        if policy not in POLICIES:
            raise ValueError(f"unknown slot cache policy {policy!r}; expected one of {POLICIES}")
        if not 1 <= n_slots <= n_experts:
            raise ValueError(f"n_slots must be in [1, n_experts={n_experts}]; got {n_slots}")
        pool = n_layers * n_slots if pool is None else pool
        if not 1 <= pool <= n_layers * n_experts:
            raise ValueError(f"pool must be in [1, n_layers x n_experts = {n_layers * n_experts}]; got {pool}")
        self.n_layers, self.n_experts, self.pool_slots = n_layers, n_experts, pool
        self.n_slots = min(n_slots, pool)
        self.per_layer = pool == n_layers * self.n_slots  # the quota rule alone decides: no layer borrows
        self.policy, self.alias = policy, alias
        self.remap = torch.full((n_layers, n_experts), -1, dtype=torch.int32, device=device)
        self.stats = {"evictions": 0, "reservations": 0}
        self._planner: Callable[[int, int], float] | None = None
        self._rank_across = False
        self._clear_host()

    @classmethod
    def shared(cls, n_layers: int, n_experts: int, pool: int, **kw) -> "SlotCache":
        """One pool of `pool` slots, no quota: a layer may hold up to every one of its experts."""
        return cls(n_layers, n_experts, min(n_experts, pool), pool=pool, **kw)

    def _clear_host(self) -> None:
        L, E, S = self.n_layers, self.n_experts, self.pool_slots
        self.slot = [[-1] * E for _ in range(L)]          # expert -> slot (ready or loading), -1 = absent
        self._state = [[ABSENT] * E for _ in range(L)]    # expert -> ABSENT | LOADING | READY
        self._owner = [-1] * S                            # slot -> layer * E + expert, -1 = free
        self._free = list(range(S - 1, -1, -1))           # stack, slot 0 handed out first
        self._order = [OrderedDict() for _ in range(L)]   # a layer's residents, least recently used first
        self._stamp = [[0] * E for _ in range(L)]         # the layer's call count at the expert's last use
        self._reads = [0] * L                             # calls of each layer so far (touch)
        self._now = L - 1                                 # the layer used last: layer 0 runs next
        self._count = [[0] * E for _ in range(L)]         # LFU use counts (kept across evictions)
        self._pins = [{} for _ in range(L)]               # expert -> pin refcount
        self._displaced = [[-1] * E for _ in range(L)]    # loading expert -> layer * E + the resident it evicted
        # (layer, experts) a running call reads: reservations for other layers do not evict them (its own
        # copies evict by their `protect`); the caller sets it, that layer's touch() clears it
        self.held: tuple[int, Collection[int]] = (-1, ())

    def reset(self) -> None:
        """Everything absent, remap all -1, counters cleared (the planner hook is kept)."""
        self._clear_host()
        self.remap.fill_(-1)
        for key in self.stats:
            self.stats[key] = 0

    # ---- queries (host only) ----

    def row(self, layer: int, expert: int) -> int:
        """The row compute reads for a ready expert: its slot, or with `alias` its own id."""
        return expert if self.alias else self.slot[layer][expert]

    def slot_of(self, layer: int, expert: int) -> int | None:
        slot = self.slot[layer][expert]
        return None if slot < 0 else slot

    def is_ready(self, layer: int, expert: int) -> bool:
        return self._state[layer][expert] == READY

    def residents(self, layer: int) -> list[int]:
        return sorted(self._order[layer])

    def ready_experts(self, layer: int) -> list[int]:
        state = self._state[layer]
        return sorted(e for e in self._order[layer] if state[e] == READY)

    def recency(self, layer: int) -> list[int]:
        """The layer's residents (ready or loading), least recently used first."""
        return list(self._order[layer])

    def is_pinned(self, layer: int, expert: int) -> bool:
        return expert in self._pins[layer]

    def free_slots(self, layer: int) -> int:
        """Slots `layer` can take without evicting: free ones, up to its quota."""
        return max(0, min(len(self._free), self.n_slots - len(self._order[layer])))

    def room(self, layer: int, using: Collection[int]) -> tuple[int, list[int]]:
        """Where copies for `layer` can go while a call uses `using`: (free_slots(layer), its residents
        not in `using`, least recently used first: those the copies may displace)."""
        order, others = self._order[layer], []
        for e in order:
            if e not in using:
                others.append(e)
        return max(0, min(len(self._free), self.n_slots - len(order))), others

    @property
    def used_slots(self) -> int:
        return self.pool_slots - len(self._free)

    # ---- policy inputs ----

    def touch(self, layer: int, experts: Iterable[int]) -> None:
        """A call of `layer` used these experts: most recent for LRU, one more for LFU; the layer is
        the one read last (the distance of every layer's next read counts from it), and the call's
        `held` experts (if any) may go again."""
        order, count, stamp = self._order[layer], self._count[layer], self._stamp[layer]
        self._reads[layer] = now = self._reads[layer] + 1
        self._now = layer
        if self.held[0] == layer:  # the call is over: what it held may go
            self.held = (-1, ())
        for e in experts:
            e = int(e)
            count[e] += 1
            if e in order:
                order.move_to_end(e)
                stamp[e] = now

    def demote(self, layer: int, experts: Iterable[int]) -> None:
        """Take back a use of each expert: one use fewer under LFU, and a resident one first in line for
        eviction under LRU (ahead of every expert used since, in any layer). For experts only rejected
        drafted tokens needed: the text will not come back to them any sooner than to anything else."""
        order, count, stamp = self._order[layer], self._count[layer], self._stamp[layer]
        for e in experts:
            e = int(e)
            count[e] = max(0, count[e] - 1)
            if e in order:
                order.move_to_end(e, last=False)
                stamp[e] = _DEMOTED

    def set_planner(self, rank: Callable[[int, int], float] | None, *, across_layers: bool = False) -> None:
        """When set, evict the evictable expert with the lowest rank(layer, expert); ties -> policy order.
        `across_layers`: the rank orders experts of different layers as it orders one layer's (the
        oracle's true next use). Otherwise (a planner's demand scores, comparable within a layer), while
        a call of layer c runs, the experts of layers c and below (not read again before the next pass)
        go before those of the layers still to run, lowest rank first in each group."""
        self._planner, self._rank_across = rank, across_layers

    def pin(self, layer: int, experts: Iterable[int]) -> None:
        experts = [int(e) for e in experts]
        state, pins = self._state[layer], self._pins[layer]
        for e in experts:
            if state[e] == ABSENT:
                raise ValueError(f"cannot pin expert {e} of layer {layer}: it has no slot")
        for e in experts:
            pins[e] = pins.get(e, 0) + 1

    def unpin(self, layer: int, experts: Iterable[int]) -> None:
        need, pins = Counter(int(e) for e in experts), self._pins[layer]
        for e, n in need.items():
            if pins.get(e, 0) < n:
                raise ValueError(f"cannot unpin expert {e} of layer {layer}: not pinned {n} time(s)")
        for e, n in need.items():
            if pins[e] == n:
                del pins[e]
            else:
                pins[e] -= n

    # ---- slot lifecycle ----

    def reserve(self, layer: int, expert: int, *, protect: Collection[int] = ()) -> int | None:
        """A slot for `expert` to be copied into (it becomes loading), evicting a victim if no slot is
        free. `protect`: experts of `layer` not to evict. Returns None, changing nothing, when every
        candidate is pinned, protected, held or loading."""
        if self._state[layer][expert] != ABSENT:
            raise ValueError(f"expert {expert} of layer {layer} already has slot {self.slot[layer][expert]}")
        victim = -1
        if self._free and len(self._order[layer]) < self.n_slots:  # a free slot within the layer's quota
            slot = self._free.pop()
        else:
            found = self.victim(layer, protect)
            if found is None:
                return None
            vl, v = found  # evicted: absent now, its slot passes to `expert`
            victim, slot = vl * self.n_experts + v, self.slot[vl][v]
            self.slot[vl][v] = -1
            self._state[vl][v] = ABSENT
            del self._order[vl][v]
            self.remap[vl, v] = -1
            self.stats["evictions"] += 1
        self._displaced[layer][expert] = victim
        self.slot[layer][expert] = slot
        self._owner[slot] = layer * self.n_experts + expert
        self._state[layer][expert] = LOADING
        self._order[layer][expert] = None  # most recently used
        self._stamp[layer][expert] = self._reads[layer]
        self.stats["reservations"] += 1
        return slot

    def mark_ready(self, layer: int, expert: int) -> None:
        """The copy into the expert's slot has landed: kernels may now read it through remap."""
        if self._state[layer][expert] != LOADING:
            raise ValueError(f"expert {expert} of layer {layer} is not loading")
        self.remap[layer, expert] = expert if self.alias else self.slot[layer][expert]  # row(layer, expert)
        self._state[layer][expert] = READY  # last: a mark cut short leaves it loading, and marked again

    def cancel(self, layer: int, expert: int, *, restore: bool = False) -> None:
        """Abandon a loading reservation; its slot becomes free. restore=True (only when its copy never
        started, so the slot still holds the bytes it held before): the expert the reservation evicted
        is ready in it again, first in line for eviction, unless it has a slot again by now."""
        if self._state[layer][expert] != LOADING:
            raise ValueError(f"expert {expert} of layer {layer} is not loading")
        if expert in self._pins[layer]:
            raise ValueError(f"cannot cancel expert {expert} of layer {layer}: it is pinned")
        slot, displaced = self.slot[layer][expert], self._displaced[layer][expert]
        self.slot[layer][expert] = -1
        self._state[layer][expert] = ABSENT
        self._owner[slot] = -1
        del self._order[layer][expert]
        vl, v = divmod(displaced, self.n_experts) if displaced >= 0 else (-1, -1)
        if not restore or v < 0 or self._state[vl][v] != ABSENT or len(self._order[vl]) >= self.n_slots:
            self._free.append(slot)
            return
        self.slot[vl][v] = slot
        self._owner[slot] = displaced
        self._state[vl][v] = READY
        self._order[vl][v] = None
        self._order[vl].move_to_end(v, last=False)  # first in line to be evicted again
        self._stamp[vl][v] = _DEMOTED
        self.remap[vl, v] = v if self.alias else slot  # row(vl, v)

    def next_use(self, layer: int, expert: int) -> int:
        """The predicted distance, in layer calls, to the next use of a resident (see the module doc)."""
        L = self.n_layers
        return (layer - self._now - 1) % L + L * (self._reads[layer] - self._stamp[layer][expert])

    def victim(self, layer: int, protect: Collection[int] = ()) -> tuple[int, int] | None:
        """(layer, expert) a reservation for `layer` would evict now, or None. Evictable = ready, unpinned,
        not in `protect` (experts of `layer`), not held by a running call of another layer; only
        `layer`'s own when it is at its quota. Lowest (planner rank, LFU count) first, then the farthest
        predicted next use; within a layer the least recently used among equals. A planner's rank
        (set_planner) is taken within two groups: while a call of layer c runs, layers <= c first."""
        running, held = self.held
        if len(self._order[layer]) >= self.n_slots:
            layers = (layer,)
        else:
            layers = [m for m in range(self.n_layers) if self._order[m]]
        rank, lfu = self._planner, self.policy == "lfu"
        held_layer = -1 if running == layer else running
        passed = running if rank is not None and not self._rank_across else -1
        best, best_key = None, None
        L, now = self.n_layers, self._now
        for m in layers:
            state, pins, stamp, reads = self._state[m], self._pins[m], self._stamp[m], self._reads[m]
            guard = protect if m == layer else ()
            hold = held if m == held_layer else ()
            d = (m - now - 1) % L
            ahead = m > passed
            for e in self._order[m]:
                if state[e] != READY or e in pins or e in guard or e in hold:
                    continue
                far = d + L * (reads - stamp[e])
                if rank is None and not lfu:  # the first evictable in order is its layer's oldest
                    key = (-far,)
                else:
                    key = (ahead, rank(m, e) if rank is not None else 0, self._count[m][e] if lfu else 0, -far)
                if best_key is None or key < best_key:
                    best, best_key = (m, e), key
                if rank is None and not lfu:
                    break
        return best

    # ---- invariants ----

    def check(self) -> None:
        """Assert every invariant; reads remap back from the device (tests and debugging only)."""
        remap = self.remap.cpu().tolist()
        E = self.n_experts
        assert len(remap) == self.n_layers and all(len(row) == E for row in remap)
        owner, free = self._owner, self._free
        total = 0
        for l in range(self.n_layers):
            slot, state = self.slot[l], self._state[l]
            residents = [e for e in range(E) if state[e] != ABSENT]
            total += len(residents)
            assert len(residents) <= self.n_slots, f"layer {l}: {len(residents)} residents > quota {self.n_slots}"
            assert set(self._order[l]) == set(residents), f"layer {l}: recency order out of sync"
            stamps = [self._stamp[l][e] for e in self._order[l]]
            assert stamps == sorted(stamps), f"layer {l}: use stamps out of recency order {stamps}"
            for e in range(E):
                s = slot[e]
                if state[e] == ABSENT:
                    assert s == -1, f"layer {l}: absent expert {e} has slot {s}"
                else:
                    assert 0 <= s < self.pool_slots and owner[s] == l * E + e, f"layer {l}: expert {e} slot {s}"
                want = self.row(l, e) if state[e] == READY else -1
                assert remap[l][e] == want, f"layer {l}: remap[{e}]={remap[l][e]}, expected {want}"
            for e, n in self._pins[l].items():
                assert n > 0 and state[e] != ABSENT, f"layer {l}: pinned expert {e} not resident"
        assert len(set(free)) == len(free) == self.pool_slots - total, f"free list {free}, {total} residents"
        assert all(owner[s] == -1 for s in free), "a free slot has an owner"
        for s, key in enumerate(owner):
            if key >= 0:
                l, e = divmod(key, E)
                assert self._state[l][e] != ABSENT and self.slot[l][e] == s, f"slot {s} owner {(l, e)}"


def belady_victim(candidates: Iterable[int], future: Sequence[int]) -> int:
    """The candidate whose next use in `future` is farthest (never used = farthest; ties -> smallest id)."""
    candidates = list(candidates)
    if not candidates:
        raise ValueError("belady_victim needs at least one candidate")
    wanted, next_use = set(candidates), {}
    for i, e in enumerate(future):
        if e in wanted and e not in next_use:
            next_use[e] = i
            if len(next_use) == len(wanted):
                break
    return max(candidates, key=lambda e: (next_use.get(e, math.inf), -e))
