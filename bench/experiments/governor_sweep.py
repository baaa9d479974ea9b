"""The governor over simulated worlds, many seeds: realised rate / plain decoding's, per generation length.

Worlds are tests/test_governor.py's `World`s (its SLOWER, PAYS, RESIDENT_PAYS) and a few more; each run
is a fresh Governor driven as the decoder drives it (`drive_runs`: K = 0 as runs of plain steps), times
jittered +-10%. `oracle` is the best fixed K of the world (K = 0 included). No timing, no engine.

    python bench/experiments/governor_sweep.py [--seeds 48] [--worlds w131,w110,slower]
"""
from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))
from test_governor import PAYS, RESIDENT_PAYS, SLOWER, World, drive_runs, geometric  # noqa: E402

from specter.speculative.governor import Governor  # noqa: E402

WORLDS = {
    # speculation worth ~1.31x (HC's lock-in world, test_probes_keep_coming_while_speculation_may_still_win)
    "w131": World(plain=0.125, draft=0.02, verify=lambda k: 0.2 + 0.01 * (k + 1), stall=lambda k: 0.05,
                  accepted=geometric(0.85)),
    # break-even: the best K is worth ~1.01x
    "w110": World(plain=0.125, draft=0.02, verify=lambda k: 0.24 + 0.01 * (k + 1), stall=lambda k: 0.06,
                  accepted=geometric(0.8)),
    "pays": PAYS, "slower": SLOWER,
    # a draft that agrees rarely, on a link slow enough that speculation still pays
    "disagree": World(plain=0.040, draft=3e-3, verify=lambda k: 9e-3 + 0.5e-3 * (k + 1),
                      stall=lambda k: 12e-3 + 0.5e-3 * k, accepted=geometric(0.3)),
    "slightly": World(plain=10e-3, draft=2e-3, verify=lambda k: 9e-3 + 0.5e-3 * (k + 1), stall=lambda k: 1e-3 * k,
                      accepted=geometric(0.6)),
    "resident": RESIDENT_PAYS,
}
RUNS = ((1, 16), (1, 64), (1, 256), (4, 64), (1, 3000))  # (generations of one engine, tokens each)


def oracle(world: World) -> float:
    rng = random.Random(0)
    return max(world.tokens_per_s(k, rng) for k in range(17)) * world.plain


def run(world: World, generations: int, tokens: int, seed: int, k_max: int = 16) -> float:
    """One engine's governor over `generations` generations: its rate / plain decoding's."""
    gov, resident = Governor(k_max), world is RESIDENT_PAYS
    if resident:
        gov.start_plain()
    toks = secs = 0.0
    for g in range(generations):
        for _, _, n, s in drive_runs(gov, world, tokens, seed=seed * 100 + g, copied=0 if resident else 1):
            toks, secs = toks + n, secs + s
    return toks / secs * world.plain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=48)
    ap.add_argument("--worlds", default=",".join(WORLDS))
    args = ap.parse_args()
    print(f"world     oracle | " + " | ".join(f"{g}x{t}: mean, p10, min" for g, t in RUNS))
    for name in args.worlds.split(","):
        world, row = WORLDS[name], []
        for gens, tokens in RUNS:
            r = sorted(run(world, gens, tokens, s) for s in range(args.seeds))
            row.append(f"{statistics.mean(r):5.3f} {r[len(r) // 10]:5.3f} {r[0]:5.3f}")
        print(f"{name:9s} {oracle(world):6.3f} | " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
