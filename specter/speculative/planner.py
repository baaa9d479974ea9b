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
drafted token) plus its verified use (+3 a verification), decayed by 0.8 every cycle; the slot
cache evicts the lowest score first (least recently used among equals), and a prediction is only
admitted if it outscores its victim. Measured on the default model (4 prompts x 64 tokens), these
constants beat decay 0.5 / use 1 by 7% TPOT at both 25% and 50% residency.

When a verification needs more experts in a layer than it has slots (a long cycle at a small
budget: 10-13 of 16 experts a layer for 4 slots on the bundled model), the experts it must copy
load lowest score first, so the ones left resident for the next cycle are the highest scored
(`keep`; measured: 3-5% fewer bytes a token, time level, bench/planner_levers.py).

`guard` (off by default) is Belady on the prediction: early in a draft most residents are not
predicted *yet*, though the rows still to come need them (85-90% of the residents a cycle starts
with are used by its verification at 25% residency). With a guard, a prefetch only evicts a
resident whose probability of being needed by the remaining rows, 1 - (1 - f)^(K + 1 - rows read)
with f its per-token routing frequency, is under `guard`, least likely first. It removes the
needless copies (each such eviction is one more copy, moved from the draft's shadow into
verification: bytes up, time level) but measured no faster under the governor, so it stays off.
"""
from __future__ import annotations

from collections import Counter

from ..offload.manager import OffloadedExperts
from .lookahead import Lookahead


class PrefetchPlanner:
    def __init__(self, mgr: OffloadedExperts, lookahead: Lookahead, decay: float = 0.8, use_weight: float = 3.0,
                 admission: bool = True, guard: float | None = None, freq_alpha: float = 0.05, keep: bool = True):
        self.mgr, self.lookahead, self.decay, self.use_weight = mgr, lookahead, decay, use_weight
        self.admission, self.guard, self.freq_alpha = admission, guard, freq_alpha
        E = mgr.slots.n_experts
        self.score = [[0.0] * E for _ in range(lookahead.n_layers)]
        # per-token routing frequency of each expert (EMA over drafted rows): how likely a token needs it
        self.freq = [[lookahead.ids.shape[-1] / E] * E for _ in range(lookahead.n_layers)]
        self.k = 0                 # this cycle's K: verification takes K + 1 rows
        mgr.slots.set_planner(self.rank)
        mgr.keep_rank = self.rank if keep else None  # a verification wider than the slots leaves the best resident
        mgr.use_hook = self.observe_use
        self.demand: list[Counter] = []
        self.rows: list = []       # this cycle's lookahead rows read so far: [row][layer][k]
        self.read_upto = 0
        self.new_per_token = 1.0   # EMA: experts one drafted token newly needs (not resident)
        self.cover_hits = self.cover_total = 0  # route coverage: verified uses the lookahead predicted

    def _admit(self, layer: int, ranked: list[int], predicted: set[int]) -> list[int]:
        """Predicted experts worth a copy: into a free slot, or displacing a resident that this
        cycle does not predict and whose score (decayed predicted + actual demand) is lower than
        theirs. A prefetch that evicts something more likely to be needed costs two copies instead
        of saving one; one that evicts an expert this cycle predicts only swaps two copies."""
        if not self.admission:
            return ranked
        score, slots = self.score[layer], self.mgr.slots
        if self.guard is not None:
            return self._admit_guarded(layer, ranked, predicted)
        victims = sorted(score[e] for e in slots.residents(layer) if e not in predicted)

        def displace(e: int) -> bool:
            if victims and score[e] > victims[0]:
                victims.pop(0)
                return True
            return False

        return self._take(layer, ranked, displace)

    def _take(self, layer: int, ranked: list[int], displace) -> list[int]:
        """The experts of `ranked` (best first) to copy: each one not resident takes a free slot while
        there is one, then a slot `displace(e)` gives up for it; the others are skipped."""
        slots = self.mgr.slots
        free, out = slots.free_slots(layer), []
        for e in ranked:
            if slots.slot_of(layer, e) is not None:
                continue
            if free > 0:
                free -= 1
            elif not displace(e):
                continue
            out.append(e)
        return out

    def rank(self, layer: int, e: int) -> float:
        """The slot cache evicts the lowest rank first."""
        if self.guard is None:
            return self.score[layer][e]
        return self.need_prob(layer, e) + 1e-3 * self.score[layer][e]

    def need_prob(self, layer: int, e: int) -> float:
        """Probability that verification needs `e` through the rows not read yet this cycle:
        1 - (1 - f_e)^(K + 1 - rows read), f_e the per-token routing frequency."""
        left = max(0, self.k + 1 - len(self.rows))
        return 1.0 - (1.0 - self.freq[layer][e]) ** left

    def _admit_guarded(self, layer: int, ranked: list[int], predicted: set[int]) -> list[int]:
        """Belady on the prediction: a resident this cycle has not predicted yet may still be needed by
        the rows not drafted yet. Evict the one least likely to be (the farthest expected next use),
        and only while that probability is under `guard`: evicting a needed resident for a needed
        prefetch costs one more copy and saves none."""
        slots = self.mgr.slots
        victims = sorted((self.need_prob(layer, e), e) for e in slots.residents(layer)
                         if e not in predicted and slots.is_ready(layer, e))

        def displace(e: int) -> bool:
            if victims and victims[0][0] < self.guard:
                victims.pop(0)
                return True
            return False

        return self._take(layer, ranked, displace)

    def observe_use(self, layer: int, experts) -> None:
        """Verification used these: actual demand counts like predicted demand. While a drafted
        cycle is being verified, also count how many of them the draft's routers predicted (route
        coverage: the draft's accuracy as a predictor, whatever the slot budget let us prefetch)."""
        row = self.score[layer]
        for e in experts:
            row[e] += self.use_weight
        if self.read_upto:
            predicted = self.demand[layer]
            self.cover_hits += sum(1 for e in experts if e in predicted)
            self.cover_total += len(experts)

    def end_cycle(self) -> None:
        """Verification is over: uses from now on (plain steps, prefill) are not predictions' to cover."""
        self.read_upto = 0

    def reset_stats(self) -> None:
        self.cover_hits = self.cover_total = 0

    def begin_cycle(self, k: int = 0) -> None:
        self.k = k
        for row in self.score:
            for e in range(len(row)):
                row[e] *= self.decay
        self.demand = [Counter() for _ in range(self.lookahead.n_layers)]
        self.rows = []
        self.read_upto = 0

    def chunk_size(self, draft_step_s: float, k: int) -> int:
        copy_s = self.new_per_token * copy_time(self.mgr)
        if copy_s <= 0:
            return k
        return max(1, min(k, round(draft_step_s / copy_s)))

    def plan(self, upto: int, host: bool = False) -> int:
        """Read lookahead rows [read_upto, upto) and issue what they newly predict. Returns copies issued.
        host=True: from the host mirror the sync-free draft publishes to (Lookahead.publish)."""
        rows = (self.lookahead.read_host if host else self.lookahead.read)(self.read_upto, upto)
        if not rows:
            return 0
        n_rows = len(rows)
        self.rows += rows
        self.read_upto = upto
        a = self.freq_alpha
        for row in rows:
            for layer, ids in enumerate(row):
                self.demand[layer].update(ids)
                f = self.freq[layer]
                for e in range(len(f)):
                    f[e] *= 1.0 - a
                for e in ids:
                    self.score[layer][e] += 1.0
                    f[e] += a
        issued = 0
        slots = self.mgr.slots.n_slots
        for layer, counts in enumerate(self.demand):  # earliest layer first
            ranked = [e for e, _ in counts.most_common(slots)]  # at most `slots` experts per layer
            predicted = set(counts)  # never evicted for a prefetch: verification needs each of them
            issued += self.mgr.prefetch(layer, self._admit(layer, ranked, predicted), protect=predicted)
        self.new_per_token = 0.8 * self.new_per_token + 0.2 * (issued / n_rows)
        return issued


def copy_time(mgr: OffloadedExperts) -> float:
    """Seconds one expert copy takes (Link.copy_seconds)."""
    return mgr.link.copy_seconds(mgr.expert_bytes)


def new_copies(rows: list, is_resident) -> list[int]:
    """Per lookahead row (row 0 is the pending token, row j drafted token j): the experts it needs that
    no earlier row needs and that are neither resident nor on their way -- the copies verifying it adds."""
    seen: set = set()
    out = []
    for row in rows:
        n = 0
        for layer, ids in enumerate(row):
            for e in ids:
                if e >= 0 and (layer, e) not in seen:
                    seen.add((layer, e))
                    n += not is_resident(layer, e)
        out.append(n)
    return out
