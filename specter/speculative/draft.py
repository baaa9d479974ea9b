"""The draft: its INT4 experts, the lookahead buffer its routers fill, and the planner that turns
that lookahead into expert copies while the draft runs; and the one-layer lookahead without a draft,
next-layer's guesses (NextLayerPrefetch: the next layer's router on this layer's input).

## Draft experts
The same model with only its routed experts in INT4 (group size 128, optimum-quanto's
quantizer, packed by `specter.triton_ops.pack_int4`). Everything else -- attention, norms, routers,
shared experts, embeddings, lm_head and the committed KV cache -- is the target's own, so the draft
costs only its packed experts.

`unpacked` dequantises once into the compute dtype, `packed` keeps the codes and dequantizes at use
(CUDA's kernels tile by tile; CPU's torch backend an expert at a time, to the unpacked values): either
way the draft computes with the quantised weights (why and when each: docs/ARCHITECTURE.md).

## Lookahead buffer
What the draft's routers chose, one row per drafted token: a static device tensor (graph safe: fixed
address, written in place) the planner reads back with one device-to-host copy per chunk, never one
per token. The sync-free draft (compiled/draft_step.py) instead `publish`es each row as it is written
(a non-blocking copy into a host mirror, pinned on CUDA, and an event): the host reads a row once its
event has fired and never waits on the draft (`ready` / `read_host`).

## Prefetch planner
At each chunk boundary it reads the new lookahead rows, adds them to the cycle's demand per (layer, expert)
and, earliest layer first, copies the predicted experts neither resident nor in flight, most demanded first,
at most a layer's slots of them, evicting only experts this cycle does not predict. A chunk is
clamp(max(round(d / c), f), 1, K) drafted tokens, d the draft step time, c the copy time of the experts one
drafted token newly needs (moving averages; c from the link's measured busy time per transfer): a slow link
plans after every step, a fast one saves reads; f, where copies coalesce (small experts: prefetch_batch > 1),
the tokens whose new experts fill one transfer a layer (uniform 1/4: docs/RESULTS.md, 2026-12-03).
Eviction follows the lookahead too: each expert keeps a score, its predicted demand (+1 a drafted token) plus
its verified use (+3 a verification or plain step), decayed by 0.8 every cycle (a cycle at its start, a plain
step or prefill at its layer's use); the slot cache evicts the lowest score first (least recently used among
equals), and a prediction is admitted only if it outscores its victim (the constants' measurement:
docs/ARCHITECTURE.md). A verification needing more experts in a layer than it has slots loads its copies
lowest score first, leaving the highest scored resident (`keep`).
"""
from __future__ import annotations

import math
import time
from collections import Counter

import torch

from specter.triton_ops import Int4Experts, fused_moe, pack_int4

from ..moe import ExpertWeights
from ..offload.manager import OffloadedExperts
from .scores import Scores

# On CPU the draft is dequantised (one GEMV an expert) while that costs at most this much memory, and
# stays packed above it (a quarter of the bf16 experts instead of twice them; the cost: docs/ARCHITECTURE.md)
DENSE_MAX_BYTES = 256 << 20


def keep_packed(device, n_weights: int, dtype: torch.dtype) -> bool:
    """Whether a draft of `n_weights` routed-expert weights stays packed INT4 on `device`: always on CUDA
    (the kernels dequantize tile by tile); on CPU once dequantising would take more than DENSE_MAX_BYTES."""
    return torch.device(device).type == "cuda" or n_weights * dtype.itemsize > DENSE_MAX_BYTES


def _dequantized(q: Int4Experts, dtype) -> torch.Tensor:
    """q.dequantize().to(dtype), one expert at a time: no layer-sized fp32 temporaries beside it."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)  # [E, N, K]
    for e in range(q.n_experts):
        out[e] = q[e].dequantize()[0]
    return out


class DraftExperts:
    """Expert provider of the draft. While `row` is set it records each MoE layer's routing into
    the lookahead buffer; that record is the whole point of drafting with the real routers."""

    def __init__(self, experts: list, lookahead: Lookahead, device, dtype, packed: bool = False):
        """experts: per MoE layer, the host full-precision ExpertWeights (quantised here, layer by layer
        on the device), or its (w13, w2) Int4Experts with fp32 scales (the draft cache's)."""
        self.lookahead, self.row, self.packed = lookahead, None, packed
        self.fused_moe = fused_moe  # or GraphedRows.fused_moe (triton_ops/graphed.py): the same output
        self.q13, self.q2 = [], []  # list[Int4Experts] each
        self.layers: list[ExpertWeights] = []
        for ew in experts:
            if isinstance(ew, ExpertWeights):
                ew = (pack_int4(ew.w13.to(device), dtype=torch.float32), pack_int4(ew.w2.to(device), dtype=torch.float32))
            q13, q2 = (q.to(device) for q in ew)
            if packed:  # CUDA: scales in the compute dtype (rounded once from fp32), the kernels multiply in it
                sdt = dtype if torch.device(device).type == "cuda" else torch.float32
                self.q13.append(q13.to(device, sdt))
                self.q2.append(q2.to(device, sdt))
            else:       # dequantised in fp32, exactly quanto's values, then rounded once
                self.layers.append(ExpertWeights(_dequantized(q13, dtype), _dequantized(q2, dtype)))

    def __call__(self, layer: int, x, ids, weights):
        if self.row is not None:  # drafting: the router's choice [1, k] goes into lookahead row `row`
            la = self.lookahead
            la.ids[self.row, layer].copy_(ids[0])
            la.weights[self.row, layer].copy_(weights[0])
        if self.packed:  # INT4 dequantized tile by tile inside the kernels' K loops
            return self.fused_moe(x, ids, weights, self.q13[layer], self.q2[layer])
        ew = self.layers[layer]
        return self.fused_moe(x, ids, weights, ew.w13, ew.w2)


# ------------------------------------------------------------------------------- lookahead buffer
class Lookahead:
    """ids / weights [K_max, L, k]: row r, layer l holds the router's choice for drafted token r, written in
    place on the device by the draft's provider (DraftExperts; compiled/draft_step.py), read back by the planner
    (`PrefetchPlanner.plan`: one device-to-host read of the new rows, or `read_host` from the host mirror)."""

    def __init__(self, k_max: int, n_layers: int, top_k: int, device):
        self.ids = torch.full((k_max, n_layers, top_k), -1, dtype=torch.int32, device=device)  # [K_max, L, k]
        self.weights = torch.zeros((k_max, n_layers, top_k), dtype=torch.float32, device=device)
        self.k_max, self.n_layers = k_max, n_layers
        cuda = self.ids.is_cuda
        self.host = torch.full_like(self.ids, -1, device="cpu", pin_memory=cuda)  # [K_max, L, k]
        self._events: list = [None] * k_max  # CUDA: one per published row
        self._published = 0

    # ------------------------------------------------------------- sync-free publication
    def begin(self) -> None:
        self._published = 0

    def publish(self, row: int) -> None:
        """Start copying row `row` to the host mirror; never waits (CUDA: after the work queued so far)."""
        if self.ids.is_cuda:
            self.host[row].copy_(self.ids[row], non_blocking=True)
            ev = self._events[row] = self._events[row] or torch.cuda.Event()
            ev.record()
        else:
            self.host[row].copy_(self.ids[row])
        self._published = row + 1

    def ready(self) -> int:
        """How many published rows, from row 0, the host may read now (events queried, not waited on)."""
        n = 0
        while n < self._published and (self._events[n] is None or self._events[n].query()):
            n += 1
        return n

    def read_host(self, start: int, end: int) -> list[list[list[int]]]:
        """Published rows [start, end) from the host mirror (a host read, no device sync)."""
        if end <= start:
            return []
        return self.host.numpy()[start:end].tolist()


# -------------------------------------------------------------------------------- prefetch planner
class PrefetchPlanner:
    def __init__(self, mgr: OffloadedExperts, lookahead: Lookahead, decay: float = 0.8, use_weight: float = 3.0,
                 keep: bool = True):
        self.mgr, self.lookahead, self.decay, self.use_weight = mgr, lookahead, float(decay), use_weight
        E = mgr.slots.n_experts
        self.scores = Scores(lookahead.n_layers, E)  # decayed demand per (layer, expert): scores.py
        self.k = 0                 # this cycle's K: verification takes K + 1 rows
        mgr.slots.set_planner(self.rank)
        mgr.keep_rank = self.rank if keep else None  # a verification wider than the slots leaves the best resident
        mgr.use_hook = self.observe_use
        self.demand: list[Counter] = []
        self.rows, self.read_upto = [], 0  # this cycle's lookahead rows read so far ([row][layer][k]), how many
        self.new_per_token = 1.0   # EMA: experts one drafted token newly needs (not resident)
        self.cover_hits = self.cover_total = 0  # route coverage: verified uses the lookahead predicted
        self.reuse = [0.5] * lookahead.n_layers  # per layer, EMA: share of a plain step's experts the one before used
        self._last: list = [()] * lookahead.n_layers  # per layer, the experts the last plain step used
        self.prompt_tokens = 0     # a prompt of this many tokens is running (begin_prefill): no reuse measured

    def rank(self, layer: int, e: int) -> float:
        """The slot cache evicts the lowest rank first: by the scores while a cycle runs (begin_cycle to
        end_cycle: its predictions and verification, and keep_rank's verifications wider than the slots);
        outside one (plain steps, prefill) every resident ranks alike, so the cache's own order decides
        (the farthest next use), as in plain decoding: evicting by decayed use counts there made specter's
        plain steps slower than on-demand's at the same misses (docs/RESULTS.md)."""
        return self.scores.value(layer, e) if self.k else 0.0

    def _admit(self, layer: int, counts: Counter, tier=None) -> tuple[list[int], list[int]]:
        """(The predicted experts worth a copy into a slot, those for the coded tier alone.) Most demanded
        first and at most a layer's slots of them: each one not resident takes a free slot, else
        displaces a resident this cycle does not predict and whose score (decayed predicted + actual
        demand) is lower than its own. A prefetch that evicts something more likely to be needed costs
        two copies instead of saving one; one that evicts an expert this cycle predicts only swaps two
        copies. The others are skipped, or fetched into `tier` (the coded tier, _fill_tier's): they take
        no slot, and the verification decodes them instead of copying them."""
        slots, score = self.mgr.slots, self.scores.raw[layer]  # raw: ordered as the layer's scores
        free, others = slots.room(layer, counts)
        victims = sorted(map(score.__getitem__, others))  # scores of the residents a prefetch may displace
        where, out, coded = slots.slot[layer], [], []
        for i, (e, _) in enumerate(counts.most_common(None if tier is not None else slots.n_slots)):
            if where[e] >= 0:  # resident or in flight
                continue
            if i < slots.n_slots and free > 0:
                free -= 1
            elif i < slots.n_slots and victims and score[e] > victims[0]:
                victims.pop(0)
            else:
                if tier is not None and not tier.has(layer, e):
                    coded.append(e)
                continue
            out.append(e)
        return out, coded

    def _fill_tier(self):
        """The coded tier predicted experts with no slot are fetched into, if any: none beside a host lane,
        where such a miss may compute for less than its copy (docs/RESULTS.md)."""
        return self.mgr.tier if self.mgr.host_choice is None else None

    def observe_use(self, layer: int, experts) -> None:
        """Verification or a plain step used these: actual demand counts like predicted demand (and a
        plain step measures `reuse`, how much of it the step before used too). While a drafted
        cycle is being verified, also count how many of them the draft's routers predicted (route
        coverage: the draft's accuracy as a predictor, whatever the slot budget let us prefetch)."""
        scores = self.scores
        if not self.read_upto:  # a plain step or prefill: decay once a step, as begin_cycle does a cycle
            scores.decay(layer, self.decay)
            scores.add(layer, experts, self.use_weight)  # no prediction to cover
            if self.prompt_tokens:  # many tokens' union: not a step-to-step reuse (its last layer ends it)
                self.prompt_tokens *= layer < len(scores) - 1
            else:
                last, again = self._last[layer], 0
                for e in experts:
                    again += e in last
                self.reuse[layer] = 0.9 * self.reuse[layer] + 0.1 * again / max(1, len(experts))
            self._last[layer] = set(experts)
            return
        predicted = self.demand[layer]
        scores.add(layer, experts, self.use_weight)
        for e in experts:
            self.cover_hits += e in predicted
        self.cover_total += len(experts)

    def begin_prefill(self, tokens: int) -> None:
        """A prompt of `tokens` tokens is about to run as one call a layer: its scores decay as over
        that many plain steps (observe_use decays the last one), not one. The experts the earlier
        text used are no likelier to serve this prompt's tokens than any others, so neither a copy
        (LaneChoice) nor eviction may keep them on their old uses; the call does not measure step
        to step `reuse` either. The route coverage counts start over: they describe one generation."""
        self.scores.decay_all(self.decay ** max(0, tokens - 1))
        self.prompt_tokens = tokens
        self.cover_hits = self.cover_total = 0

    def end_cycle(self) -> None:
        """Verification is over: uses from now on (plain steps, prefill) are not predictions' to cover, and
        eviction is the cache's own (rank)."""
        self.read_upto = self.k = 0

    def reset_stats(self) -> None:
        self.cover_hits = self.cover_total = 0

    def begin_cycle(self, k: int = 0, draft_step_s: float = 0.0) -> int:
        """A cycle drafting K tokens begins -> how many draft steps to run between plans (the module docstring's
        chunk; draft_step_s: the governor's draft time a token)."""
        self.k, self.demand = k, [Counter() for _ in range(len(self.scores))]
        self.scores.decay_all(self.decay)
        self.rows, self.read_upto = [], 0
        copy_s, batch = self.new_per_token * self.mgr.link.copy_seconds(self.mgr.expert_bytes), self.mgr.prefetch_batch
        if draft_step_s >= k * copy_s:  # copy_s 0 or tiny (no new expert for thousands of cycles: the EMA
            return k                    # near 0, a quotient that would overflow): one read a cycle
        fill = math.ceil(batch * len(self.scores) / max(self.new_per_token, 1e-3)) if batch > 1 else 0
        return max(1, min(k, max(round(draft_step_s / copy_s), fill)))

    def plan(self, upto: int, host: bool = False) -> int:
        """Read lookahead rows [read_upto, upto) and issue what they newly predict. Returns copies issued.
        host=True: from the host mirror the sync-free draft publishes to (Lookahead.publish)."""
        start, la = self.read_upto, self.lookahead
        if upto <= start:
            return 0
        rows = la.read_host(start, upto) if host else la.ids[start:upto].cpu().tolist()  # [rows][layer][k]: one read
        self.rows += rows
        self.read_upto = upto
        for row in rows:
            for layer, ids in enumerate(row):
                self.demand[layer].update(ids)
                self.scores.add(layer, ids, 1.0)
        issued, tier = 0, self._fill_tier()
        for layer, counts in enumerate(self.demand):  # earliest layer first; every predicted expert is
            copy, coded = self._admit(layer, counts, tier)  # protected (no slot for one: the tier, if any)
            issued += self.mgr.prefetch(layer, copy, protect=counts, fill=tier is not None)
            if coded:
                issued += self.mgr.fill(layer, coded)
        self.new_per_token = 0.8 * self.new_per_token + 0.2 * (issued / len(rows))
        return issued


# ------------------------------------------------------------------------------- next-layer guesses
class NextLayerPrefetch:
    """`next-layer`, the prefetching baseline of MoE-Infinity and Pre-gated MoE, and the K = 0 arm's
    prefetch under specter: while layer l's experts compute, layer l+1's router, applied to layer l's
    MoE input, guesses its experts; the guesses are copied ahead of need where they pay (the rule and
    its measures p, h, s, q: README's Policies table). A guess queues behind layer l's own misses (the
    manager calls this once they are issued); it takes a free slot or evicts only a resident whose
    recency position j is used by the next call (hot(j)) less often than p, the share of this layer's
    guesses used; it is copied only while p h > (1 - p) (s - h + s q); when layer l+1 reads its routing
    (`settle`) a guess it does not need is withdrawn if its copy has not started, else evicted first.
    A layer whose last 16 calls read no expert that was not resident guesses only every 16th call."""

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
        self.missed = [0] * L                        # per layer, the last call that read an expert not resident
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

    def heats(self, layer: int) -> dict[int, float]:
        """hot(j) of each expert at recency position j of the layer's use history (absent: 0, as past 2 x slots)."""
        out, hits, tries = {}, self.hits[layer], self.tries[layer]
        for j, e in enumerate(self.used[layer][:self.depth]):
            out[e] = hits[j] / tries[j] if tries[j] else 0.0
        return out

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
        mgr, slots, heat = self.mgr, self.mgr.slots, None
        p, skip = self.good[nxt] / self.made[nxt], self.admission and self.calls[nxt] % self.remeasure  # p: precision
        if skip and self.calls[nxt] - self.missed[nxt] > self.remeasure:
            return  # its last `remeasure` calls missed nothing: no guess would have had a copy to save
        if skip and self.pays(p, 0.0):  # a guess pays over a free slot, or over a resident colder than p
            (free, residents), heat = slots.room(nxt, ()), self.heats(nxt)
            skip = free <= 0
            for e in residents if skip else ():
                if heat.get(e, 0.0) < p:
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
        if self.admission:  # q: the hottest resident a guess may evict (0: a free slot for each)
            (free, others), heat, q = slots.room(nxt, protect), self.heats(nxt) if heat is None else heat, 0.0
            for e in others:  # the residents it may displace, least recently used first
                h = heat.get(e, 0.0)
                if h >= p:
                    protect.add(e)  # used by the next call more often than guesses are right: kept
                elif free < len(new):
                    q = max(q, h)
            if not self.pays(p, q):
                return
        issued, guessed = mgr.prefetch(nxt, new, protect=protect), []  # in order, never evicting `protect`
        for e in new[:issued]:
            guessed.append((e, mgr.inflight[(nxt, e)]))
        self.guessed[nxt] = guessed

    def settle(self, layer: int, need: list[int]) -> None:
        """Layer `layer` read its routing (`need`, before any copy for it): learn from it, and withdraw
        or demote the guesses it does not need."""
        mgr, d, used = self.mgr, self.decay, set(need)
        predicted, guesses = self.predicted.pop(layer, []), self.guessed.pop(layer, [])
        history, hits, tries = self.used[layer], self.hits[layer], self.tries[layer]
        for j, e in enumerate(history[:self.depth]):
            hits[j] = d * hits[j] + (e in used)
            tries[j] = d * tries[j] + 1.0
        older, where = [], mgr.slots.slot[layer]  # the experts used before, not by this call, most recent first
        for e in history:
            if e not in used:
                older.append(e)
        history[:] = sorted(used) + older
        for e in need:  # a miss, or a guess (it was not resident when predicted) the call used
            if where[e] < 0 or e in predicted:
                self.missed[layer] = self.calls[layer]
                break
        for e in predicted:
            self.good[layer] = d * self.good[layer] + (e in used)
            self.made[layer] = d * self.made[layer] + 1.0
        if not guesses:
            return
        now, copy_s = time.perf_counter(), mgr.expert_bytes / mgr.link.bandwidth + mgr.link.latency
        for _, t in guesses:
            begun = t.t_started is not None  # a link withdraws only copies it has not started (Link.cancel)
            self.head = d * self.head + (min(1.0, (now - t.t_started) / copy_s) if begun else 0.0)
            self.started = d * self.started + begun
            self.timed = d * self.timed + 1.0
        wrong = []
        for e, _ in guesses:
            if e not in used:
                wrong.append(e)
        if wrong:
            mgr.withdraw(layer, wrong)
