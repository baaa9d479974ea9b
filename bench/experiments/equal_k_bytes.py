"""spec-lru against specter without its host lane (specter's CUDA default) at the same fixed K: bytes copied,
misses and hits, so that the planner's prefetches are judged apart from the governor's choice of K.

    python bench/experiments/equal_k_bytes.py [--ks gov,4,8,16] [--residency 0.25] [--repeat 2]

Both engines share one loaded checkpoint and decode the default workload's prompts greedily, alternating
prompt by prompt; at a fixed K their tokens and so their expert uses are the same, and what differs is
where each expert comes from (resident, prefetched while drafting, or copied when verification misses it).
`gov`: each engine's own governor. One line a K: TPOT (machine-dependent) and the counts (not).
"""
from __future__ import annotations

import argparse
import statistics

import specter
from specter.bench import DEFAULT_PROMPTS, load_once
from specter.speculative.governor import Governor

POLICIES = ("spec-lru", "specter")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="gov,4,8,16", help="K values to fix, comma-separated; gov: the governor's")
    ap.add_argument("--residency", type=float, default=0.25)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    shared = load_once(None, device="cpu")
    engines = {p: specter.load(None, device="cpu", policy=p, residency=args.residency, shared=shared,
                               host_threads=0 if p == "specter" else None) for p in POLICIES}
    governors = {p: e.decoder.governor for p, e in engines.items()}
    for k in args.ks.split(","):
        tpot, count = {p: [] for p in POLICIES}, {p: [0] * 5 for p in POLICIES}
        for _ in range(args.repeat):
            for prompt in DEFAULT_PROMPTS:
                for p, e in engines.items():
                    e.decoder.governor = governors[p] if k == "gov" else Governor(governors[p].k_max, fixed=int(k))
                    st = e.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=0.0).stats
                    tpot[p].append(st["tpot_s"])
                    for i, key in enumerate(("h2d_bytes", "expert_misses", "expert_hits", "prefetch_issued", "cycles")):
                        count[p][i] += st.get(key) or 0
        cells = [f"K={k}"]
        for p in POLICIES:
            mb, misses, hits, prefetched, cycles = count[p]
            cells.append(f"{p}: TPOT {statistics.mean(tpot[p]) * 1e3:.2f} ms, {mb / 1e6:.0f} MB, misses {misses}, "
                         f"hits {hits}, prefetched {prefetched}, cycles {cycles}")
        print(" | ".join(cells), flush=True)
    for e in engines.values():
        e.close()


if __name__ == "__main__":
    main()
