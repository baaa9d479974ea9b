"""The governor after the draft stops agreeing (a collapse), with and without a change detector tried on
2026-12-06 and not landed (docs/RESULTS.md, "The governor after a collapse"): 300 cycles of a world whose
draft is accepted at 0.95, then 60 at 0.0 or 0.4 (time over plain decoding's), and tests/test_governor.py's
steady worlds (realised rate over the best fixed K's, 600 cycles). No timing, no engine.

    python bench/experiments/governor_collapse.py [--seeds 10]
"""
from __future__ import annotations

import argparse
import pathlib
import random
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))
from test_governor import PAYS, RESIDENT_PAYS, SLOWER, World, drive, geometric, realised  # noqa: E402

from specter.speculative.governor import Governor  # noqa: E402


class Detector(Governor):
    """A run of n cycles of K >= 2 that accepted nothing, (1 - a)^n < alarm for a the acceptance at position 1
    before the run: every count (per position and pooled) x forget."""

    def __init__(self, *a, alarm: float = 0.01, forget: float = 0.1, **kw):
        super().__init__(*a, **kw)
        self.alarm, self.forget, self.misses, self.before = alarm, forget, 0, 0.0

    def observe_cycle(self, k, accepted, draft_s, verify_s, stall_s, verified=None, copied=None, steps=1, dear=None):
        if k > 0 and self.misses == 0:
            self.before = self.hits[1] / self.tries[1] if self.tries[1] else 0.0
        super().observe_cycle(k, accepted, draft_s, verify_s, stall_s, verified, copied, steps, dear)
        kk = k if verified is None else verified
        if k == 0:
            return
        if kk >= 2 and accepted == 0:
            self.misses += 1
        elif accepted > 0:
            self.misses = 0
        if self.misses and (1 - self.before) ** self.misses < self.alarm:
            f = self.forget
            self.hits, self.tries = [h * f for h in self.hits], [t * f for t in self.tries]
            self.seen = [int(n * f) for n in self.seen]
            self.pool_hits, self.pool_tries = self.pool_hits * f, self.pool_tries * f
            self._worth, self._bounds, self.misses = {}, {}, 0


def world(alpha: float) -> World:
    return World(plain=40e-3, draft=3e-3, verify=lambda k: 9e-3 + 0.5e-3 * (k + 1), stall=lambda k: 25e-3 + 10e-3 * k,
                 accepted=geometric(alpha))


def main(seeds: int) -> None:
    steady = {"PAYS": PAYS, "RESIDENT_PAYS": RESIDENT_PAYS, "SLOWER": SLOWER}
    for name, make in (("as landed", lambda: Governor(32)), ("with the detector", lambda: Detector(32))):
        row = []
        for after in (0.0, 0.4):
            t = 0.0
            for seed in range(seeds):
                g = make()
                drive(g, world(0.95), 300, seed=seed)
                d = drive(g, world(after), 60, seed=seed + 10)
                t += sum(x[3] for x in d) / (sum(x[2] for x in d) * 40e-3)
            row.append(f"collapse to {after}: {t / seeds:.3f}")
        for wname, w in steady.items():
            r = sum(realised(drive(make(), w, 600, seed=seed)) for seed in range(seeds)) / seeds
            best = max(w.tokens_per_s(k, random.Random(0)) for k in range(0, 17))
            row.append(f"{wname}: {r / best:.3f}")
        print(f"{name:<18} " + " | ".join(row), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=10)
    main(ap.parse_args().seeds)
