"""Device slot cache bookkeeping: which routed expert occupies which device slot, per layer, and
which one to evict when a new expert needs a slot.

All state lives on the host except `remap` ([n_layers, n_experts] int32 on the device, expert -> slot,
-1 = absent), which kernels read. It is allocated once and only written in place, one entry at a time,
never read back in a hot path (graph safety: see docs/ARCHITECTURE.md). An expert moves through three states:

    absent --reserve--> loading --mark_ready--> ready --(evicted by a later reserve)--> absent
    absent <--cancel--- loading   (cancel(restore=True): the expert it displaced is ready again)

remap[layer, expert] holds the slot only while the expert is ready, so a kernel never reads a slot
whose copy has not landed. With `alias=True` (a CPU pool that is the host store itself: see
OffloadedExperts) it holds the expert's own id, its row in the store, under exactly the same rule:
residency and eviction are unchanged, only the row compute reads differs. Ordering those writes against copies and kernels (events) is the caller's
job; pinned experts (refcounted) are never evicted, so their slots stay valid while in use.
"""
from __future__ import annotations

import math
from collections import Counter, OrderedDict
from typing import Callable, Collection, Iterable, Sequence

import torch

ABSENT, LOADING, READY = 0, 1, 2
POLICIES = ("lru", "lfu")


class SlotCache:
    """Per-layer residency bookkeeping for a fixed pool of `n_slots` device slots per layer."""

    def __init__(self, n_layers: int, n_experts: int, n_slots: int, device="cpu", policy: str = "lru",
                 alias: bool = False):
        if policy not in POLICIES:
            raise ValueError(f"unknown slot cache policy {policy!r}; expected one of {POLICIES}")
        if not 1 <= n_slots <= n_experts:
            raise ValueError(f"n_slots must be in [1, n_experts={n_experts}]; got {n_slots}")
        self.n_layers, self.n_experts, self.n_slots = n_layers, n_experts, n_slots
        self.policy, self.alias = policy, alias
        self.remap = torch.full((n_layers, n_experts), -1, dtype=torch.int32, device=device)
        self.stats = {"evictions": 0, "reservations": 0}
        self._planner: Callable[[int, int], float] | None = None
        self._clear_host()

    def _clear_host(self) -> None:
        L, E, S = self.n_layers, self.n_experts, self.n_slots
        self._slot = [[-1] * E for _ in range(L)]         # expert -> slot (ready or loading), host mirror
        self._state = [[ABSENT] * E for _ in range(L)]    # expert -> ABSENT | LOADING | READY
        self._owner = [[-1] * S for _ in range(L)]        # slot -> expert, -1 = free
        self._free = [list(range(S - 1, -1, -1)) for _ in range(L)]  # stack, slot 0 handed out first
        self._order = [OrderedDict() for _ in range(L)]   # residents, least recently used first
        self._count = [[0] * E for _ in range(L)]         # LFU use counts (kept across evictions)
        self._pins = [{} for _ in range(L)]               # expert -> pin refcount
        self._displaced = [[-1] * E for _ in range(L)]    # loading expert -> the resident its reserve evicted

    def reset(self) -> None:
        """Everything absent, remap all -1, counters cleared (the planner hook is kept)."""
        self._clear_host()
        self.remap.fill_(-1)
        for key in self.stats:
            self.stats[key] = 0

    # ---- queries (host only) ----

    def row(self, layer: int, expert: int) -> int:
        """The row compute reads for a ready expert: its slot, or with `alias` its own id."""
        return expert if self.alias else self._slot[layer][expert]

    def slot_of(self, layer: int, expert: int) -> int | None:
        slot = self._slot[layer][expert]
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
        return len(self._free[layer])

    # ---- policy inputs ----

    def touch(self, layer: int, experts: Iterable[int]) -> None:
        """Record a use of each expert: most recent for LRU, one more for LFU."""
        order, count = self._order[layer], self._count[layer]
        for e in experts:
            e = int(e)
            count[e] += 1
            if e in order:
                order.move_to_end(e)

    def demote(self, layer: int, experts: Iterable[int]) -> None:
        """Take back a use of each resident expert: first in line for eviction under LRU (ahead of
        every expert used since), one use fewer under LFU. For experts only rejected drafted tokens
        needed: the text will not come back to them any sooner than to anything else."""
        order, count = self._order[layer], self._count[layer]
        for e in experts:
            e = int(e)
            count[e] = max(0, count[e] - 1)
            if e in order:
                order.move_to_end(e, last=False)

    def set_planner(self, rank: Callable[[int, int], float] | None) -> None:
        """When set, evict the evictable expert with the lowest rank(layer, expert); ties -> policy order."""
        self._planner = rank

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
        free. Returns None, changing nothing, when every resident is pinned, protected or loading."""
        if self._state[layer][expert] != ABSENT:
            raise ValueError(f"expert {expert} of layer {layer} already has slot {self._slot[layer][expert]}")
        free, victim = self._free[layer], -1
        if free:
            slot = free.pop()
        else:
            victim = self._victim(layer, protect)
            if victim is None:
                return None
            slot = self._evict(layer, victim)
        self._displaced[layer][expert] = victim
        self._slot[layer][expert] = slot
        self._owner[layer][slot] = expert
        self._state[layer][expert] = LOADING
        self._order[layer][expert] = None  # most recently used
        self.stats["reservations"] += 1
        return slot

    def mark_ready(self, layer: int, expert: int) -> None:
        """The copy into the expert's slot has landed: kernels may now read it through remap."""
        if self._state[layer][expert] != LOADING:
            raise ValueError(f"expert {expert} of layer {layer} is not loading")
        self._state[layer][expert] = READY
        self.remap[layer, expert] = self.row(layer, expert)

    def cancel(self, layer: int, expert: int, *, restore: bool = False) -> None:
        """Abandon a loading reservation; its slot becomes free. restore=True (only when its copy never
        started, so the slot still holds the bytes it held before): the expert the reservation evicted
        is ready in it again, least recently used, unless it has a slot again by now."""
        if self._state[layer][expert] != LOADING:
            raise ValueError(f"expert {expert} of layer {layer} is not loading")
        if expert in self._pins[layer]:
            raise ValueError(f"cannot cancel expert {expert} of layer {layer}: it is pinned")
        slot, victim = self._release(layer, expert), self._displaced[layer][expert]
        if not restore or victim < 0 or self._state[layer][victim] != ABSENT:
            self._free[layer].append(slot)
            return
        self._slot[layer][victim] = slot
        self._owner[layer][slot] = victim
        self._state[layer][victim] = READY
        self._order[layer][victim] = None
        self._order[layer].move_to_end(victim, last=False)  # first in line to be evicted again
        self.remap[layer, victim] = self.row(layer, victim)

    def _release(self, layer: int, expert: int) -> int:
        slot = self._slot[layer][expert]
        self._slot[layer][expert] = -1
        self._state[layer][expert] = ABSENT
        self._owner[layer][slot] = -1
        del self._order[layer][expert]
        return slot

    def _evict(self, layer: int, victim: int) -> int:
        slot = self._release(layer, victim)
        self.remap[layer, victim] = -1
        self.stats["evictions"] += 1
        return slot

    def _victim(self, layer: int, protect: Collection[int]) -> int | None:
        """Evictable = ready, unpinned, unprotected. Lowest (planner rank, LFU count) wins; residents are
        walked least recently used first, so remaining ties (and plain LRU) go to the oldest."""
        state, pins, count, rank = self._state[layer], self._pins[layer], self._count[layer], self._planner
        lfu = self.policy == "lfu"
        best, best_key = None, None
        for e in self._order[layer]:
            if state[e] != READY or e in pins or e in protect:
                continue
            if rank is None and not lfu:
                return e
            key = (rank(layer, e) if rank is not None else 0, count[e] if lfu else 0)
            if best_key is None or key < best_key:
                best, best_key = e, key
        return best

    # ---- invariants ----

    def check(self) -> None:
        """Assert every invariant; reads remap back from the device (tests and debugging only)."""
        remap = self.remap.cpu().tolist()
        assert len(remap) == self.n_layers and all(len(row) == self.n_experts for row in remap)
        for l in range(self.n_layers):
            slot, state, owner, free = self._slot[l], self._state[l], self._owner[l], self._free[l]
            residents = [e for e in range(self.n_experts) if state[e] != ABSENT]
            assert len(residents) <= self.n_slots, f"layer {l}: {len(residents)} residents > {self.n_slots} slots"
            assert set(self._order[l]) == set(residents), f"layer {l}: recency order out of sync"
            assert len(set(free)) == len(free) == self.n_slots - len(residents), f"layer {l}: free list {free}"
            assert all(owner[s] == -1 for s in free), f"layer {l}: a free slot has an owner"
            for s, e in enumerate(owner):
                assert e == -1 or (state[e] != ABSENT and slot[e] == s), f"layer {l}: slot {s} owner {e}"
            for e in range(self.n_experts):
                s = slot[e]
                if state[e] == ABSENT:
                    assert s == -1, f"layer {l}: absent expert {e} has slot {s}"
                else:
                    assert 0 <= s < self.n_slots and owner[s] == e, f"layer {l}: expert {e} slot {s}"
                want = self.row(l, e) if state[e] == READY else -1
                assert remap[l][e] == want, f"layer {l}: remap[{e}]={remap[l][e]}, expected {want}"
            for e, n in self._pins[l].items():
                assert n > 0 and state[e] != ABSENT, f"layer {l}: pinned expert {e} not resident"


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
