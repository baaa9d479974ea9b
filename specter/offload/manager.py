"""The offload manager: routed experts in a host store, one slot pool on the device shared by every
MoE layer, a slot cache deciding residency, and a link moving the bytes. It is an expert provider
(see moe.py), so the model runs on it exactly as on resident weights.

    store  [host]    ExpertWeights per MoE layer, pinned on CUDA
    pool   [device]  w13 [S, 2I, H], w2 [S, H, I], one pair for all layers; each layer's remap row
                     maps its expert ids into it (the per-layer pool: S = n_moe_layers x quota)
    slots            SlotCache: (layer, expert) -> slot; eviction ranks every layer's residents together
    link             EmulatedLink (CPU) | CudaLink: transfers are awaitables

A layer's call holds the experts it reads (SlotCache.held: no other layer's copy evicts them) and
computes its resident ones in one grouped call through its remap row (`triton_ops.expert_rows`);
missing ones are requested at the front of the link's queue (in one transfer, one fixed cost, where
the link coalesces) and compute in a second call as they land. Rows combine by (token, top-k
position): the bits of one call over resident weights, whatever was resident. The call reads its
routing on the host once and waits only for copies it needs still in flight (CUDA: a stream wait,
no host sync; CPU: the emulated link's sleep). `prefetch` is the hook of every smarter policy.

`alias=True` (CPU, big models: plan.alias_pool): the pool is meta tensors and compute reads a ready
expert's own store row; copies are timed, not made (docs/ARCHITECTURE.md, "aliases the store").
"""
from __future__ import annotations

from functools import partial

import torch

from specter.triton_ops import combine_rows, expert_rows, fused_moe, merge_rows

from ..moe import ExpertWeights
from .. import profiling
from ..profiling import NULL, span
from .link import Link, Transfer
from .slots import SlotCache
from .staging import staged_nbytes


class OffloadedExperts:
    def __init__(self, store: list[ExpertWeights], n_slots: int | None, device: torch.device, link: Link,
                 eviction: str = "lru", dtype: torch.dtype | None = None, alias: bool = False,
                 rows: list[ExpertWeights] | None = None, *, pool: int | None = None):
        """`n_slots`: the most experts one layer may hold (None: all); `pool`: the slots all layers share
        (default len(store) x n_slots: the per-layer pool). `dtype`: the pool's compute dtype (default
        the store's). `alias`: the pool is the store (CPU only), or `rows`, its copy in the compute dtype."""
        if alias and device.type != "cpu":
            raise ValueError(f"an aliased slot pool reads the host store: CPU only, not {device}")
        self.store, self.link, self.device, self.alias = store, link, device, alias
        L, E, w13, w2 = len(store), store[0].n_experts, store[0].w13, store[0].w2
        shapes = {(ew.n_experts, tuple(ew.w13.shape[1:]), tuple(ew.w2.shape[1:])) for ew in store}
        if len(shapes) > 1:  # one pool of one row shape: per-shape pools are not built yet
            raise ValueError(f"the shared expert pool needs routed experts of one shape in every layer; "
                             f"this model has {len(shapes)}: {sorted(shapes)}")
        if n_slots is None and pool is None:
            raise ValueError("give n_slots (a layer's quota), pool (the shared slots), or both")
        self.slots = SlotCache(L, E, E if n_slots is None else n_slots, device=device, policy=eviction,
                               alias=alias, pool=pool)
        S = self.slots.pool_slots
        dtype, at = dtype or w13.dtype, torch.device("meta") if alias else device
        shared = ExpertWeights(torch.zeros((S,) + w13.shape[1:], dtype=dtype, device=at),
                               torch.zeros((S,) + w2.shape[1:], dtype=dtype, device=at))
        self.pool = [shared] * L  # one [S, 2I, H] / [S, H, I] pair: every layer's remap row points into it
        self.rows = (rows or store) if alias else self.pool  # what compute reads through the remap
        self._late = torch.full((E,), -1, dtype=torch.int32, device=device)  # late experts' remap
        self.expert_bytes = store[0].expert_nbytes()  # a coded store's (offload/coded.py): its mean coded bytes
        self.host_expert_bytes = getattr(store[0], "raw_expert_nbytes", store[0].expert_nbytes)()  # a host lane's read
        self.inflight: dict[tuple[int, int], Transfer] = {}
        self.prefetched: set[tuple[int, int]] = set()   # copies issued ahead of need, not yet used
        self.filling: dict[tuple[int, int], Transfer] = {}  # prefetches landing in the tier alone (fill)
        self._fill_dst = [torch.empty(w.shape[1:], dtype=dtype or w.dtype, device="meta") for w in (w13, w2)]
        self.use_hook = None                            # use_hook(layer, experts) after each layer computes
        self.keep_rank = None                           # keep_rank(layer, e): late experts load lowest ranked first
        self.host_lane = None                           # both lanes (host_experts.LaneChoice): a HostLane, and
        self.host_choice = None                         # host_choice(layer, missing, routed) -> those computed there
        self.tier = None                                # a CodedTier (offload/coded_tier.py): coded on the device
        self.expert_rows = expert_rows                  # or a GraphedRows (triton_ops/graphed.py): the same rows,
        self.fused_moe = fused_moe                      # ... and its fused_moe (all resident: one call)
        self.all_resident = False                       # set by warm() when the budget holds everything
        self._in_order = False                          # ... and compute reads expert e from row e
        allocated = link.read_event()  # CUDA: copies into a slot wait for its last reader only (or its allocation)
        self._ordered = allocated is not None  # the link orders copies after reads (CUDA): note each read
        self.last_read: list = [allocated] * S  # per pool slot, the event after its last reader (None on CPU)
        link.prepare([t for ew in store for t in (ew.w13, ew.w2)], staged_nbytes([w13[0], w2[0]]))
        self.coalesce = link.coalesces  # a call's misses cross in one transfer (not through one-expert staging)
        # prefetches coalesce as many a transfer as a fixed cost's bytes hold (small experts: a copy is mostly
        # latency); larger ones go one each, so a miss never queues behind a long batch
        self.prefetch_batch = max(1, int(link.latency * link.bandwidth // self.expert_bytes)) if self.coalesce else 1
        self._routed: dict[int, tuple[list[int], int]] = {}  # layer -> (the last verification's routing [T * k], k)
        self.reset_stats()

    # ------------------------------------------------------------------------------- copies
    def _issue(self, layer: int, experts, *, urgent: bool, protect=()) -> int:
        """Reserve a slot for each of `experts`, in order, never evicting `protect`, and start their
        copies: the tier's members decode on the tier's own link, all in one transfer (offload/coded_tier.py);
        the others cross the link in one transfer when it coalesces (one fixed cost), else one each. Stops
        at the first expert no slot can be freed for; returns how many were issued."""
        batch, hits = [], []  # (expert, slot): over the link; decoded from the tier
        try:
            with span("copy issue") if profiling.ON else NULL:
                for e in experts:
                    slot = self.slots.reserve(layer, e, protect=protect)
                    if slot is None:
                        break
                    (hits if self.tier is not None and self.tier.has(layer, e) else batch).append((e, slot))
                self._start(layer, batch, hits, urgent)
        except BaseException:  # a copy that failed to issue (CUDA: out of memory for its staging), a Ctrl-C:
            self._free_unfed(layer, experts)  # no slot is left reserved with no copy coming
            raise
        return len(batch) + len(hits)

    def _start(self, layer: int, batch: list, hits: list, urgent: bool) -> None:
        """_issue's copies of the reserved (expert, slot)s: `hits` from the tier, `batch` over the link."""
        src, dst, tier = self.store[layer], self.pool[layer], self.tier
        if hits:  # one decode of them all (CUDA: one launch), after each slot's last reader
            t = tier.copy(layer, [e for e, _ in hits], [w for _, s in hits for w in (dst.w13[s], dst.w2[s])],
                          urgent=urgent, after=[self.last_read[s] for _, s in hits])
            for e, _ in hits:
                self.inflight[(layer, e)] = t
        step = max(1, len(batch)) if self.coalesce else 1
        for i in range(0, len(batch), step):
            keys, dsts, srcs, after = [], [], [], []
            for e, slot in batch[i:i + step]:
                keys.append(e)
                dsts += (dst.w13[slot], dst.w2[slot])
                srcs += (src.w13[e], src.w2[e]) if tier is None else tier.sources(layer, e)
                after.append(self.last_read[slot])  # CUDA: the slot's last reader, not all compute
            order = {"after": after[0] if len(after) == 1 else after} if self._ordered else {}  # CPU: none
            t = self.link.copy(dsts, srcs, urgent=urgent, tag=(layer, keys[0] if len(keys) == 1 else tuple(keys)),
                               **order)
            self._stats["h2d_bytes"] += t.nbytes  # a coded store's (offload/coded.py): its coded bytes
            for e in keys:
                self.inflight[(layer, e)] = t

    def _free_unfed(self, layer: int, experts) -> None:
        """Of `experts`, those left reserved (loading) with no copy in flight get their slots back: read
        through the remap row they would be zeros, and a loading slot is never evicted. Its old bytes may
        be gone, so the expert it held is not restored."""
        slots = self.slots
        for e in experts:
            if slots.slot[layer][e] >= 0 and not slots.is_ready(layer, e) and (layer, e) not in self.inflight:
                slots.cancel(layer, e)
                self.prefetched.discard((layer, e))

    def recover(self) -> None:
        """After an exception left a call part way (a Ctrl-C, an error issuing or landing a copy): every
        reservation with no copy coming is freed, and the call's hold on its experts ends."""
        for layer in range(self.slots.n_layers):
            self._free_unfed(layer, range(self.slots.n_experts))
        self.slots.held = (-1, ())

    def _land(self, layer: int, e: int) -> None:
        """Wait (if needed) for (layer, e)'s copy and mark it ready. The copy stays in `inflight` until it is
        marked: whatever stops a landing part way, a later _land or poll() finishes it."""
        t = self.inflight.get((layer, e))
        if t is not None:
            try:
                self._stats["stall_s"] += t.wait()
            except BaseException:
                if t.failed():  # its bytes never arrived: the slots are free again, a later need copies anew
                    for key in [k for k, other in self.inflight.items() if other is t]:  # a coalesced copy's others
                        del self.inflight[key]  # failed with it
                        self.slots.cancel(*key)
                        self.prefetched.discard(key)
                raise  # else the waiter went away (cancelled): the copy still lands, poll() marks it
            self.slots.mark_ready(layer, e)
            del self.inflight[(layer, e)]
            if self.tier is not None:  # a copy over the link leaves its coded bytes in the tier
                self.tier.landed(layer, e, t)
            if self._ordered:
                self._read_done(layer, [e])  # CUDA: compute now waits for the copy; a later one waits for that

    def poll(self) -> None:
        """Mark every completed copy ready (cheap; called between layers; nothing waits), and let the
        link issue what it holds (Link.pump: CudaLink's held prefetches)."""
        self.link.pump()
        done = []
        for key, t in self.inflight.items():
            if t.done():
                done.append(key)
        for layer, e in done:
            self._land(layer, e)
        if self.filling:
            self._land_fills()

    def prefetch(self, layer: int, experts, *, protect=(), urgent: bool = False, fill: bool = False) -> int:
        """Start copies for those of `experts` not resident or in flight, in the given order, never
        evicting `protect`, `prefetch_batch` a transfer. Where no slot can be freed it stops, or with
        `fill` and a coded tier the rest land in the tier alone (fill: the drafting planner's, whose
        predictions a verification reads). Returns how many were issued (the first of `experts` in
        slots, then any fills)."""
        where, todo, n, step = self.slots.slot[layer], [], 0, self.prefetch_batch
        for e in experts:
            if where[e] < 0 and e not in todo:  # not resident nor in flight
                todo.append(e)
        for i in range(0, len(todo), step):
            batch = todo[i:i + step]
            got = self._issue(layer, batch, urgent=urgent, protect=protect)
            self.prefetched.update((layer, e) for e in batch[:got])
            n += got
            if got < len(batch):
                break
        self._stats["prefetch_issued"] += n
        if fill and self.tier is not None and n < len(todo):
            n += self.fill(layer, todo[n:], urgent=urgent)
        return n

    def fill(self, layer: int, experts, *, urgent: bool = False) -> int:
        """Prefetches with no slot to land in, beside a coded tier: their coded bytes cross the link and
        stay in the tier (no slot, no decode: coded_tier.Fill), so that the need decodes them into a slot
        instead of copying them then. Residents, members and fills in flight are skipped. -> how many were
        issued."""
        tier, todo, where = self.tier, [], self.slots.slot[layer]
        for e in experts:
            if where[e] < 0 and not tier.has(layer, e) and (layer, e) not in self.filling:
                todo.append(e)
        step = self.prefetch_batch  # as prefetch's: a miss never queues behind a long batch
        for i in range(0, len(todo), step):
            batch = todo[i:i + step]
            srcs = [s for e in batch for s in tier.fill_sources(layer, e)]
            t = self.link.copy(self._fill_dst * len(batch), srcs, urgent=urgent, after=None,  # writes no slot
                               tag=(layer, batch[0] if len(batch) == 1 else tuple(batch)))
            self._stats["h2d_bytes"] += t.nbytes
            for e in batch:
                self.filling[(layer, e)] = t
                self.prefetched.add((layer, e))
        self._stats["prefetch_issued"] += len(todo)
        return len(todo)

    def _land_fills(self, layer: int | None = None, need=()) -> None:
        """Fills that have landed (and `layer`'s for the experts in `need`, waited for) join the tier."""
        for key, t in list(self.filling.items()):
            if key not in self.filling or not ((key[0] == layer and key[1] in need) or t.done()):
                continue
            carried = [k for k, other in self.filling.items() if other is t]  # a coalesced fill lands whole
            for k in carried:
                del self.filling[k]
            try:
                self._stats["stall_s"] += t.wait()
            except BaseException:
                if t.failed():  # its bytes never arrived: a later need copies anew
                    for k in carried:
                        self.tier.forget(*k)
                        self.prefetched.discard(k)
                    continue
                for k in carried:  # the waiter went away: the fill still lands, a later poll() takes it
                    self.filling[k] = t
                raise
            for k in carried:
                self.tier.landed(*k, t)

    def withdraw(self, layer: int, experts) -> int:
        """Prefetches of `layer` no longer wanted: each copy the link has not started is withdrawn
        (`_unissue`); one that has started lands first in line for eviction. Returns how many were withdrawn."""
        n, late, gone = 0, [], {(layer, e) for e in experts}
        for e in experts:
            if (w := self._unissue((layer, e), gone)):
                n += w
            elif self.slots.slot[layer][e] >= 0:
                late.append(e)
        if self.filling:
            n += self._unfill([key for key in gone if key in self.filling])
        self.slots.demote(layer, late)
        self._stats["prefetch_cancelled"] += n
        return n

    def cancel_prefetches(self) -> int:
        """Withdraw every prefetch copy the link has not started: called when the cycle they were issued
        for is over, so the steps after it do not queue behind its wrong guesses. Returns how many;
        on CUDA only those CudaLink still holds (its metered window): a copy on a stream cannot be
        withdrawn (Link.cancel)."""
        queued = {key for key in self.inflight if key in self.prefetched}
        n = sum(self._unissue(key, queued) for key in sorted(queued))
        n += self._unfill(list(self.filling))
        self._stats["prefetch_cancelled"] += n
        return n

    def _unfill(self, keys) -> int:
        """Withdraw the fills of `keys` the link has not started (a coalesced one goes whole). -> how many"""
        n = 0
        for key in keys:
            t = self.filling.get(key)
            if t is None or not self.link.cancel(t):
                continue
            self._stats["h2d_bytes"] -= t.nbytes  # never crossed the link
            for k in [k for k, other in self.filling.items() if other is t]:
                del self.filling[k]
                self.tier.forget(*k)
                self.prefetched.discard(k)
                n += 1
        return n

    def _unissue(self, key: tuple[int, int], gone=frozenset()) -> int:
        """Withdraw prefetch `key` if the link has not started its copy (reservations undone, what they evicted
        ready again in its untouched slot); a copy of several goes whole, its others in `gone` too. -> how many"""
        t = self.inflight.get(key)
        if key not in self.prefetched or t is None:
            return 0
        layer, carried = key[0], t.tag[1] if isinstance(t.tag[1], tuple) else (t.tag[1],)
        if any(self.slots.is_pinned(layer, e) for e in carried) or not self.link.cancel(t):
            return 0
        for e in reversed(carried):  # undone in the reverse order of their reservations
            del self.inflight[(layer, e)]
            self.slots.cancel(layer, e, restore=True)
        self._stats["h2d_bytes"] -= t.nbytes  # never crossed the link
        again = [e for e in carried if (layer, e) != key and (layer, e) not in gone]
        self.prefetched.difference_update((layer, e) for e in carried if e not in again)
        if again:  # still wanted: a copy of their own, at the back of the queue (no slot now: no prefetch)
            issued = self._issue(layer, again, urgent=False, protect=set(again))
            self.prefetched.difference_update((layer, e) for e in again[issued:])
        return len(carried) - len(again)

    def is_resident(self, layer: int, e: int) -> bool:
        return self.slots.slot[layer][e] >= 0

    # ------------------------------------------------------------------------------ compute
    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 guess=None) -> torch.Tensor:
        """The layer's routed experts, x [T, H] -> [T, H]. Waits only for a copy it needs that is still
        in flight (`Transfer.wait`: a stream wait on CUDA, no host sync; the emulated link's sleep on
        CPU). `guess`: the next-layer policy (speculative/draft.py): its guesses for this layer settle
        once the routing is known, and its guesses for the next layer go out behind this one's misses."""
        slots = self.slots
        if self.all_resident:  # the budget holds every expert: one call, no host read of the routing
            if ids.shape[0] == 1:  # one token: its top-k experts are distinct, so counted on the host
                self._stats["expert_hits"] += ids.shape[1]
            else:
                used = self._resident_hits.new_zeros(slots.n_experts).index_fill_(0, ids.reshape(-1), 1)
                self._resident_hits += used.sum()  # distinct experts, counted on the device
                self._hits_on_device = True
            pool = self.rows[layer]
            remap = None if self._in_order else slots.remap[layer]  # expert e in row e: no gather
            return self.fused_moe(x, ids, weights, pool.w13, pool.w2, remap=remap)
        pool = self.rows[layer]
        routed = ids.reshape(-1).tolist()  # [T * k] on the host: the layer's one read
        need = sorted(set(routed))
        slots.held = (layer, set(need))  # a shared pool: other layers' copies must not evict what this call reads
        if ids.shape[0] > 1:  # a verification: which rows needed what, for demote_rejected
            self._routed[layer] = (routed, ids.shape[1])
        if self.inflight:
            self.poll()
        if guess is not None:  # its guesses for this layer that the routing did not ask for go now
            guess.settle(layer, need)
        if self.filling:  # its experts' fills join the tier first (a miss among them is then a decode)
            self._land_fills(layer, need)
        ready, flying, missing = [], [], []
        st, prefetched, inflight, where = self._stats, self.prefetched, self.inflight, slots.slot[layer]
        for e in need:  # sort by state, and count hits, misses and prefetches used
            key = (layer, e)
            resident = where[e] >= 0  # ready, or loading (then its copy is in `inflight`)
            if key in prefetched:
                prefetched.discard(key)
                st["prefetch_used"] += resident or (self.tier is not None and self.tier.has(layer, e))  # (a fill)
            if not resident:
                st["expert_misses"] += 1
                missing.append(e)
                continue
            st["expert_hits"] += 1
            if key in inflight:
                flying.append(e)
            else:
                ready.append(e)
        if self.keep_rank is not None and len(need) > slots.n_slots:  # more than fit: choose who stays
            missing.sort(key=partial(self.keep_rank, layer))
        job = None
        if missing and self.host_choice is not None:  # both lanes: the misses it picks compute on the host
            tier = self.tier  # a miss held coded on the device is a decode, never the host lane's
            held = [] if tier is None else [e for e in missing if tier.has(layer, e)]
            hosted = self.host_choice(layer, [e for e in missing if e not in held] if held else missing, routed)
            if hosted:  # the host starts now, the device computes meanwhile; the rows merge at the end
                job = self.host_lane.submit(layer, x, ids, weights, hosted)
                st["host_experts"] += len(hosted)
                st["host_bytes"] += len(hosted) * self.host_expert_bytes
            rest = list(held)  # the misses left to copy, those held coded on the device first
            for e in missing:
                if e not in hosted and e not in held:
                    rest.append(e)
            missing = rest
        if missing:  # at the link's front, never evicting each other (more than the slots hold: the rest
            self._issue(layer, missing, urgent=True, protect=set(need))  # are fetched as others free theirs)
        if guess is not None:  # the next layer's guesses, queued behind this layer's misses
            guess(layer, x)
        if ready:  # every resident expert, in one call through the remap row (-1 rows left for later)
            rows = self.expert_rows(x, ids, weights, pool.w13, pool.w2, remap=slots.remap[layer])
            if self._ordered:  # queued: a copy into these slots now waits for this call
                self._read_done(layer, ready)
        else:
            rows = x.new_zeros(ids.shape + x.shape[1:])
        todo = flying + missing
        while todo:  # the late experts, in as few calls as the slots allow
            batch = self._land_batch(layer, todo)
            late, remap = self._late.fill_(-1), slots.remap[layer]  # the batch's entries of the layer's remap,
            for e in batch:                                          # copied on the device: no host-to-device sync
                late[e] = remap[e]
            rows = merge_rows(rows, self.expert_rows(x, ids, weights, pool.w13, pool.w2, remap=late), ids, late)
            if self._ordered:
                self._read_done(layer, batch)
            todo = todo[len(batch):]
        if job is not None:  # the host lane's rows, merged by (token, position) like late ones
            waited = job.wait()
            st["stall_s"] += waited
            st["host_stall_s"] += waited
            rows = merge_rows(rows, job.rows, ids, job.remap_device)
        slots.touch(layer, need)
        if self.tier is not None:
            self.tier.touch(layer, need)
        if self.use_hook is not None:
            self.use_hook(layer, need)
        return combine_rows(rows)

    def demote_rejected(self, kept_rows: int) -> None:
        """The last verification's rows from `kept_rows` on ran on rejected drafted tokens: the experts
        only they needed are demoted (SlotCache.demote), so the next misses evict them before the
        experts the accepted text used, not as the most recently used (docs/ARCHITECTURE.md)."""
        for layer, (routed, k) in self._routed.items():
            self.slots.demote(layer, set(routed[kept_rows * k:]).difference(routed[:kept_rows * k]))
        self._routed.clear()

    def _land_batch(self, layer: int, todo: list[int]) -> list[int]:
        """The longest prefix of `todo` that holds slots (issuing copies for those without, never
        evicting another of `todo`), landed. At least one expert: with no slot for the first, this
        layer's copies land first, then (a shared pool: other layers' prefetches may hold every slot)
        every copy, until one is freed."""
        protect, batch, where = set(todo), [], self.slots.slot[layer]
        for e in todo:
            if where[e] < 0 and not self._issue(layer, (e,), urgent=True, protect=protect):
                break
            batch.append(e)
        for mine in (True, False):
            if batch:
                break
            for key in [k for k in self.inflight if (k[0] == layer) == mine]:
                self._land(*key)
            if self._issue(layer, todo[:1], urgent=True, protect=protect):
                batch = todo[:1]
        if not batch:
            raise RuntimeError(f"no evictable slot for layer {layer}: every slot of the pool is pinned or in use")
        for e in batch:
            self._land(layer, e)
        return batch

    def _read_done(self, layer: int, experts) -> None:
        """Compute reading these experts' slots has been queued: note the point a copy must wait for."""
        ev = self.link.read_event()
        if ev is not None:
            slot = self.slots.slot[layer]
            for e in experts:
                self.last_read[slot[e]] = ev

    # -------------------------------------------------------------------------------- stats
    def _drain_stall_s(self) -> float:
        """CUDA: seconds compute waited on copies and on the tier's decodes (its own link), timed by events."""
        tier = self.tier.link if self.tier is not None and self.tier.link is not self.link else None
        return self.link.drain_stall_s() + (tier.drain_stall_s() if tier is not None else 0.0)

    def reset_stats(self) -> None:
        self._drain_stall_s()  # waits before now belong to no one
        self.prefetched.clear()
        self._resident_hits = torch.zeros((), dtype=torch.int64, device=self.device)  # read in stats()
        self._hits_on_device = False  # only then is there anything to read (a host sync on CUDA)
        if self.tier is not None:
            self.tier.reset_stats()
        self._stats = dict(expert_hits=0, expert_misses=0, h2d_bytes=0, stall_s=0.0, prefetch_issued=0,
                           prefetch_used=0, prefetch_cancelled=0, host_experts=0, host_bytes=0, host_stall_s=0.0)
        self._busy0 = self.host_lane.stats["busy_s"] if self.host_lane is not None else 0.0

    def stats(self) -> dict:
        self._stats["stall_s"] += self._drain_stall_s()
        if self._hits_on_device:
            self._stats["expert_hits"] += int(self._resident_hits)
            self._resident_hits.zero_()
            self._hits_on_device = False
        st = self._stats  # offloaded_bytes: expert bytes found off the device, copied or read on the host lane
        lane = {} if self.host_lane is None else dict(host_busy_s=self.host_lane.stats["busy_s"] - self._busy0,
                                                      host_threads=self.host_lane.threads)  # both lanes
        return dict(st, **(self.tier.stats if self.tier is not None else {}), **lane, h2d_path=self.link.h2d_path,
                    offloaded_bytes=st["h2d_bytes"] + st["host_bytes"],
                    time_scale=getattr(self.link, "time_scale", None))

    def reset(self) -> None:
        """Forget every resident expert (a cold cache)."""
        self.link.synchronize()
        if self.tier is not None:
            self.tier.link.synchronize()
        self.poll()
        self.slots.reset()
        if self.tier is not None:
            self.tier.reset()
        self.filling.clear()
        self.prefetched.clear()
        self._routed.clear()
        self.all_resident = False

    def warm(self) -> None:
        """Fill every slot with the first experts of each layer (a deterministic start): expert 0 of
        every layer, then expert 1, ..., up to each layer's quota, until the pool is full; then a coded
        tier with the next ones in the same order, each that fits. An emulated link makes
        these copies without charging their time (Link.untimed): a load is not what it emulates."""
        slots, L, tier = self.slots, len(self.store), self.tier
        with self.link.untimed():
            for e in range(slots.n_slots):
                for layer in range(L):
                    if slots.used_slots < slots.pool_slots:
                        self.prefetch(layer, [e])
            used = 0 if tier is None else tier.used
            for e in range(slots.n_experts if tier is not None else 0):  # (raw slots' experts: kept there)
                for layer in range(L):
                    if slots.slot[layer][e] < 0 and used + tier.cost[layer][e] <= tier.capacity:
                        used += tier.cost[layer][e] * self.fill(layer, [e])
        self.link.synchronize()
        self.poll()
        self._land_fills()
        self.prefetched.clear()
        self.all_resident = slots.pool_slots >= L * slots.n_experts
        self._in_order = self.all_resident and all(self.slots.row(layer, e) == e for layer in range(len(self.store))
                                                   for e in range(self.slots.n_experts))

    def close(self) -> None:
        if self.host_lane is not None:
            self.host_lane.close()
        if self.tier is not None:
            self.tier.close()
        self.link.close()

