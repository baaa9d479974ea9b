"""Two ranks' optimistic cycles on a virtual clock: the real OptimisticCycles (pipeline/optimistic.py)
and the real Governor, over stand-ins whose costs are injected (no model, no ranks, no timing noise),
to see which K the governor picks and what each K realises, seed by seed, without a quiet machine.

    python bench/pipeline_sim.py [--world quiet|draft-bound|slow-verify|low-accept] [--seeds 16] [--gens 4]
                                 [--fresh-share 0.5] [--ks 4,6,8,10,12]

A world: a draft step takes `draft` seconds on rank 0; rank 0's stage stage(K) for K + 1 rows; the later
stages later(K) + stall(K) from the STEP's departure to its result, plus a hand-off each way; a plain
step (K = 0, through every rank) `plain`; the draft's token at a position is wrong with probability
1 - accept (fixed per position and seed, so every policy sees the same text). "quiet" is fitted to
the bundled model's two ranks on the shared 2-core VM when quiet (docs/RESULTS.md, issue 26:
a draft step 2.3 ms, rank 1's verification 24-28 ms for K = 2-10, a plain step 16 ms,
acceptance 0.94). Each run: `--gens` generations of 64 tokens, one governor throughout, as the bench's
4 prompts (its 4-token warm-up aside). Prints ms a token for each K asked every cycle (a fresh draft
drafting its fresh_share of it) and for the adaptive governor (mean K run, plain steps by why they
ran, ms a token by generation).
"""
from __future__ import annotations

import argparse
import collections
import math
import random
import statistics
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specter.pipeline import optimistic  # noqa: E402
from specter.pipeline.standins import Step  # noqa: E402
from specter.sampling import SamplingParams  # noqa: E402
from specter.speculative.decoder import SpeculativeDecoder  # noqa: E402
from specter.speculative.governor import Governor  # noqa: E402

WORLDS = {  # draft, stage(K), later(K), stall(K), plain, accept; seconds
    "quiet": (2.3e-3, lambda k: 0.4e-3 * (k + 1), lambda k: 3e-3 + 0.6e-3 * (k + 1), lambda k: 17e-3 + 0.3e-3 * k,
              16e-3, 0.938),
    "draft-bound": (2.3e-3, lambda k: 0.4e-3 * (k + 1), lambda k: 1e-3 + 0.3e-3 * (k + 1), lambda k: 5e-3 + 0.2e-3 * k,
                    8e-3, 0.938),
    "slow-verify": (2.3e-3, lambda k: 0.4e-3 * (k + 1), lambda k: 5e-3 + 1e-3 * (k + 1), lambda k: 30e-3 + 0.5e-3 * k,
                    30e-3, 0.938),
    "low-accept": (2.3e-3, lambda k: 0.4e-3 * (k + 1), lambda k: 3e-3 + 0.6e-3 * (k + 1), lambda k: 17e-3 + 0.3e-3 * k,
                   16e-3, 0.8),
}
HAND, V = 0.25e-3, 64


class Clock:
    now = 0.0

    def perf_counter(self) -> float:
        return self.now


CLOCK = Clock()


def target(p: int) -> int:  # the target's token at position p
    return 1 + (p * 7) % 60


def onehot(tokens: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


class Sent:
    def __init__(self, T, start, arrives, later, stall):
        self.T, self.start, self.arrives, self.later, self.stall = T, start, arrives, later, stall


class StandIns:
    """The stage, model and experts OptimisticCycles reads, with the world's costs."""

    def __init__(self, world: tuple, seed: int):
        self.draft_s, self.stage_s, self.later_s, self.stall_s, self.plain_s, self.accept = world
        self.seed, self.wrong_at = seed, {}
        self.draft = types.SimpleNamespace(row=None)
        self.model = types.SimpleNamespace(spec=None)
        self.remote, self.stall, self.local, self.all_resident = [0.0] * 5, 0.0, None, False
        self.link = types.SimpleNamespace(pending=lambda: 0)

    def wrong(self, p: int) -> bool:  # the draft's token at position p is not the target's
        if p not in self.wrong_at:
            self.wrong_at[p] = random.Random(self.seed * 1_000_003 + p).random() > self.accept
        return self.wrong_at[p]

    def draft_forward(self, tokens, pos, logits_for="last"):
        CLOCK.now += self.draft_s
        return onehot([0 if self.wrong(pos + 1) else target(pos + 1)])

    def step(self, tokens, start, experts, logits_for="all"):
        s = self.stage_s(tokens.shape[0] - 1)
        CLOCK.now += s
        return Step(torch.zeros(tokens.shape[0], 1), start, 0, s)

    def send(self, step, post=False):
        k = step.T - 1
        later, stall = self.later_s(k) + self.stall_s(k), self.stall_s(k)
        return Sent(step.T, step.start, CLOCK.now + 2 * HAND + later, later, stall)

    def logits(self, sent):
        return onehot([target(sent.start + i + 1) for i in range(sent.T)]) if CLOCK.now >= sent.arrives else None

    def receive(self, sent):
        CLOCK.now = max(CLOCK.now, sent.arrives)
        self.remote[4] += sent.later
        self.stall += sent.stall
        return self.logits(sent)

    def stats(self):
        return dict(stall_s=self.stall, expert_hits=0, expert_misses=0)

    def demote_rejected(self, kept_rows):
        pass

    def cancel_prefetches(self):
        return 0


class Pipeline(optimistic.OptimisticCycles):
    """Rank 0's decoder: OptimisticCycles over StandIns, run as SpeculativeDecoder.run runs it."""
    cancel_leftovers = False
    _count_verification = SpeculativeDecoder._count_verification  # recall and acceptance, as the decoder counts them

    def __init__(self, world: tuple, governor: Governor, seed: int):
        fake = StandIns(world, seed)
        self.stage = self.model = self.experts = fake
        self.governor, self.stages, self.planner = governor, [types.SimpleNamespace(last=1)], None
        self.device, self.pre, self.k, self.need = torch.device("cpu"), None, 0, 0
        self._stats = dict(k_histogram=collections.Counter(), cycles=0, recall_hits=0, recall_total=0,
                           drafted_tokens=0, accepted_tokens=0, rejections=0, draft_s=0.0, verify_s=0.0)
        self.opt = optimistic.optimistic_stats()
        self.plain_why: collections.Counter = collections.Counter()

    def send_rows(self, upto: int) -> None:
        pass

    def generate(self, n: int, max_new: int) -> list[int]:
        """A generation of max_new tokens, its prompt's last token at n; -> the K run of each cycle (0: a plain step)."""
        self.drop_pre()
        self.need, t, made, gov, ks = n + max_new + 1, target(n), 1, self.governor, []
        while made < max_new:
            k = gov.next_k(max_new - made)
            if k == 0:
                self.drop_pre()
                steps = gov.steps
                why = "forced" if max_new - made == 1 else "probe" if gov.probe else f"arm {gov.arm or 'measured'}"
                self.plain_why[why] += steps
                CLOCK.now += steps * self.stage.plain_s
                gov.observe_cycle(0, 0, 0.0, self.stage.plain_s, 0.0, copied=1, steps=steps)
                n, made, ks = n + steps, made + steps, ks + [0] * steps
                t = target(n)
                continue
            self.k = k
            new = self._optimistic_cycle(t, n, k, None, SamplingParams(temperature=0.0))
            assert new == [target(n + 1 + i) for i in range(len(new))]  # the target's tokens, whatever was drafted
            n, made, t, ks = n + len(new), made + len(new), new[-1], ks + [self.k]
        self.drop_pre()
        return ks


class Pinned:
    """A governor that asks K every cycle but is not `fixed` (so a fresh draft drafts its fresh_share)."""
    fixed, draft_s, probe, arm, steps = None, None, False, "spec", 1

    def __init__(self, k: int):
        self.k = k

    def next_k(self, remaining: int) -> int:
        return min(self.k, remaining - 1)

    def observe_cycle(self, *a, **kw) -> None:
        pass


def run(world: tuple, seed: int, gens: int, pinned: int | None):
    """-> (ms a token by generation, K run by cycle, plain steps by why)."""
    sim = Pipeline(world, Governor(32) if pinned is None else Pinned(pinned), seed)
    per, ks = [], []
    for g in range(gens):
        t0 = CLOCK.now
        ks += sim.generate(1000 * (g + 1) + seed * 100_000, 64)
        per.append((CLOCK.now - t0) / 63 * 1e3)
    return per, ks, sim.plain_why


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", default="quiet", choices=sorted(WORLDS))
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--gens", type=int, default=4)
    ap.add_argument("--fresh-share", type=float, default=None, help="OptimisticCycles.fresh_share (default: its own)")
    ap.add_argument("--ks", default="4,6,8,10,12")
    a = ap.parse_args()
    optimistic.time = types.SimpleNamespace(perf_counter=CLOCK.perf_counter)  # the virtual clock
    optimistic.kv_rows = lambda *args: None  # rank 0's K/V: none here
    optimistic.put_kv_rows = lambda *args: None
    if a.fresh_share is not None:
        Pipeline.fresh_share = a.fresh_share
    world = WORLDS[a.world]
    print(f"world {a.world}, fresh_share {Pipeline.fresh_share}, {a.seeds} seeds x {a.gens} generations of 64 tokens")
    for k in [int(x) for x in a.ks.split(",")]:
        ms = [statistics.mean(run(world, s, a.gens, k)[0]) for s in range(a.seeds)]
        print(f"K = {k:2d} asked every cycle: {statistics.mean(ms):.2f} ms a token")
    runs = [run(world, s, a.gens, None) for s in range(a.seeds)]
    spec = [k for _, ks, _ in runs for k in ks if k]
    why = sum((w for _, _, w in runs), collections.Counter())
    by_gen = [statistics.mean(r[0][g] for r in runs) for g in range(a.gens)]
    print(f"adaptive: {statistics.mean(statistics.mean(r[0]) for r in runs):.2f} ms a token; mean K run "
          f"{statistics.mean(spec):.1f}; plain steps a run {sum(why.values()) / a.seeds:.1f} "
          f"({', '.join(f'{k} {v / a.seeds:.1f}' for k, v in sorted(why.items()))}); by generation "
          f"{', '.join(f'{x:.2f}' for x in by_gen)}")


if __name__ == "__main__":
    main()
