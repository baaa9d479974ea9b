"""Does a coded device tier pay when it holds only a few more experts than the raw slots it replaces?
The bundled model (bf16 store, compressed), one process, SPECTER_EXPERT_THROUGHPUT pinned: for budgets
of N fp32 slots, the engine as planned (tier where tier_split finds one) against the same budget with
no tier (SPECTER_CODED_TIER=0 at load), prompts alternated between the two, greedy tokens compared.

    python bench/experiments/tier_margin.py [--policy on-demand] [--slots 10,12,14,16,20] [--tokens 24]
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("SPECTER_EXPERT_THROUGHPUT", "2e9")

import specter  # noqa: E402
from specter.loader import open_checkpoint  # noqa: E402
from specter.workloads import workload_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="on-demand")
    ap.add_argument("--slots", default="10,12,14,16,20")
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    spec = open_checkpoint(specter.default_model_path()).spec
    slot = spec.expert_numel() * 4
    prompts = workload_prompts("default")
    print(f"{'slots':>5} {'raw':>4} {'tier experts':>12} {'TPOT tier ms':>12} {'TPOT none ms':>12} {'none/tier':>9} same")
    for n in map(int, args.slots.split(",")):
        engines = {}
        for name, env in (("tier", None), ("none", "0")):
            if env is None:
                os.environ.pop("SPECTER_CODED_TIER", None)
            else:
                os.environ["SPECTER_CODED_TIER"] = env
            engines[name] = specter.load(None, device="cpu", policy=args.policy, expert_memory=n * slot,
                                         compress_experts=True)
        os.environ.pop("SPECTER_CODED_TIER", None)
        spent, toks = {k: 0.0 for k in engines}, {k: [] for k in engines}
        try:
            for e in engines.values():  # warm-up
                e.generate(prompts[0], max_new_tokens=4, temperature=0.0)
            for p in prompts * 2:
                for name, e in engines.items():
                    t0 = time.perf_counter()
                    out = e.generate(p, max_new_tokens=args.tokens, temperature=0.0)
                    spent[name] += time.perf_counter() - t0 - out.stats["ttft_s"]
                    toks[name].append(out.token_ids)
            plan = engines["tier"].plan
            per = {k: spent[k] / (len(prompts) * 2 * (args.tokens - 1)) * 1e3 for k in spent}
            print(f"{n:>5} {plan.pool_slots:>4} {plan.tier_experts:>12} {per['tier']:>12.2f} {per['none']:>12.2f} "
                  f"{per['none'] / per['tier']:>9.3f} {toks['tier'] == toks['none']}")
        finally:
            for e in engines.values():
                e.close()


if __name__ == "__main__":
    main()
