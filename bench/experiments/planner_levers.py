"""Where a speculative cycle's copies go, and what the planner's levers change, side by side.

    nice python bench/experiments/planner_levers.py [--workload diverse] [--prompts 12] [--max-new-tokens 64]
        [--temperature 0.7 --top-p 0.95 --top-k 50 | --greedy] [--k 10] [--residency 0.25] [--json out.json]

Policies, all on one loaded checkpoint, alternating per prompt so machine load hits all alike:
on-demand, spec-lru, specter (default planner), specter-nokeep (a verification wider than the
slots loads its late experts in id order, not lowest score first), oracle. (specter-guard, a
planner that evicted only residents the rest of the draft was unlikely to need, measured no
faster and was removed: docs/ARCHITECTURE.md.)
--k fixes every speculative policy's K (the governor off), which separates the planner from K.

Per speculative cycle (K >= 1) it counts, summed over layers: U, the experts verification used;
R&U, those already resident when the cycle began; min = U - R&U, the copies the cycle cannot avoid
given its start; the copies issued while drafting (prefetches) and while verifying; and "evicted
needed", residents the cycle began with that a prefetch evicted and verification then needed
(each is one copy more than min).
"""
from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict

import specter
from specter.workloads import WORKLOADS

VARIANTS = {"specter-nokeep": ("specter", {"keep": False})}


class CycleCopies:
    """Hooks one speculative engine's offload manager and decoder to count each cycle's copies."""

    def __init__(self, engine):
        dec, mgr = engine.decoder, engine.decoder.experts
        self.c: Counter = Counter()
        self.live = self.urgent = False
        issue, evict, hook, cycle = mgr._issue, mgr.slots._evict, mgr.use_hook, dec._cycle
        L = len(mgr.store)

        def counted_issue(layer, e, *, urgent, protect=()):
            self.urgent = urgent  # verification's copies are urgent, prefetches are not
            ok = issue(layer, e, urgent=urgent, protect=protect)
            if ok and self.live:
                self.c["copies_verify" if urgent else "copies_draft"] += 1
            return ok

        def counted_evict(layer, victim):
            if self.live and not self.urgent:
                self.evicted.append((layer, victim))
            return evict(layer, victim)

        def counted_use(layer, experts):
            if self.live:
                self.used[layer].update(experts)
            if hook is not None:
                hook(layer, experts)

        def counted_cycle(t, n, k, *args):
            self.live = k > 0
            self.start = [set(mgr.slots.residents(layer)) for layer in range(L)]
            self.used, self.evicted = [set() for _ in range(L)], []
            out = cycle(t, n, k, *args)
            if self.live:
                self._account(k, len(out))
            self.live = False
            return out

        mgr._issue, mgr.slots._evict, mgr.use_hook, dec._cycle = counted_issue, counted_evict, counted_use, counted_cycle

    def _account(self, k: int, tokens: int) -> None:
        c, U, R = self.c, self.used, self.start
        c["cycles"] += 1
        c["K"] += k
        c["tokens"] += tokens
        c["U"] += sum(len(u) for u in U)
        c["R&U"] += sum(len(u & r) for u, r in zip(U, R))
        c["min"] += sum(len(u - r) for u, r in zip(U, R))
        c["evicted needed"] += sum(1 for layer, e in self.evicted if e in U[layer] and e in R[layer])

    def summary(self) -> dict:
        c, n = self.c, max(self.c["cycles"], 1)
        out = {key: c[key] / n for key in ("K", "tokens", "U", "R&U", "min", "copies_draft", "copies_verify",
                                            "evicted needed")}
        out["copies/token"] = (c["copies_draft"] + c["copies_verify"]) / max(c["tokens"], 1)
        out["cycles"] = c["cycles"]
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="on-demand,spec-lru,specter,specter-nokeep,oracle")
    ap.add_argument("--workload", default="diverse", choices=sorted(WORKLOADS))
    ap.add_argument("--prompts", type=int, default=12, help="the first N prompts of the workload")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--residency", type=float, default=0.25)
    ap.add_argument("--k", type=int, default=None, help="fixed K for every speculative policy (default: governed)")
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sampling = (dict(temperature=0.0) if args.greedy else
                dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=0))
    prompts = list(WORKLOADS[args.workload])[:args.prompts]

    engines, accounts, shared = {}, {}, None
    try:
        for name in args.policies.split(","):
            policy, opts = VARIANTS.get(name, (name, {}))
            e = engines[name] = specter.load(None, policy=policy, residency=args.residency, shared=shared)
            shared = e.shared
            if opts.get("keep") is False:
                e.decoder.experts.keep_rank = None
            if hasattr(e.decoder, "governor"):
                if args.k is not None:
                    e.decoder.governor.fixed = args.k
                accounts[name] = CycleCopies(e)
        for e in engines.values():  # first-call costs out of the measurement
            e.generate(prompts[0], max_new_tokens=4, **sampling)
        for a in accounts.values():
            a.c.clear()
        tot = defaultdict(Counter)
        k_hist = defaultdict(Counter)
        for prompt in prompts:
            for name, e in engines.items():
                st = e.generate(prompt, max_new_tokens=args.max_new_tokens, **sampling).stats
                n = st["new_tokens"] - 1
                tot[name].update(s=st["tpot_s"] * n, n=n, bytes=st["h2d_bytes"], draft=st["draft_s"],
                                 stall=st["stall_s"])
                k_hist[name].update({int(k): v for k, v in st["k_histogram"].items()})
    finally:
        for e in engines.values():
            e.close()

    base = tot["on-demand"]["s"] / tot["on-demand"]["n"] if "on-demand" in tot else None
    res = {}
    for name, t in tot.items():
        tpot, kh = t["s"] / t["n"], k_hist[name]
        r = res[name] = dict(tpot_ms=tpot * 1e3, mb_per_token=t["bytes"] / t["n"] / 1e6, draft_share=t["draft"] / t["s"],
                             stall_share=t["stall"] / t["s"])
        if base:
            r["speedup_vs_on-demand"] = base / tpot
        if kh:
            r["k_mean"] = sum(k * v for k, v in kh.items()) / sum(kh.values())
            r["k0_share"] = kh[0] / sum(kh.values())
        if name in accounts:
            r["per_cycle"] = accounts[name].summary()
        line = "  ".join(f"{k} {v:.3f}" for k, v in r.items() if k != "per_cycle")
        print(f"{name:<15} {line}")
    print("per speculative cycle (summed over layers):")
    for name in accounts:
        print(f"{name:<15} " + "  ".join(f"{k} {v:.2f}" for k, v in res[name]["per_cycle"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), results=res), f, indent=1)


if __name__ == "__main__":
    main()
