"""Withdrawing a cycle's leftover prefetches, measured side by side in one process: specter with and
without `decoder.cancel_leftovers`, against on-demand and spec-lru, on one matrix model.

    nice python bench/experiments/cancel_leftovers.py [--model top8] [--residency 0.5] [--rounds 12]

Rounds alternate the policies' order; a policy's TPOT is its median round (as governor_matrix.py).
Prints TPOT / on-demand's, MB a token, prefetches issued / used / withdrawn and the K histogram:
without the cancel, the copies a wrong draft leaves queued are billed to the plain steps after it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: governor_matrix
from governor_matrix import add_histogram, alternate, build, prompts_for  # noqa: E402

import specter  # noqa: E402

POLICIES = ("on-demand", "spec-lru", "specter", "specter-nocancel")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="top8", choices=("concentrated", "top8", "shared"))
    ap.add_argument("--residency", type=float, default=0.5)
    ap.add_argument("--link", default="A100-40GB-PCIe4")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args()
    sampling = dict(temperature=1.0, top_p=0.95, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / args.model
        build(args.model, path)
        engines = {p: specter.load(path, policy=p.removesuffix("-nocancel"), residency=args.residency, link=args.link)
                   for p in POLICIES}
        engines["specter-nocancel"].decoder.cancel_leftovers = False
        prompts = prompts_for(args.model, 2)
        tot = {p: dict(h2d_bytes=0, new_tokens=0, prefetch_issued=0, prefetch_used=0, prefetch_cancelled=0, k={})
               for p in POLICIES}

        def count(p: str, s: dict) -> None:
            for key in tot[p]:
                if key != "k":
                    tot[p][key] += s[key]
            add_histogram(tot[p]["k"], s["k_histogram"])

        try:
            rounds = alternate(engines, prompts, args.rounds, args.max_new_tokens, sampling, count)
        finally:
            for e in engines.values():
                e.close()
    base = statistics.median(rounds["on-demand"])
    for p in POLICIES:
        t, m = tot[p], statistics.median(rounds[p])
        spec = sum(v for k, v in t["k"].items() if k > 0)
        print(f"{p:17s} TPOT {m * 1e3:6.2f} ms  x{m / base:.3f} on-demand  {t['h2d_bytes'] / 1e6 / t['new_tokens']:.3f} MB/token  "
              f"prefetches {t['prefetch_issued']} used {t['prefetch_used']} withdrawn {t['prefetch_cancelled']}  "
              f"K>0 on {spec} of {sum(t['k'].values())} cycles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
