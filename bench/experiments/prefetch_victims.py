"""The residents specter's prefetches evict, and how many of them the same cycle's verification then needs.

    python bench/experiments/prefetch_victims.py [--k 8] [--residency 0.25]

specter without its host lane (its CUDA default), K fixed, the default workload's prompts twice, greedy.
Every slot a prefetch takes while a cycle drafts is counted: a free one, or a victim of the same layer or of
another (the planner's `_admit` admits a prefetch only where the victim is unpredicted by the rows read so
far and scores below the incoming expert). A victim the cycle's verification then uses is one copy more:
the prefetch saved a miss and made one. By the victim's score and by the incoming expert's margin over it:
(bucket, victims, needed). Hooks engine internals (manager._issue, slots.reserve, the planner's cycle and
use hooks): expect to mend it when they change.
"""
from __future__ import annotations

import argparse
from collections import Counter

import specter
from specter.bench import DEFAULT_PROMPTS
from specter.speculative.governor import Governor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--residency", type=float, default=0.25)
    args = ap.parse_args()
    engine = specter.load(None, device="cpu", policy="specter", residency=args.residency, host_threads=0)
    engine.decoder.governor = Governor(engine.decoder.governor.k_max, fixed=args.k)
    mgr = engine.decoder.experts
    slots, planner = mgr.slots, mgr.keep_rank.__self__
    counts, victims, needed = Counter(), [], []
    live = {"urgent": False, "evicted": {}}

    issue = mgr._issue

    def issue_hook(layer, experts, *, urgent, protect=()):
        live["urgent"] = urgent
        try:
            return issue(layer, experts, urgent=urgent, protect=protect)
        finally:
            live["urgent"] = False

    reserve = slots.reserve

    def reserve_hook(layer, expert, *, protect=()):
        free = slots._free and len(slots._order[layer]) < slots.n_slots
        victim = None if free else slots.victim(layer, protect)
        got = reserve(layer, expert, protect=protect)
        if got is not None and not live["urgent"] and planner.k:  # a prefetch while a cycle drafts
            kind = "free" if victim is None else "same layer" if victim[0] == layer else "other layer"
            counts[f"prefetch into: {kind}"] += 1
            if victim is not None:
                score, incoming = planner.scores.value(*victim), planner.scores.value(layer, expert)
                live["evicted"][victim] = (kind, score, incoming - score)
                victims.append(live["evicted"][victim])
        return got

    begin = planner.begin_cycle

    def begin_hook(k=0, draft_step_s=0.0):
        live["evicted"] = {}
        return begin(k, draft_step_s)

    use = mgr.use_hook

    def use_hook(layer, experts):
        if planner.read_upto:  # a drafted cycle's verification
            for e in experts:
                if (record := live["evicted"].pop((layer, e), None)) is not None:
                    counts[f"victim needed: {record[0]}"] += 1
                    needed.append(record)
        return use(layer, experts)

    mgr._issue, slots.reserve, planner.begin_cycle, mgr.use_hook = issue_hook, reserve_hook, begin_hook, use_hook
    try:
        for _ in range(2):
            for prompt in DEFAULT_PROMPTS:
                engine.generate(prompt, max_new_tokens=64, temperature=0.0)
    finally:
        engine.close()
    print(f"K={args.k}, residency {args.residency}:", dict(sorted(counts.items())))
    for i, name in ((1, "victim's score"), (2, "incoming's margin over it")):
        total, hit = Counter(round(r[i]) for r in victims), Counter(round(r[i]) for r in needed)
        print(f"by {name}:", [(b, total[b], hit[b]) for b in sorted(total)])


if __name__ == "__main__":
    main()
