"""Non-speculative prefetch policies layered on the offload manager."""
from __future__ import annotations

import time
from collections import Counter

import torch

from .manager import OffloadedExperts


class NextLayerPrefetch:
    """`next-layer`, the prefetching baseline of MoE-Infinity and Pre-gated MoE (and the
    mixtral-offloading idea): while layer l's experts compute, apply layer l+1's router to layer l's
    MoE input and copy the experts it picks ahead of need. The guess is cheap (one router matmul)
    and often right, because the residual stream changes little between layers.

    A right guess saves its copy's head start (how long the copy ran before layer l+1 asked for the
    expert); a wrong one that has started costs the misses queued behind it the rest of its copy, and
    the resident it evicted. So (the rule in README's Policies table):
    - a guess queues behind layer l's own misses (the manager calls this once they are issued);
    - it takes a free slot, or evicts only a resident colder than itself: a resident at recency
      position j of its layer's use history (0 = used by the latest call) is protected when hot(j),
      the measured chance that the expert there is used by the next call, is at least p, the
      measured share of this layer's guesses (copied or not) that it used;
    - it is copied only while p h > (1 - p) (s - h + s q): h the mean head start of a guess when its
      layer read its routing (in copies; 0 for a copy not started), s the share of guesses started
      by then, q the hottest victim's hot(j) (0 for a free slot);
    - when layer l+1 reads its routing (`settle`), a guess it does not need is withdrawn if its copy
      has not started (the expert it displaced is back, untouched), else put first in line for
      eviction, so a wrong guess never outlives the step that made it.
    p and hot(j) are decayed counts over every call of the layer, guessed or not (routing only);
    h and s are measured on the guesses copied, against the link's nominal copy time."""

    admission = True  # False: every guess is copied, hot residents and cost unchecked (tests that need copies in flight)

    def __init__(self, model, mgr: OffloadedExperts, decay: float = 0.95):
        self.blocks = [layer.mlp for layer in model.model.layers if layer.is_moe]
        self.mgr, self.decay = mgr, decay
        L, self.depth = len(self.blocks), min(2 * mgr.slots.n_slots, mgr.slots.n_experts)
        self.used: list[list[int]] = [[] for _ in range(L)]  # per layer, experts its calls used, most recent first
        self.hits = [[0.0] * self.depth for _ in range(L)]   # per layer, per recency position j: decayed uses
        self.tries = [[0.0] * self.depth for _ in range(L)]  #   and calls while an expert was there
        self.good, self.made = [0.5] * L, [1.0] * L  # per layer: decayed predictions used / made (prior 1/2)
        self.head, self.started, self.timed = 0.5, 0.5, 1.0  # decayed head start and starts per guess (prior)
        self.calls, self.remeasure = [0] * L, 16       # calls per layer; the router runs at least every 16th
        self.predicted: dict[int, list[int]] = {}    # layer -> predicted experts not resident, not yet settled
        self.guessed: dict[int, list] = {}           # layer -> [(expert, transfer)] copied, not yet settled

    def precision(self, layer: int) -> float:
        """p: the share of this layer's predicted non-resident experts its calls used."""
        return self.good[layer] / self.made[layer]

    def hot(self, layer: int, position: int) -> float:
        """hot(j): the chance that the expert at recency position j (0 = the most recently used by
        the layer's calls) is used by its next call (0 before any call, and past 2 x slots)."""
        t = self.tries[layer][position] if position < self.depth else 0.0
        return self.hits[layer][position] / t if t else 0.0

    def heat(self, layer: int, e: int) -> float:
        """hot(j) at expert e's recency position (0 if the layer's calls never used it)."""
        used = self.used[layer]
        return self.hot(layer, used.index(e)) if e in used else 0.0

    def pays(self, p: float, q: float) -> bool:
        """Whether a guess of precision p over a victim of hotness q gains more than it costs."""
        h, s = self.head / self.timed, self.started / self.timed
        return p * h > (1.0 - p) * (s - h + s * q)

    def __call__(self, layer: int, x: torch.Tensor) -> None:
        nxt = layer + 1
        if nxt >= len(self.blocks):
            return
        self.predicted.pop(nxt, None)
        self.calls[nxt] += 1
        mgr, slots = self.mgr, self.mgr.slots
        p, skip = self.good[nxt] / self.made[nxt], self.admission and self.calls[nxt] % self.remeasure  # p: precision
        if skip and self.pays(p, 0.0):  # a guess pays over a free slot, or over a resident colder than p
            skip = slots.free_slots(nxt) <= 0
            for e in slots.recency(nxt) if skip else ():
                if self.heat(nxt, e) < p:
                    skip = False
                    break
        if skip:
            return  # no guess could be copied: skip the router, except every `remeasure` calls (to keep p)
        ids, _ = self.blocks[nxt].route(x)                   # [T, k]
        want, new, where = [], [], slots.slot[nxt]
        for e, _ in Counter(ids.reshape(-1).tolist()).most_common():  # most demanded first
            want.append(e)
            if where[e] < 0:  # neither resident nor in flight
                new.append(e)
        self.predicted[nxt] = new
        if not new:
            return
        protect = set(want)
        if self.admission:
            q, evicts = 0.0, slots.free_slots(nxt) < len(new)  # q: the hottest resident a guess may evict
            for e in slots.recency(nxt):
                if e not in protect:
                    h = self.heat(nxt, e)
                    if h >= p:
                        protect.add(e)  # used by the next call more often than guesses are right: kept
                    elif evicts:
                        q = max(q, h)
            if not self.pays(p, q):
                return
        self.guessed[nxt] = self._copy(nxt, new, protect)

    def _copy(self, layer: int, experts: list[int], protect: set) -> list:
        """Prefetch `experts` in order, never evicting `protect` -> [(expert, transfer)] issued."""
        issued, out = self.mgr.prefetch(layer, experts, protect=protect), []
        for e in experts[:issued]:
            out.append((e, self.mgr.inflight[(layer, e)]))
        return out

    def settle(self, layer: int, need: list[int]) -> None:
        """Layer `layer` read its routing (`need`, before any copy for it): learn from it, and withdraw
        or demote the guesses it does not need."""
        mgr, d, used = self.mgr, self.decay, set(need)
        predicted, guesses = self.predicted.pop(layer, []), self.guessed.pop(layer, [])
        history, hits, tries = self.used[layer], self.hits[layer], self.tries[layer]
        for j, e in enumerate(history[:self.depth]):
            hits[j] = d * hits[j] + (e in used)
            tries[j] = d * tries[j] + 1.0
        older = []  # the experts used before, not by this call, most recent first
        for e in history:
            if e not in used:
                older.append(e)
        history[:] = sorted(used) + older
        for e in predicted:
            self.good[layer] = d * self.good[layer] + (e in used)
            self.made[layer] = d * self.made[layer] + 1.0
        if not guesses:
            return
        now, copy_s = time.perf_counter(), mgr.expert_bytes / mgr.link.bandwidth + mgr.link.latency
        for _, t in guesses:
            begun = t.t_started is not None and not t.cancelled()
            self.head = d * self.head + (min(1.0, (now - t.t_started) / copy_s) if begun else 0.0)
            self.started = d * self.started + begun
            self.timed = d * self.timed + 1.0
        wrong = []
        for e, _ in guesses:
            if e not in used:
                wrong.append(e)
        if wrong:
            mgr.withdraw(layer, wrong)
