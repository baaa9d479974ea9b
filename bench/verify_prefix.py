"""What verifying only the drafted tokens worth their copies (Governor.verify_k) buys, side by side:
the same policy twice, with and without the cut, plus on-demand for scale, alternating prompts in
one process so machine load hits all alike.

    nice python bench/verify_prefix.py [--residency 0.25] [--policy specter] [--prompts 8]
        [--max-new-tokens 64] [--temperature 1.0 --top-p 0.95]
"""
from __future__ import annotations

import argparse

import specter
from specter.workloads import DIVERSE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--residency", type=float, default=0.25)
    ap.add_argument("--policy", default="specter", choices=["specter", "spec-lru"])
    ap.add_argument("--prompts", type=int, default=8, help="the first N prompts of the diverse workload")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    args = ap.parse_args()
    sampling = dict(temperature=args.temperature, top_p=args.top_p, seed=0)
    engines = {"prefix": specter.load(None, policy=args.policy, residency=args.residency),
               "every drafted": specter.load(None, policy=args.policy, residency=args.residency),
               "on-demand": specter.load(None, policy="on-demand", residency=args.residency)}
    engines["every drafted"].decoder.truncate = False
    tot = {name: dict(s=0.0, n=0, bytes=0, cut=0, drafted=0) for name in engines}
    try:
        for e in engines.values():
            e.generate(DIVERSE[0], max_new_tokens=16, **sampling)
        for prompt in DIVERSE[:args.prompts]:
            for name, e in engines.items():
                st = e.generate(prompt, max_new_tokens=args.max_new_tokens, **sampling).stats
                t, n = tot[name], st["new_tokens"] - 1
                t["s"] += st["tpot_s"] * n
                t["n"] += n
                t["bytes"] += st["h2d_bytes"]
                t["cut"] += st["truncated_tokens"]
                t["drafted"] += st["drafted_tokens"]
    finally:
        for e in engines.values():
            e.close()
    for name, t in tot.items():
        print(f"{name:<14} TPOT {t['s'] / t['n'] * 1e3:7.2f} ms  {t['bytes'] / 1e6 / t['n']:5.2f} MB/token  "
              f"left unverified {t['cut']} of {t['drafted']} drafted")


if __name__ == "__main__":
    main()
