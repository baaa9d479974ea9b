"""CPU: `specter bench`'s policies with fused_moe's torch backend as some earlier revision had it
("before") and as now ("after"), alternated pair by pair in one process on one loaded checkpoint,
so a drifting machine hits both alike.

    git show <rev>:triton_ops/reference.py > /tmp/reference_before.py
    python bench/experiments/moe_backend_ab.py /tmp/reference_before.py [--pairs 5] [--policies resident,specter]

Per policy: the median of the per-pair ratios after/before of (a) this process's CPU time per
generated token (the engine runs on one thread here, and the simulated link's copy stalls are
sleeps, so this is the compute) and (b) the wall TPOT `specter bench` reports; plus whether both
give the very same greedy tokens. Default model, default workload, residency 0.25, 64 new tokens.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time

import specter
import specter.triton_ops.reference as after_ref
from specter.bench import load_once, read_prompts


def load_before(path: str):
    spec = importlib.util.spec_from_file_location("specter.triton_ops.reference_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", help="an earlier triton_ops/reference.py (git show REV:triton_ops/reference.py)")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--policies", default=",".join(specter.BENCH_POLICIES))
    a = ap.parse_args()
    fm = sys.modules["specter.triton_ops.fused_moe"]  # the module fused_moe's ops call moe_rows_torch from
    impl = {"before": load_before(a.before).moe_rows_torch, "after": after_ref.moe_rows_torch}
    policies = a.policies.split(",")
    shared = load_once(None)
    prompts = read_prompts(None)
    engines = {p: specter.load(None, policy=p, shared=shared, **({} if p == "resident" else {"residency": 0.25}))
               for p in policies}
    for e in engines.values():
        e.generate(prompts[0], max_new_tokens=4, temperature=0.0)
    cpu = {p: {"before": [], "after": []} for p in policies}
    tpot = {p: {"before": [], "after": []} for p in policies}
    tokens = {p: {} for p in policies}
    try:
        for i in range(a.pairs):
            for name in ("before", "after") if i % 2 == 0 else ("after", "before"):
                fm.moe_rows_torch = impl[name]
                for p, e in engines.items():
                    c = n = d = dn = 0
                    outs = []
                    for prompt in prompts:
                        t0 = time.thread_time()
                        out = e.generate(prompt, max_new_tokens=64, temperature=0.0)
                        c += time.thread_time() - t0
                        n += len(out.token_ids)
                        d += out.stats["tpot_s"] * max(out.stats["new_tokens"] - 1, 1)
                        dn += max(out.stats["new_tokens"] - 1, 1)
                        outs.append(out.token_ids)
                    cpu[p][name].append(c / n)
                    tpot[p][name].append(d / dn)
                    tokens[p].setdefault(name, outs)
                    tokens[p]["same"] = tokens[p].get("same", True) and outs == tokens[p][name]
    finally:
        fm.moe_rows_torch = after_ref.moe_rows_torch
        for e in engines.values():
            e.close()

    def ratios(d):
        return [x / y for x, y in zip(d["after"], d["before"])]

    print(f"{a.pairs} pairs; after/before per pair, median in brackets")
    print(f"{'policy':11s} {'CPU ms/token before':>20s} {'after':>6s}   CPU ratio{'':24s} wall-TPOT ratio")
    for p in policies:
        rc, rt = ratios(cpu[p]), ratios(tpot[p])
        print(f"{p:11s} {statistics.median(cpu[p]['before']) * 1e3:20.2f} {statistics.median(cpu[p]['after']) * 1e3:6.2f}   "
              f"{' '.join(f'{x:.2f}' for x in rc)} ({statistics.median(rc):.2f})   "
              f"{' '.join(f'{x:.2f}' for x in rt)} ({statistics.median(rt):.2f})")
    same = all(t["same"] and t["before"] == t["after"] for t in tokens.values())
    print("before and after give the same greedy tokens, every policy and pair:", same)


if __name__ == "__main__":
    main()
