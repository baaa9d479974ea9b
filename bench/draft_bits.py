"""Acceptance of the draft at 4, 3 and 2 bits on one model, with K fixed (so the figures measure the
draft, not the governor's timing-driven choice of K), greedy, over a built-in prompt set.

    python bench/draft_bits.py [--model DIR] [--workload default|diverse] [--k 4] [--max-new-tokens 64]

Prints one markdown row per width: alpha (acceptance_rate: accepted / (accepted + rejected)), drafted
tokens accepted a cycle, draft_efficiency (accepted / drafted), and whether every generation's
tokens equal the resident (plain) decoding's.
"""
from __future__ import annotations

import argparse

import specter
from specter.speculative.decoder import acceptance_stats
from specter.speculative.governor import Governor
from specter.workloads import workload_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--workload", default="default")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--residency", type=float, default=0.25)
    args = ap.parse_args()
    prompts = workload_prompts(args.workload)
    engine = specter.load(args.model, device="cpu", policy="resident")
    try:
        want = [engine.generate(p, max_new_tokens=args.max_new_tokens, temperature=0.0).token_ids for p in prompts]
    finally:
        engine.close()
    print(f"| bits | alpha | accepted a cycle (K = {args.k}) | draft efficiency | cycles | lossless |")
    print("|---|---|---|---|---|---|")
    for bits in (4, 3, 2):
        engine = specter.load(args.model, device="cpu", policy="specter", residency=args.residency, k_max=args.k,
                              draft_bits=bits)
        try:
            engine.decoder.governor = Governor(args.k, fixed=args.k)
            outs = [engine.generate(p, max_new_tokens=args.max_new_tokens, temperature=0.0) for p in prompts]
        finally:
            engine.close()
        tot = {k: sum(o.stats[k] for o in outs) for k in ("accepted_tokens", "drafted_tokens", "rejections")}
        cycles = sum(n for o in outs for k, n in o.stats["k_histogram"].items() if k > 0)
        st = acceptance_stats(tot["accepted_tokens"], tot["drafted_tokens"], tot["rejections"], cycles)
        same = [o.token_ids for o in outs] == want
        print(f"| {bits} | {st['acceptance_rate']:.3f} | {st['accepted_per_cycle']:.2f} | "
              f"{st['draft_efficiency']:.3f} | {cycles} | {same} |")


if __name__ == "__main__":
    main()
