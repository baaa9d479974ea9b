"""A drafting policy on the raw and on the coded store, cycle by cycle (issue 24): where each one's time goes.

    python bench/coded_specter.py [--model DIR] [--device cpu] [--expert-memory 144MiB | --residency R]
                                  [--policy specter] [--k K] [--raw-slots N] [--max-new-tokens 64]
                                  [--prompts N] [--prompts-file FILE] [--no-host-lane] [--no-fills]
                                  [--prefetch-batch N] [--json]

Builds the policy twice in one process (raw store, then compress_experts), as `specter bench
--compare-compressed` does, and runs the default workload greedily, alternating the two prompt by
prompt. Every governor decision is logged (each cycle's K, accepted tokens, draft + verify and stall
seconds; K = 0: a run of plain steps: `sequence`), every link transfer, tier decode and host-lane job
with its charged (emulated) seconds, and the engine's per-generation stats.

`--k K` pins every timed choice: the governor's K fixed (0: plain steps only), plain steps without
next-layer guesses and with the host lane (LaneChoice), and LaneChoice's seconds a copy the link's
charged (emulated) seconds, not its measured busy time. The counts (copies, host jobs, bytes) are
then a function of the weights and the routing, the same in every run on any load; the charged
seconds divided by the link's time scale (`*_profile_us_per_token`: the profile's GPU figures) too.
Without --k the governor chooses as in `specter bench`, by this machine's timing.
`--raw-slots N` (a probe of the tier for drafting policies): the coded engine's budget split into N
raw slots and a coded tier, instead of tier_split's choice. `--no-host-lane`: every miss copied (specter's
shape on CUDA without --host-threads), where the planner fetches predicted experts with no slot into the
tier (OffloadedExperts.fill); `--no-fills` turns that off. `--prefetch-batch N`: both engines' prefetches
and fills N experts a transfer (default: the manager's prefetch_batch, from the link's latency).
On CUDA the link's copies are real (no charged seconds; the profile columns are then None).
"""
from __future__ import annotations

import argparse
import json
import statistics

import specter
from specter.bench import read_prompts
from specter import builder
from specter.offload import plan
from specter.offload.manager import OffloadedExperts
from specter.offload.plan import tier_split
from specter.speculative.governor import Governor
from specter.workloads import workload_prompts


class Pinned:
    """A PlainArms that always picks `arm` and never probes (--k: no timed choice left in plain steps)."""

    def __init__(self, arm: bool):
        self.arm, self.probing, self.n, self.next, self.t = arm, False, 0, 1 << 30, {True: None, False: None}

    def pick(self) -> bool:
        return self.arm

    def observe(self, *a, **kw) -> None:
        pass


def charged_copy_seconds(link):
    """link.copy_seconds from the seconds the link charged its transfers (the emulated time, not the
    measured busy time, which grows where this machine's real copy outlasts it): load-independent."""
    done = {"bytes": 0, "s": 0.0}
    copy = link.copy

    def counted(dst, src, **kw):
        t = copy(dst, src, **kw)
        done["bytes"] += t.nbytes
        done["s"] += t.seconds or 0.0
        return t
    link.copy = counted

    def copy_seconds(nbytes: int) -> float:
        if done["s"]:
            return done["s"] * nbytes / done["bytes"]
        return nbytes / link.bandwidth + link.latency
    link.copy_seconds = copy_seconds


def instrument(eng, k: int | None) -> dict:
    """Log eng's governor cycles, link transfers and host jobs into the returned dict. `k`: fix the
    governor's K, run plain steps without next-layer guesses and with the host lane (LaneChoice), and
    charge LaneChoice's copies their emulated seconds (the pinned mode: no timed choice left)."""
    dec = eng.decoder
    mgr = dec.experts
    gov = getattr(dec, "governor", None)  # None: a plain decoder (on-demand), no cycles to log
    if k is not None and gov is not None:
        gov = dec.governor = Governor(gov.k_max, fixed=k)
        gov.plain_arms, gov.lane_arms = Pinned(False), Pinned(False)
        charged_copy_seconds(mgr.link)
    log = {"cycles": [], "copies": [], "host": [], "tier": []}
    if gov is not None:
        observe = gov.observe_cycle

        def logged_cycle(k, accepted, draft_s, verify_s, stall_s, verified=None, copied=None, steps=1):
            log["cycles"].append((k, accepted, draft_s, verify_s, stall_s, steps))
            return observe(k, accepted, draft_s, verify_s, stall_s, verified=verified, copied=copied, steps=steps)
        gov.observe_cycle = logged_cycle

    def wrap(lk, key):
        copy = lk.copy

        def logged(dst, src, **kw):
            t = copy(dst, src, **kw)
            log[key].append((t.nbytes, t.seconds, len(dst) // 2))
            return t
        lk.copy = logged
    wrap(mgr.link, "copies")
    if mgr.tier is not None:
        wrap(mgr.tier.link, "tier")
    lane = mgr.host_lane
    if lane is not None and lane.charge is not None:
        charge = lane.charge

        def logged_charge(job):
            s = charge(job)
            log["host"].append((len(job.experts), s))
            return s
        lane.charge = logged_charge
    log["scale"] = getattr(mgr.link, "time_scale", 1.0)
    return log


def _profile_us(entries, scale, tokens):
    """Charged seconds of the logged transfers or jobs (their [1]) in the profile's us a token; None
    where nothing was charged (CUDA: real copies)."""
    if any(e[1] is None for e in entries):
        return None
    return 1e6 * sum(e[1] for e in entries) / scale / tokens


def summary(log: dict, stats: list[dict], tokens: int, decode_s: float) -> dict:
    scale = log["scale"]
    plain = [c for c in log["cycles"] if c[0] == 0]
    spec = [c for c in log["cycles"] if c[0] > 0]
    plain_steps = sum(c[5] for c in plain)
    plain_s = sum((c[2] + c[3]) * c[5] for c in plain)
    spec_s = sum(c[2] + c[3] for c in spec)
    ks = {}
    for c in spec:
        ks[c[0]] = ks.get(c[0], 0) + 1
    tot = {k: sum(s.get(k, 0) for s in stats) for k in ("h2d_bytes", "host_experts", "expert_misses",
                                                        "expert_hits", "tier_hits", "prefetch_issued",
                                                        "prefetch_used", "host_stall_s", "stall_s")}
    return {
        "tokens": tokens, "tpot_ms": 1e3 * decode_s / max(1, tokens - len(stats)),
        "plain_steps": plain_steps, "plain_s": plain_s,
        "plain_step_ms_median": 1e3 * statistics.median([c[3] for c in plain]) if plain else None,
        "spec_cycles": len(spec), "spec_s": spec_s, "k_hist": dict(sorted(ks.items())),
        "accepted": sum(c[1] for c in spec), "drafted": sum(c[0] for c in spec),
        "spec_draft_s": sum(c[2] for c in spec), "spec_stall_s": sum(c[4] for c in spec),
        "tokens_per_spec_s": (sum(c[1] for c in spec) + len(spec)) / spec_s if spec_s else None,
        "tokens_per_plain_s": plain_steps / plain_s if plain_s else None,
        "transfers": len(log["copies"]), "experts_copied": sum(c[2] for c in log["copies"]),
        "link_profile_us_per_token": _profile_us(log["copies"], scale, tokens),
        "host_jobs": len(log["host"]), "host_experts_charged": sum(h[0] for h in log["host"]),
        "host_profile_us_per_token": _profile_us(log["host"], scale, tokens),
        "tier_decodes": len(log["tier"]), "tier_profile_us_per_token": _profile_us(log["tier"], scale, tokens),
        **tot,
        "h2d_bytes_per_token": tot["h2d_bytes"] / tokens,
        "sequence": [[c[0], c[1], round(c[2] + c[3], 4), round(c[4], 4), c[5]] for c in log["cycles"]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--policy", default="specter")
    ap.add_argument("--device", default="cpu")
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--expert-memory", default=None, help="default 144MiB (wide16's 1/4 residency)")
    budget.add_argument("--residency", type=float, default=None)
    ap.add_argument("--k", type=int, default=None, help="fix the governor's K (default: the governor chooses)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4, help="the first N prompts")
    ap.add_argument("--prompts-file", default=None, help="prompts as `specter bench --prompts` reads them "
                    "(default: the default workload)")
    ap.add_argument("--raw-slots", type=int, default=None,
                    help="the coded engine's raw slots (the rest of the budget its coded tier), not tier_split's")
    ap.add_argument("--no-host-lane", action="store_true", help="both engines copy every miss (as specter on "
                    "CUDA without --host-threads; on CPU it has a host lane)")
    ap.add_argument("--no-fills", action="store_true", help="predicted experts with no slot are not fetched "
                    "into the coded tier (OffloadedExperts.fill)")
    ap.add_argument("--prefetch-batch", type=int, default=None, help="experts a prefetch or fill transfer")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.no_host_lane:
        builder.uses_host_lane = lambda *args, **kw: False
    if a.no_fills:
        OffloadedExperts.fill = lambda self, layer, experts, urgent=False: 0
    prompts = (read_prompts(a.prompts_file) if a.prompts_file else workload_prompts("default"))[:a.prompts]
    budget = dict(residency=a.residency) if a.residency is not None else dict(expert_memory=a.expert_memory or "144MiB")
    kw = dict(device=a.device, policy=a.policy, **budget)
    logs, engines = {}, {}
    try:
        engines["raw"] = specter.load(a.model, **kw)
        if a.raw_slots is not None:
            plan.tier_split = lambda slots, *args, **kw: min(slots, a.raw_slots)
        try:
            engines["coded"] = specter.load(a.model, compress_experts=True, **kw)
        finally:
            plan.tier_split = tier_split
        for name, eng in engines.items():
            if a.prefetch_batch is not None:
                eng.decoder.experts.prefetch_batch = a.prefetch_batch
            eng.generate(prompts[0], max_new_tokens=4, temperature=0.0)  # the bench's warm-up
            logs[name] = instrument(eng, a.k)
        outs = {n: [] for n in engines}
        stats = {n: [] for n in engines}
        for p in prompts:
            for name, eng in engines.items():
                out = eng.generate(p, max_new_tokens=a.max_new_tokens, temperature=0.0)
                outs[name].append(out.token_ids)
                stats[name].append(dict(out.stats))
        res = {}
        for name in engines:
            st = stats[name]
            decode_s = sum(s["tpot_s"] * max(s["new_tokens"] - 1, 1) for s in st)
            res[name] = summary(logs[name], st, sum(len(o) for o in outs[name]), decode_s)
        res["same_tokens"] = outs["raw"] == outs["coded"]
        res["coded_vs_raw_tpot"] = res["raw"]["tpot_ms"] / res["coded"]["tpot_ms"]
        res["args"] = vars(a)
    finally:
        for eng in engines.values():
            eng.close()
    if a.json:
        print(json.dumps(res, indent=1))
        return
    for name in ("raw", "coded"):
        print(name, json.dumps({k: v for k, v in res[name].items() if k != "sequence"}))
    print("same tokens", res["same_tokens"], "coded/raw TPOT speed-up", round(res["coded_vs_raw_tpot"], 3))


if __name__ == "__main__":
    main()
