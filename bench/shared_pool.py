"""The shared expert pool against its per-layer rule, side by side in one run: for each budget and
policy, one engine with slot_pool="shared" and one with slot_pool="layer" (where the per-layer rule
has a plan: every layer at least top-k slots), prompts interleaved across all engines, greedy, every
generation's tokens checked against resident decoding.

    python bench/shared_pool.py [--model DIR] [--policies on-demand,specter] \
        [--budgets 2MiB,4.5MiB,9MiB] [--max-new-tokens 48] [--repeat 1] [--workload default]

Prints one markdown row per (budget, policy, pool): decode ms a token, speed-up over on-demand on the
same pool rule and budget, expert copies a token, MB over the link, and lossless.
"""
from __future__ import annotations

import argparse

import specter
from specter.errors import BudgetError
from specter.workloads import workload_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--policies", default="on-demand,specter")
    ap.add_argument("--budgets", default="2MiB,4.5MiB,9MiB")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--workload", default="default")
    args = ap.parse_args()
    prompts = workload_prompts(args.workload)
    policies = [p for p in args.policies.split(",") if p]
    ref = specter.load(args.model, device="cpu", policy="resident")
    shared = ref.shared
    want = {i: ref.generate(p, max_new_tokens=args.max_new_tokens, temperature=0.0).token_ids
            for i, p in enumerate(prompts)}
    engines = {}
    for budget in args.budgets.split(","):
        for policy in policies:
            for pool in ("shared", "open", "layer"):
                try:
                    engines[(budget, policy, pool)] = specter.load(args.model, device="cpu", policy=policy,
                                                                   expert_memory=budget, slot_pool=pool, shared=shared)
                except BudgetError as e:
                    print(f"<!-- {budget} {policy} {pool}: {e} -->")
    for e in engines.values():  # first-call costs out of the measurement
        e.generate(prompts[0], max_new_tokens=4, temperature=0.0)
    agg = {key: dict(decode_s=0.0, tokens=0, misses=0, h2d=0, lossless=True) for key in engines}
    for _ in range(args.repeat):
        for i, prompt in enumerate(prompts):
            for key, e in engines.items():
                out = e.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=0.0)
                s, a = out.stats, agg[key]
                n = max(s["new_tokens"] - 1, 1)
                a["decode_s"] += s["tpot_s"] * n
                a["tokens"] += n
                a["misses"] += s.get("expert_misses", 0)
                a["h2d"] += s.get("h2d_bytes", 0)
                a["lossless"] &= out.token_ids == want[i]
    print("| budget | policy | pool | slots | decode ms/token | vs on-demand (same pool) | copies/token | H2D MB | lossless |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (budget, policy, pool), a in agg.items():
        tpot = a["decode_s"] / a["tokens"]
        base = agg.get((budget, "on-demand", pool))
        speed = (base["decode_s"] / base["tokens"]) / tpot if base else float("nan")
        slots = engines[(budget, policy, pool)].plan.pool_slots
        print(f"| {budget} | {policy} | {pool} | {slots} | {1e3 * tpot:.2f} | {speed:.2f}x | "
              f"{a['misses'] / a['tokens']:.2f} | {a['h2d'] / 1e6:.1f} | {a['lossless']} |")
    for e in engines.values():
        e.close()
    ref.close()


if __name__ == "__main__":
    main()
