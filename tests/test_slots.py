import random

import pytest
import torch

from specter.offload.slots import SlotCache, belady_victim

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def fill(cache, layer, experts):
    """Reserve and land each expert in order (free slots must suffice)."""
    for e in experts:
        assert cache.reserve(layer, e) is not None
        cache.mark_ready(layer, e)
    cache.check()


def reserve_ready(cache, layer, expert, **kw):
    slot = cache.reserve(layer, expert, **kw)
    assert slot is not None
    cache.mark_ready(layer, expert)
    cache.check()
    return slot


# ---- construction and basic lifecycle ----

def test_the_slot_table_and_room_agree_with_the_queries():
    """`slot[layer][e]` (what hot loops read) is slot_of's table, and room() is free_slots() with the
    residents a call does not use, least recently used first."""
    cache = SlotCache(2, 8, 3, pool=5)
    fill(cache, 0, [4, 1])
    assert cache.reserve(0, 6) is not None  # loading: resident too
    cache.touch(0, [4])
    for l in range(2):
        assert [cache.slot_of(l, e) for e in range(8)] == [s if s >= 0 else None for s in cache.slot[l]]
    assert cache.room(0, {1}) == (cache.free_slots(0), [6, 4]) == (0, [6, 4])  # at its quota of 3
    assert cache.room(1, ()) == (cache.free_slots(1), []) == (2, [])             # 2 of the 5 are free


def test_construct_and_validate(device):
    cache = SlotCache(3, 8, 4, device=device)
    assert cache.remap.shape == (3, 8) and cache.remap.dtype == torch.int32
    assert cache.remap.device.type == torch.device(device).type
    assert (cache.remap == -1).all()
    assert [cache.free_slots(l) for l in range(3)] == [4, 4, 4]
    cache.check()
    for bad in (0, 9):
        with pytest.raises(ValueError):
            SlotCache(3, 8, bad)
    with pytest.raises(ValueError, match="policy"):
        SlotCache(3, 8, 4, policy="fifo")


def test_remap_set_only_on_mark_ready(device):
    cache = SlotCache(2, 8, 2, device=device)
    ptr = cache.remap.data_ptr()
    slot = cache.reserve(1, 5)
    assert slot == 0 and cache.slot_of(1, 5) == 0 and not cache.is_ready(1, 5)
    assert cache.residents(1) == [5] and cache.ready_experts(1) == []
    assert cache.remap[1, 5].item() == -1
    cache.check()
    cache.mark_ready(1, 5)
    assert cache.is_ready(1, 5) and cache.remap[1, 5].item() == 0 and cache.ready_experts(1) == [5]
    assert cache.slot_of(0, 5) is None and cache.remap[0, 5].item() == -1  # other layers untouched
    cache.check()
    assert cache.remap.data_ptr() == ptr  # updated in place, never reallocated
    with pytest.raises(ValueError):
        cache.mark_ready(1, 5)  # not loading any more
    with pytest.raises(ValueError):
        cache.reserve(1, 5)  # already resident


def test_victim_remap_cleared_at_reserve(device):
    cache = SlotCache(1, 8, 2, device=device)
    fill(cache, 0, [0, 1])
    slot = cache.reserve(0, 2)
    assert slot == 0  # expert 0 was least recently used
    assert cache.slot_of(0, 0) is None and cache.remap[0, 0].item() == -1
    assert cache.remap[0, 2].item() == -1  # new expert still loading
    assert cache.stats == {"evictions": 1, "reservations": 3}
    cache.check()


def test_cancel_frees_slot(device):
    cache = SlotCache(1, 8, 2, device=device)
    slot = cache.reserve(0, 3)
    cache.cancel(0, 3)
    cache.check()
    assert cache.slot_of(0, 3) is None and cache.free_slots(0) == 2 and cache.residents(0) == []
    assert cache.reserve(0, 4) == slot
    cache.mark_ready(0, 4)
    with pytest.raises(ValueError):
        cache.cancel(0, 4)  # ready experts cannot be cancelled
    cache.reserve(0, 5)
    cache.pin(0, [5])
    with pytest.raises(ValueError):
        cache.cancel(0, 5)  # pinned reservations cannot be cancelled
    cache.check()


def test_cancel_with_restore_gives_the_displaced_expert_its_slot_back(device):
    """A reservation whose copy never started is undone: the resident it evicted is ready again in
    the same slot (its bytes were never overwritten), first in line for eviction; unless that expert
    has a slot again by now, in which case the slot is simply free."""
    cache = SlotCache(1, 8, 2, device=device)
    for e in (0, 1):
        cache.reserve(0, e)
        cache.mark_ready(0, e)
    cache.touch(0, [0])                          # 1 is the least recently used
    slot = cache.reserve(0, 5)                   # evicts 1
    assert cache.slot_of(0, 1) is None and cache.remap[0, 1].item() == -1
    cache.cancel(0, 5, restore=True)
    cache.check()
    assert cache.is_ready(0, 1) and cache.slot_of(0, 1) == slot and cache.remap[0, 1].item() == slot
    assert cache.slot_of(0, 5) is None and cache.free_slots(0) == 0
    assert cache.reserve(0, 6) == slot           # a restored expert is least recent: 1 goes again, not 0
    cache.reserve(0, 1)                          # 1 is back, loading, in the other slot (0's)
    cache.cancel(0, 6, restore=True)             # nothing to restore: 1 has a slot
    cache.check()
    assert cache.free_slots(0) == 1 and cache.slot_of(0, 6) is None and not cache.is_ready(0, 1)
    free = cache.reserve(0, 7)                   # a free slot: nothing displaced, nothing to restore
    cache.cancel(0, 7, restore=True)
    cache.check()
    assert cache.free_slots(0) == 1 and free not in (cache.slot_of(0, e) for e in range(8))


def test_reset(device):
    cache = SlotCache(2, 8, 3, device=device, policy="lfu")
    fill(cache, 0, [1, 2, 3])
    cache.touch(0, [1, 1, 2])
    cache.reserve(1, 4)
    cache.pin(0, [1])
    reserve_ready(cache, 0, 5)
    stats = cache.stats
    cache.reset()
    cache.check()
    assert (cache.remap == -1).all() and cache.stats is stats and stats == {"evictions": 0, "reservations": 0}
    assert all(cache.residents(l) == [] and cache.free_slots(l) == 3 for l in range(2))
    # counts were cleared: with equal (zero) counts LFU falls back to LRU order
    fill(cache, 0, [1, 2, 3])
    reserve_ready(cache, 0, 4)
    assert cache.residents(0) == [2, 3, 4]


# ---- policies ----

def test_lru_evicts_least_recently_touched(device):
    cache = SlotCache(1, 8, 3, device=device)
    fill(cache, 0, [0, 1, 2])
    cache.touch(0, [0])  # recency now 1, 2, 0
    reserve_ready(cache, 0, 3)
    assert cache.residents(0) == [0, 2, 3]
    cache.touch(0, [2, 0])  # recency 3, 2, 0
    reserve_ready(cache, 0, 4)
    assert cache.residents(0) == [0, 2, 4]
    cache.touch(0, [7])  # touching a non-resident changes nothing
    reserve_ready(cache, 0, 5)
    assert cache.residents(0) == [0, 4, 5]


def test_lfu_evicts_least_frequently_touched(device):
    cache = SlotCache(1, 8, 3, device=device, policy="lfu")
    fill(cache, 0, [0, 1, 2])
    cache.touch(0, [0, 0, 0, 1, 2, 2])  # counts 3, 1, 2
    reserve_ready(cache, 0, 3)
    assert cache.residents(0) == [0, 2, 3]  # 1 had the fewest uses
    cache.touch(0, [3, 3])  # counts 0:3, 2:2, 3:2 -> tie between 2 and 3, 2 is older
    reserve_ready(cache, 0, 4)
    assert cache.residents(0) == [0, 3, 4]
    # counts survive eviction: 1 comes back with its old use and a new one
    cache.touch(0, [1, 4, 4, 4, 4])
    reserve_ready(cache, 0, 1)  # counts 0:3, 3:2, 4:4 -> evict 3
    assert cache.residents(0) == [0, 1, 4]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_demote_puts_an_expert_first_in_line_for_eviction(device, policy):
    cache = SlotCache(1, 8, 3, device=device, policy=policy)
    fill(cache, 0, [0, 1, 2])
    cache.touch(0, [0, 1, 2, 2])  # LRU order 0, 1, 2; LFU counts 0:1, 1:1, 2:2
    cache.demote(0, [2, 7])  # 2 used most recently (most often, under LFU) -- demoted; 7 is absent: ignored
    reserve_ready(cache, 0, 3)
    assert cache.residents(0) == [0, 1, 3]
    cache.touch(0, [3])
    cache.demote(0, [1])
    reserve_ready(cache, 0, 4)
    assert cache.residents(0) == [0, 3, 4]


def test_planner_rank_respected(device):
    for policy in ("lru", "lfu"):
        cache = SlotCache(2, 8, 4, device=device, policy=policy)
        fill(cache, 1, [0, 1, 2, 3])
        ranks = {0: 5.0, 1: 1.0, 2: 9.0, 3: 1.0}
        seen = []
        cache.set_planner(lambda l, e: seen.append(l) or ranks.get(e, 0.0))
        cache.touch(1, [1])  # 1 and 3 tie on rank; 3 is now least recent (and as frequent) -> 3
        reserve_ready(cache, 1, 4)
        assert cache.residents(1) == [0, 1, 2, 4] and set(seen) == {1}
        ranks[4] = 7.0
        reserve_ready(cache, 1, 5)  # lowest rank is 1
        assert cache.residents(1) == [0, 2, 4, 5]
        ranks[5] = 100.0
        reserve_ready(cache, 1, 6, protect={0})  # 0 (rank 5) protected -> 4 (rank 7)
        assert cache.residents(1) == [0, 2, 5, 6]
        cache.set_planner(None)  # back to the plain policy
        cache.touch(1, [0, 2, 5, 6, 0, 2, 6])  # recency 5, 0, 2, 6; counts 0:2, 2:2, 5:1, 6:2
        reserve_ready(cache, 1, 7)
        assert cache.residents(1) == [0, 2, 6, 7]


def test_pinned_protected_loading_never_evicted(device):
    cache = SlotCache(1, 8, 4, device=device)
    fill(cache, 0, [0, 1, 2])
    cache.reserve(0, 3)  # loading
    cache.touch(0, [0, 1, 2])  # the loading expert 3 is now the least recently used
    cache.pin(0, [0])
    slot = cache.reserve(0, 4, protect=[1])
    assert slot == cache.slot_of(0, 4) and cache.residents(0) == [0, 1, 3, 4]  # 2 was the only evictable
    cache.check()
    cache.pin(0, [1])
    cache.mark_ready(0, 4)
    cache.pin(0, [4])
    assert cache.reserve(0, 5) is None  # 0, 1, 4 pinned, 3 loading
    assert cache.stats == {"evictions": 1, "reservations": 5}
    cache.check()
    cache.mark_ready(0, 3)
    assert cache.reserve(0, 5) == cache.slot_of(0, 5) and cache.slot_of(0, 3) is None
    cache.check()


def test_pin_refcount_and_errors(device):
    cache = SlotCache(1, 4, 1, device=device)
    with pytest.raises(ValueError):
        cache.pin(0, [0])  # not resident
    reserve_ready(cache, 0, 0)
    cache.pin(0, [0, 0])
    cache.pin(0, [0])
    cache.unpin(0, [0, 0])
    assert cache.reserve(0, 1) is None  # still pinned once
    cache.unpin(0, [0])
    with pytest.raises(ValueError):
        cache.unpin(0, [0])
    assert cache.reserve(0, 1) == 0
    with pytest.raises(ValueError):
        cache.pin(0, [1, 2])  # 2 absent: nothing pinned at all
    with pytest.raises(ValueError):
        cache.unpin(0, [1])
    cache.check()


def test_reserve_none_when_all_pinned(device):
    cache = SlotCache(2, 6, 3, device=device)
    fill(cache, 0, [0, 1, 2])
    cache.pin(0, [0, 1, 2])
    before = cache.remap.clone()
    assert cache.reserve(0, 3) is None
    assert torch.equal(cache.remap, before) and cache.residents(0) == [0, 1, 2]
    assert cache.reserve(1, 3) == 3  # the per-layer rule: other layers are independent (slot 3: a free one)
    cache.check()


# ---- randomized operation sequences against a brute-force reference ----

@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("seed", range(4))
def test_random_sequences(device, policy, seed):
    rng = random.Random(seed)
    L, E, S = 2, 10, 4
    cache = SlotCache(L, E, S, device=device, policy=policy)
    clock = 0
    last = [[0] * E for _ in range(L)]   # reference recency: reserve and touch both count as a use
    count = [[0] * E for _ in range(L)]  # reference LFU counts
    pins = [dict() for _ in range(L)]
    ranks = [[rng.randrange(3) for _ in range(E)] for _ in range(L)]
    planner = False
    reserved = evicted = 0  # since the last reset, to compare with cache.stats
    totals = {"reserved": 0, "evicted": 0}

    for step in range(600):
        l = rng.randrange(L)
        op = rng.random()
        state = {e: cache.is_ready(l, e) for e in cache.residents(l)}
        loading = [e for e, ready in state.items() if not ready]
        if op < 0.30:
            e = rng.randrange(E)
            if e in state:
                continue
            protect = set(rng.sample(range(E), rng.randrange(3)))
            evictable = [x for x, ready in state.items() if ready and x not in pins[l] and x not in protect]
            expected_victim = None
            if cache.free_slots(l) == 0 and evictable:
                expected_victim = min(evictable, key=lambda x: (
                    ranks[l][x] if planner else 0, count[l][x] if policy == "lfu" else 0, last[l][x]))
            free_before = cache.free_slots(l)
            victim_slot = None if expected_victim is None else cache.slot_of(l, expected_victim)
            slot = cache.reserve(l, e, protect=protect)
            if free_before == 0 and not evictable:
                assert slot is None
            else:
                assert slot is not None and cache.slot_of(l, e) == slot and not cache.is_ready(l, e)
                if expected_victim is not None:
                    assert slot == victim_slot and cache.slot_of(l, expected_victim) is None
                    evicted += 1
                    totals["evicted"] += 1
                reserved += 1
                totals["reserved"] += 1
                clock += 1
                last[l][e] = clock
        elif op < 0.50 and loading:
            e = rng.choice(loading)
            if e in pins[l] or rng.random() < 0.8:
                cache.mark_ready(l, e)
            else:
                cache.cancel(l, e)
        elif op < 0.70:
            experts = [rng.randrange(E) for _ in range(rng.randrange(1, 4))]
            cache.touch(l, experts)
            for e in experts:
                clock += 1
                last[l][e] = clock
                count[l][e] += 1
        elif op < 0.80 and state:
            e = rng.choice(list(state))
            cache.pin(l, [e])
            pins[l][e] = pins[l].get(e, 0) + 1
        elif op < 0.90 and pins[l]:
            e = rng.choice(list(pins[l]))
            cache.unpin(l, [e])
            pins[l][e] -= 1
            if not pins[l][e]:
                del pins[l][e]
        elif op < 0.95:
            planner = not planner
            cache.set_planner((lambda layer, e: ranks[layer][e]) if planner else None)
        elif op < 0.96:
            assert cache.stats == {"reservations": reserved, "evictions": evicted}
            reserved = evicted = 0
            cache.reset()
            last = [[0] * E for _ in range(L)]
            count = [[0] * E for _ in range(L)]
            pins = [dict() for _ in range(L)]
        cache.check()
        # host mirror agrees with the device table
        remap = cache.remap.cpu()
        for e in range(E):
            s = cache.slot_of(l, e)
            assert remap[l, e].item() == (s if cache.is_ready(l, e) else -1)
    assert cache.stats == {"reservations": reserved, "evictions": evicted}
    assert totals["reserved"] > 50 and totals["evicted"] > 10  # the sequence exercised eviction, not just free slots


# ---- Belady ----

def test_belady_victim():
    assert belady_victim([1, 2, 3], [1, 2, 3]) == 3
    assert belady_victim([1, 2, 3], [3, 1, 3, 2]) == 2
    assert belady_victim([1, 2, 3], [1]) == 2  # 2 and 3 never used again: smallest id
    assert belady_victim([5, 4], []) == 4
    assert belady_victim(iter([7]), [7, 7]) == 7
    assert belady_victim({0, 9, 4}, [9, 0, 4, 4, 9]) == 4
    with pytest.raises(ValueError):
        belady_victim([], [1, 2])


# ---- one pool shared by every layer ----

def test_shared_pool_slots_go_to_the_layers_that_need_them(device):
    cache = SlotCache.shared(3, 8, 4, device=device)
    assert cache.n_slots == 4 and cache.pool_slots == 4 and not cache.per_layer
    fill(cache, 1, [0, 1, 2])                 # one layer takes three of the four slots
    assert cache.free_slots(0) == cache.free_slots(2) == 1
    assert cache.remap[1].tolist()[:3] == [0, 1, 2]  # the layer's remap row points into the one pool
    reserve_ready(cache, 2, 5)
    assert cache.used_slots == 4 and cache.free_slots(0) == 0
    cache.touch(1, [0, 1, 2])                 # layer 1 read last: layer 2 runs next, then 0, then 1 again
    slot = reserve_ready(cache, 0, 7)         # layer 1's experts are read farthest from now: one goes
    assert cache.slot_of(1, 0) is None and slot == 0 and cache.residents(1) == [1, 2]
    with pytest.raises(ValueError, match="pool"):
        SlotCache.shared(2, 4, 9)
    quota = SlotCache(2, 8, 2, device=device, pool=3)  # a quota below the pool: a layer evicts its own
    fill(quota, 0, [0, 1])
    assert quota.free_slots(0) == 0 and quota.free_slots(1) == 1
    reserve_ready(quota, 0, 2)
    assert quota.residents(0) == [1, 2] and quota.used_slots == 2


def test_shared_pool_evicts_the_farthest_predicted_next_use(device):
    """Layer m is read again (m - now - 1) mod L calls after layer `now`; an expert its layer's last
    `age` calls did not use is predicted L x age calls later still."""
    L = 4
    cache = SlotCache.shared(L, 8, 8, device=device)
    for layer in range(L):
        fill(cache, layer, [0, 1])
    for layer in range(L):                    # one decode step: every layer used expert 0 only
        cache.touch(layer, [0])
    assert [cache.next_use(l, 0) for l in range(L)] == [0, 1, 2, 3]
    assert [cache.next_use(l, 1) for l in range(L)] == [4, 5, 6, 7]
    evicted = []
    for new in (2, 3, 4, 5):                  # layer 0 asks: the stale experts go, farthest layer first
        reserve_ready(cache, 0, new)
        evicted += [(l, e) for l in range(L) for e in (0, 1) if cache.slot_of(l, e) is None and (l, e) not in evicted]
    assert evicted == [(3, 1), (2, 1), (1, 1), (0, 1)]
    cache.touch(0, [0, 2, 3, 4, 5])           # layer 0 read last: it is read again after 1, 2 and 3
    assert cache.victim(1) == (0, 0)          # so one of its experts goes, the first of its recency order
    cache.demote(2, [0])                      # a rejected draft's expert: first in line, whatever its layer
    assert cache.victim(1) == (2, 0)


def test_hold_keeps_a_running_call_s_experts_from_other_layers(device):
    cache = SlotCache.shared(2, 8, 3, device=device)
    fill(cache, 0, [0, 1])
    fill(cache, 1, [4])
    cache.touch(0, [0, 1])
    cache.held = (1, {4})                     # layer 1 is computing with 4
    cache.touch(1, [])                        # (another call's touch does not end the hold) ...
    cache.held = (1, {4})
    assert cache.victim(0) == (0, 0)          # layer 0's own experts, never the held one
    cache.pin(0, [0, 1])
    assert cache.reserve(0, 2) is None        # nothing else evictable
    assert cache.reserve(1, 5) is not None    # layer 1's own copy may evict ... not its held 4: nothing else
    cache.check()


def test_cancel_restore_across_layers(device):
    cache = SlotCache.shared(2, 8, 2, device=device)
    fill(cache, 0, [0])
    fill(cache, 1, [3])
    cache.touch(1, [3])
    cache.touch(0, [0])                       # layer 0 read last: layer 1 runs next
    slot = cache.reserve(1, 5)                # evicts layer 0's expert 0, the farthest next read
    assert cache.slot_of(0, 0) is None
    cache.cancel(1, 5, restore=True)
    cache.check()
    assert cache.slot_of(0, 0) == slot and cache.is_ready(0, 0) and cache.victim(1) == (0, 0)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("seed", range(4))
def test_random_sequences_shared_pool(device, policy, seed):
    """Every reservation against a brute-force reference of the shared pool's rule: free slot if the
    layer is under its quota, else the evictable resident (of its own layer at the quota) with the
    lowest (rank, LFU count, -predicted next use), least recent of its layer among equals; with a
    planner rank, the layers up to a running call's first."""
    rng = random.Random(seed)
    L, E, S, Q = 3, 6, 5, rng.choice([3, 6])
    cache = SlotCache(L, E, Q, device=device, policy=policy, pool=S)
    reads, stamp, now = [0] * L, [[0] * E for _ in range(L)], L - 1
    count = [[0] * E for _ in range(L)]
    ranks = [[rng.randrange(3) for _ in range(E)] for _ in range(L)]
    pins = [dict() for _ in range(L)]
    planner, held, evictions = False, (-1, set()), 0
    for step in range(1200):
        l = rng.randrange(L)
        op = rng.random()
        if op < 0.35:
            e = rng.randrange(E)
            if cache.slot_of(l, e) is not None:
                continue
            protect = set(rng.sample(range(E), rng.randrange(3)))
            own = len(cache.residents(l)) >= Q
            cands = []
            for m in ([l] if own else range(L)):  # at its quota a layer evicts its own
                order = cache.recency(m)
                for pos, x in enumerate(order):
                    if not cache.is_ready(m, x) or x in pins[m] or (m == l and x in protect):
                        continue
                    if m == held[0] and m != l and x in held[1]:
                        continue
                    far = (m - now - 1) % L + L * (reads[m] - stamp[m][x])
                    ahead = m > (held[0] if planner else -1)  # a planner: layers a running call passed go first
                    cands.append(((ahead, ranks[m][x] if planner else 0, count[m][x] if policy == "lfu" else 0, -far,
                                   pos), (m, x)))
            free = min(S - cache.used_slots, Q - len(cache.residents(l)))
            want = None if free > 0 or not cands else min(cands)[1]
            slot = cache.reserve(l, e, protect=protect)
            if free <= 0 and not cands:
                assert slot is None
                continue
            assert slot is not None
            if want is not None:
                assert cache.slot_of(*want) is None, (step, want)
                evictions += 1
            stamp[l][e] = reads[l]
        elif op < 0.55:
            loading = [x for x in cache.residents(l) if not cache.is_ready(l, x)]
            if loading:
                x = rng.choice(loading)
                if x in pins[l] or rng.random() < 0.85:
                    cache.mark_ready(l, x)
                else:
                    cache.cancel(l, x)
        elif op < 0.75:
            experts = [rng.randrange(E) for _ in range(rng.randrange(0, 3))]
            cache.touch(l, experts)
            reads[l] += 1
            now = l
            if held[0] == l:
                held = (-1, set())
            for x in experts:
                count[l][x] += 1
                if cache.slot_of(l, x) is not None:
                    stamp[l][x] = reads[l]
        elif op < 0.80:
            x = rng.randrange(E)
            cache.demote(l, [x])
            count[l][x] = max(0, count[l][x] - 1)
            if cache.slot_of(l, x) is not None:
                stamp[l][x] = -(1 << 40)
        elif op < 0.85 and cache.residents(l):
            x = rng.choice(cache.residents(l))
            cache.pin(l, [x])
            pins[l][x] = pins[l].get(x, 0) + 1
        elif op < 0.90 and pins[l]:
            x = rng.choice(list(pins[l]))
            cache.unpin(l, [x])
            pins[l][x] -= 1
            if not pins[l][x]:
                del pins[l][x]
        elif op < 0.95:
            held = (l, set(rng.sample(range(E), 2)))
            cache.held = held
        else:
            planner = not planner
            cache.set_planner((lambda layer, x: ranks[layer][x]) if planner else None)
        cache.check()
    assert evictions > 10  # the sequence exercised eviction, not just free slots
