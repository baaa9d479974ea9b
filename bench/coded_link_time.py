"""Modelled link time per token of a policy's copies and tier decodes, raw vs coded (issue 24).

    python bench/coded_link_time.py [--model DIR] [--policy on-demand] [--expert-memory 9MiB]
                                    [--max-new-tokens 64] [--link A100-40GB-PCIe4] [--json]

Runs the bench's default workload (greedy) through one engine without and one with compress_experts,
records every transfer on the PCIe link and on the tier's decode link with the MoE layer call that
issued it, and charges them in the profile's own figures (GPU seconds, not this machine's):

    raw copy     latency + bf16 bytes / pcie_bandwidth
    coded copy   latency + coded bytes / pcie_bandwidth + (coded + bf16 bytes) / device_memory_bandwidth
    tier decode  DECODE_LAUNCH_S + (coded + bf16 bytes) / device_memory_bandwidth

under two latency rules: "per copy" (what the emulated link charges: every transfer pays the latency;
the engine coalesces a layer call's misses into one transfer, so a logged transfer may carry several
experts) and "per layer call" (every transfer of a layer call, prefetches too, coalesced into one, one
latency, and its tier decodes into one launch: a bound). The counts
are exact for copy-only policies (on-demand's are the same every run); a drafting policy's depend on
the governor's timed choices, so its figures vary run to run.
"""
from __future__ import annotations

import argparse
import json

import specter
from specter.offload.calibrate import load_profile
from specter.offload.coded_tier import DECODE_LAUNCH_S
from specter.offload.manager import OffloadedExperts
from specter.workloads import workload_prompts


def _manager(engine) -> OffloadedExperts:
    d = engine.decoder
    for obj in [d, *vars(d).values()]:
        if isinstance(obj, OffloadedExperts):
            return obj
        mgr = getattr(obj, "mgr", None)
        if isinstance(mgr, OffloadedExperts):
            return mgr
    raise SystemExit("no offload manager in this engine")


def record(model, policy, expert_memory, max_new_tokens, link, compress):
    eng = specter.load(model, device="cpu", policy=policy, expert_memory=expert_memory, link=link,
                       compress_experts=compress)
    mgr = _manager(eng)
    prompts = workload_prompts("default")
    eng.generate(prompts[0], max_new_tokens=4, temperature=0.0)  # the bench's warm-up
    log, call = [], [0]  # call: layer calls completed so far, so a call's copies share one number
    touch = mgr.slots.touch

    def counted_touch(layer, experts):
        call[0] += 1
        return touch(layer, experts)

    def wrap(lk, kind):
        copy = lk.copy

        def logged(dst, src, **kw):
            coded = sum(s.nbytes for s in src)
            raw = sum(getattr(s, "raw_nbytes", s.nbytes) for s in src)
            log.append((kind, call[0], coded, raw))
            return copy(dst, src, **kw)
        lk.copy = logged

    mgr.slots.touch = counted_touch
    wrap(mgr.link, "link")
    if mgr.tier is not None:
        wrap(mgr.tier.link, "tier")
    tokens = hosted = 0
    for p in prompts:
        out = eng.generate(p, max_new_tokens=max_new_tokens, temperature=0.0)
        tokens += len(out.token_ids)
        hosted += out.stats.get("host_experts", 0)
    eng.close()
    return log, tokens, {"host_experts": hosted}


def charge(log, p, coalesce: bool) -> dict:
    link_s = tier_s = 0.0
    seen_link, seen_tier = set(), set()
    n = {"link": 0, "tier": 0}
    for kind, c, coded, raw in log:
        n[kind] += 1
        decode = (coded + raw) / p.device_memory_bandwidth if coded != raw else 0.0
        if kind == "link":
            fixed = p.latency if not coalesce or c not in seen_link else 0.0
            seen_link.add(c)
            link_s += fixed + coded / p.pcie_bandwidth + decode
        else:
            fixed = DECODE_LAUNCH_S if not coalesce or c not in seen_tier else 0.0
            seen_tier.add(c)
            tier_s += fixed + decode
    return dict(copies=n["link"], decodes=n["tier"], link_us=link_s * 1e6, tier_us=tier_s * 1e6,
                layer_calls_copying=len(seen_link) if coalesce else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--policy", default="on-demand")
    ap.add_argument("--expert-memory", default="9MiB")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--link", default="A100-40GB-PCIe4")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    p = load_profile(a.link)
    rows = {}
    for compress in (False, True):
        log, tokens, st = record(a.model, a.policy, a.expert_memory, a.max_new_tokens, a.link, compress)
        for coalesce in (False, True):
            r = charge(log, p, coalesce)
            r["us_per_token"] = (r["link_us"] + r["tier_us"]) / tokens
            r["h2d_bytes_per_token"] = sum(c for k, _, c, _ in log if k == "link") / tokens
            r["tokens"], r["host_experts"] = tokens, st.get("host_experts", 0)
            rows[("coded" if compress else "raw", "per layer call" if coalesce else "per copy")] = r
    if a.json:
        print(json.dumps({f"{k[0]}, {k[1]}": v for k, v in rows.items()}, indent=1))
        return
    print(f"{a.policy}, {a.model or 'bundled model'}, --expert-memory {a.expert_memory}, {p.name}: "
          f"PCIe {p.pcie_bandwidth / 1e9:g} GB/s + {p.latency * 1e6:g} us, HBM {p.device_memory_bandwidth / 1e9:g} GB/s, "
          f"decode launch {DECODE_LAUNCH_S * 1e6:g} us")
    print(f"{'store':<6} {'latency':<15} {'copies':>7} {'decodes':>8} {'H2D B/token':>12} {'link us/token':>14} {'raw/this':>9}")
    for rule in ("per copy", "per layer call"):
        base = rows[("raw", rule)]["us_per_token"]
        for store in ("raw", "coded"):
            r = rows[(store, rule)]
            print(f"{store:<6} {rule:<15} {r['copies']:>7} {r['decodes']:>8} {r['h2d_bytes_per_token']:>12,.0f} "
                  f"{r['us_per_token']:>14.2f} {base / r['us_per_token']:>8.3f}x")


if __name__ == "__main__":
    main()
