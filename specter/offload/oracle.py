"""`oracle` (bench only): the physical limit of prefetching at a given budget.

The target runs once with every expert resident to record its true routing; then the same
generation is replayed through the offload manager with perfect knowledge: as soon as layer l of
step s has computed, layer l's experts for step s+1 start copying, and eviction is Belady's
over the whole shared pool (the expert whose next use is farthest away goes first, whatever its
layer). Its TTFT includes the recording pass.
"""
from __future__ import annotations

import bisect
from typing import Iterator

from ..speculative.decoder import PlainDecoder
from ..moe import ResidentExperts
from .manager import OffloadedExperts


class _Recorder:
    def __init__(self, inner: ResidentExperts, trace: list):
        self.inner, self.trace = inner, trace

    def __call__(self, layer, x, ids, weights):
        if layer == 0:
            self.trace.append([])
        self.trace[-1].append(sorted(set(ids.reshape(-1).tolist())))
        return self.inner(layer, x, ids, weights)


class _Replay:
    """Expert provider over the manager that prefetches step s+1's layer l right after layer l of s.

    Positions in the read sequence are s x L + l (step s, MoE layer l). Eviction is Belady's over the
    whole pool: the resident whose next use comes last goes first, whatever its layer; and a prefetch
    is only issued into a free slot or over a victim whose next use comes after the prefetched one's
    (else it would cost a copy and save none)."""

    def __init__(self, mgr: OffloadedExperts, trace: list[list[list[int]]]):
        self.mgr, self.trace, self.step, self.layer = mgr, trace, 0, 0
        self.L = L = len(trace[0]) if trace else 0
        self.uses = [{} for _ in range(L)]  # layer -> expert -> steps it is used in (sorted)
        for s, layers in enumerate(trace):
            for layer, experts in enumerate(layers):
                for e in experts:
                    self.uses[layer].setdefault(e, []).append(s)
        mgr.slots.set_planner(self._rank, across_layers=True)

    def next_use(self, layer: int, e: int) -> float:
        """Position of (layer, e)'s next use after the read in progress (step, self.layer); inf if none."""
        steps = self.uses[layer].get(e, [])
        first = self.step if layer > self.layer else self.step + 1
        i = bisect.bisect_left(steps, first)
        return steps[i] * self.L + layer if i < len(steps) else float("inf")

    def _rank(self, layer: int, e: int) -> float:
        return -self.next_use(layer, e)  # farthest next use = lowest rank

    def _prefetch(self, layer: int, experts: list[int]) -> None:
        slots, protect, want = self.mgr.slots, set(experts), (self.step + 1) * self.L + layer
        for e in experts:
            if slots.slot_of(layer, e) is not None:
                continue
            if not slots.free_slots(layer):
                victim = slots.victim(layer, protect)
                if victim is None or self.next_use(*victim) <= want:
                    return
            self.mgr.prefetch(layer, [e], protect=protect)

    def __call__(self, layer, x, ids, weights):
        self.layer = layer
        out = self.mgr(layer, x, ids, weights)
        if self.step + 1 < len(self.trace):
            self._prefetch(layer, self.trace[self.step + 1][layer])
        if layer == len(self.uses) - 1:
            self.step += 1
        return out

    def stats(self):
        return self.mgr.stats()

    def reset_stats(self):
        self.mgr.reset_stats()


class OracleDecoder:
    def __init__(self, model, mgr: OffloadedExperts, resident: ResidentExperts, device, dtype):
        self.model, self.mgr, self.resident, self.device, self.dtype = model, mgr, resident, device, dtype

    @property
    def experts(self):
        return self.mgr

    def run(self, prompt, params, max_new) -> Iterator[list[int]]:
        trace: list = []
        recorded = list(PlainDecoder(self.model, _Recorder(self.resident, trace), self.device, self.dtype)
                        .run(prompt, params, max_new))
        replay = _Replay(self.mgr, trace)
        try:
            for chunk in PlainDecoder(self.model, replay, self.device, self.dtype).run(prompt, params, len(recorded)):
                yield chunk
        finally:
            self.mgr.slots.set_planner(None)

    def stats(self) -> dict:
        return self.mgr.stats()

    def reset_stats(self) -> None:
        self.mgr.reset_stats()

    def close(self) -> None:
        self.mgr.close()
