"""The prefetch planner: turns the draft's lookahead into expert copies while the draft runs.

At each chunk boundary it reads the new lookahead rows (one device-to-host read), adds them to the
cycle's demand per (layer, expert), and for every layer, earliest first, issues copies for the
predicted experts that are neither resident nor in flight, most demanded first. It evicts only
experts the lookahead does not predict (everything predicted this cycle is protected), and never
asks for more experts in a layer than that layer has slots.

Chunk size: a chunk should carry about as much copying as one draft step hides. With d the draft
step time and c the copy time of the experts one drafted token newly needs (moving averages;
c from the link's measured busy time per transfer),
chunk = clamp(round(d / c), 1, K): a slow link plans after every step so it never idles; a fast
one plans less often and saves the reads.

Eviction follows the lookahead too: each expert keeps a score, its predicted demand (+1 a
drafted token) plus its verified use (+3 a verification or plain step), decayed by 0.8 every cycle
(a speculative cycle at its start, a plain step or prefill at its layer's use); the slot
cache evicts the lowest score first (least recently used among equals), and a prediction is only
admitted if it outscores its victim (the constants' measurement: docs/ARCHITECTURE.md).

When a verification needs more experts in a layer than it has slots (a long cycle at a small
budget), the experts it must copy load lowest score first, so the ones left resident for the next
cycle are the highest scored (`keep`).
"""
from __future__ import annotations

from collections import Counter

from ..offload.manager import OffloadedExperts
from .draft import Lookahead


class PrefetchPlanner:
    def __init__(self, mgr: OffloadedExperts, lookahead: Lookahead, decay: float = 0.8, use_weight: float = 3.0,
                 keep: bool = True):
        self.mgr, self.lookahead, self.decay, self.use_weight = mgr, lookahead, decay, use_weight
        E = mgr.slots.n_experts
        self.score = [[0.0] * E for _ in range(lookahead.n_layers)]
        self.k = 0                 # this cycle's K: verification takes K + 1 rows
        mgr.slots.set_planner(self.rank)
        mgr.keep_rank = self.rank if keep else None  # a verification wider than the slots leaves the best resident
        mgr.use_hook = self.observe_use
        self.demand: list[Counter] = []
        self.rows: list = []       # this cycle's lookahead rows read so far: [row][layer][k]
        self.read_upto = 0
        self.new_per_token = 1.0   # EMA: experts one drafted token newly needs (not resident)
        self.cover_hits = self.cover_total = 0  # route coverage: verified uses the lookahead predicted
        self.reuse = [0.5] * lookahead.n_layers  # per layer, EMA: share of a plain step's experts the one before used
        self._last: list = [()] * lookahead.n_layers  # per layer, the experts the last plain step used

    def rank(self, layer: int, e: int) -> float:
        """The slot cache evicts the lowest rank first."""
        return self.score[layer][e]

    def _admit(self, layer: int, counts: Counter) -> list[int]:
        """The predicted experts worth a copy, most demanded first and at most a layer's slots of them:
        each one not resident takes a free slot, else displaces a resident this cycle does not predict
        and whose score (decayed predicted + actual demand) is lower than its own; the others are
        skipped. A prefetch that evicts something more likely to be needed costs two copies instead
        of saving one; one that evicts an expert this cycle predicts only swaps two copies."""
        slots, score = self.mgr.slots, self.score[layer]
        free, others = slots.room(layer, counts)
        victims = []  # scores of the residents a prefetch may displace, lowest first
        for e in others:
            victims.append(score[e])
        victims.sort()
        where, out = slots.slot[layer], []
        for e, _ in counts.most_common(slots.n_slots):
            if where[e] >= 0:  # resident or in flight
                continue
            if free > 0:
                free -= 1
            elif victims and score[e] > victims[0]:
                victims.pop(0)
            else:
                continue
            out.append(e)
        return out

    def observe_use(self, layer: int, experts) -> None:
        """Verification or a plain step used these: actual demand counts like predicted demand (and a
        plain step measures `reuse`, how much of it the step before used too). While a drafted
        cycle is being verified, also count how many of them the draft's routers predicted (route
        coverage: the draft's accuracy as a predictor, whatever the slot budget let us prefetch)."""
        row, w = self.score[layer], self.use_weight
        if not self.read_upto:  # a plain step or prefill: decay once a step, as begin_cycle does a cycle
            decay, last, again = self.decay, self._last[layer], 0
            for e in range(len(row)):
                row[e] *= decay
            for e in experts:
                again += e in last
            self.reuse[layer] = 0.9 * self.reuse[layer] + 0.1 * again / max(1, len(experts))
            self._last[layer] = set(experts)
        predicted = self.demand[layer] if self.read_upto else ()
        for e in experts:
            row[e] += w
            self.cover_hits += e in predicted
        if self.read_upto:
            self.cover_total += len(experts)

    def end_cycle(self) -> None:
        """Verification is over: uses from now on (plain steps, prefill) are not predictions' to cover."""
        self.read_upto = 0

    def reset_stats(self) -> None:
        self.cover_hits = self.cover_total = 0

    def begin_cycle(self, k: int = 0, draft_step_s: float = 0.0) -> int:
        """A cycle drafting K tokens begins -> how many draft steps to run between plans: about one
        step's time of copies at a time (draft_step_s: the governor's draft time a token)."""
        self.k, decay = k, self.decay
        self.demand = []
        for row in self.score:
            for e in range(len(row)):
                row[e] *= decay
            self.demand.append(Counter())
        self.rows = []
        self.read_upto = 0
        copy_s = self.new_per_token * self.mgr.link.copy_seconds(self.mgr.expert_bytes)
        return k if copy_s <= 0 else max(1, min(k, round(draft_step_s / copy_s)))

    def plan(self, upto: int, host: bool = False) -> int:
        """Read lookahead rows [read_upto, upto) and issue what they newly predict. Returns copies issued.
        host=True: from the host mirror the sync-free draft publishes to (Lookahead.publish)."""
        rows = (self.lookahead.read_host if host else self.lookahead.read)(self.read_upto, upto)
        if not rows:
            return 0
        self.rows += rows
        self.read_upto = upto
        for row in rows:
            for layer, ids in enumerate(row):
                self.demand[layer].update(ids)
                score = self.score[layer]
                for e in ids:
                    score[e] += 1.0
        issued = 0
        for layer, counts in enumerate(self.demand):  # earliest layer first; every predicted expert is
            issued += self.mgr.prefetch(layer, self._admit(layer, counts), protect=counts)  # protected
        self.new_per_token = 0.8 * self.new_per_token + 0.2 * (issued / len(rows))
        return issued
