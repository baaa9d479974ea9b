"""`torchrun --nproc-per-node N -m specter bench ...`: the pipelined policies on the same prompts.

Each policy is loaded as a pipeline in turn (its stages on every rank), warmed with one short
generation, then run over the prompts (`--repeat` passes); policies run one after the other, not
alternated as the single-process bench does (each rank would need every policy's stage at once).
Rank 0 prints TPOT, the hit rate, bytes copied and stall summed over the ranks, and each rank's own,
and whether every policy produced the first one's tokens (greedy, or seeded at fp32)."""
from __future__ import annotations

import json

import torch

from ..bench import SUM_KEYS, add_run, budget_words, new_totals, or_na, ratio, read_prompts, tpot
from ..errors import ConfigError
from ..policy import get as get_policy
from ..sampling import SamplingParams
from .decoder import serve_stage
from .launch import PIPELINED_POLICIES, UNSUPPORTED, check_options, open_pipeline, refuse_ignored

PER_RANK = ("expert_hits", "expert_misses", "h2d_bytes", "stall_s", "host_stall_s", "step_s", "wire_s")


def _policies(text: str | None) -> list[str]:
    if text is None:  # the default (every policy): the ones a pipeline runs
        return list(PIPELINED_POLICIES)
    from ..cli.options import policy_list  # (the CLI imports this package)

    names = policy_list(text)
    for p in names:
        get_policy(p)
        if p not in PIPELINED_POLICIES:
            raise ConfigError(f"policy {p!r} is not pipelined yet; under torchrun bench "
                              f"{', '.join(PIPELINED_POLICIES)}")
    return names


def run(args) -> int:
    from ..cli.options import refuse_unused_draft_flags  # (the CLI imports this package)

    policies = _policies(args.policies)
    opts = {k: v for k, v in vars(args).items() if k in UNSUPPORTED and v not in (None, False)}
    for p in policies:
        check_options(p, {k: v for k, v in opts.items() if k != "k_max" or get_policy(p).drafts})  # a flag a
        # pipeline would ignore is refused, as for generate (--k-max: read by the drafting policies)
    refuse_ignored(args, policies)
    refuse_unused_draft_flags(args, policies)  # as one process refuses them
    if args.repeat < 1:
        raise ConfigError("--repeat must be >= 1")
    if args.max_new_tokens < 2:
        raise ConfigError("--max-new-tokens must be >= 2: bench reports TPOT, the time a token after the first")
    if args.plot:
        raise ConfigError("--plot does not run under torchrun yet")
    prompts = read_prompts(args.prompts, args.workload)
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    greedy = SamplingParams(**sampling).greedy
    residency = args.residency
    if residency is None and args.expert_memory is None and args.device_memory is None:
        residency = 0.25
    results, owner, ranks = {}, None, None
    try:
        for p in policies:
            budget = dict(residency=residency, expert_memory=args.expert_memory, device_memory=args.device_memory,
                          link=args.link) \
                if get_policy(p).offloads else {}
            group, engine, stage = open_pipeline(args.model, device=args.device, policy=p, dtype=args.dtype,
                                                 backend=getattr(args, "pipeline_backend", None),
                                                 timeout_s=getattr(args, "pipeline_timeout", None),
                                                 k_max=args.k_max if get_policy(p).drafts else None,
                                                 draft_cache=getattr(args, "draft_cache", None),
                                                 host_threads=getattr(args, "host_threads", None)
                                                 if get_policy(p).host_lane else None,
                                                 draft_bits=(getattr(args, "draft_bits", None) or 4)
                                                 if get_policy(p).drafts else 4,
                                                 compress_experts=bool(getattr(args, "compress_experts", False)),
                                                 context=getattr(args, "context", None), **budget)
            owner = owner or group
            ranks = group.world
            if engine is None:
                serve_stage(stage, group)
                continue
            try:
                results[p] = _measure(engine, prompts, args.max_new_tokens, args.repeat, sampling)
                results[p]["fp32"] = engine.dtype == torch.float32
            except BaseException:
                engine.decoder.finish(abort=True)
                raise
            engine.decoder.finish()
    except BaseException:
        if owner is not None:
            owner.close_on_error()
        raise
    if owner is not None:
        owner.close()
    if owner is None or owner.rank != 0:
        return 0
    first = policies[0]
    base = "on-demand" if "on-demand" in results else first
    ref = results[first]["outputs"]
    # tokens compared where there is one answer, as the single-process bench: greedy, or seeded at fp32
    fp32 = [r.pop("fp32") for r in results.values()]
    compared = greedy or (args.seed is not None and all(fp32))
    for p, r in results.items():
        r["speedup_vs_" + base] = ratio(results[base]["tpot_s"], r["tpot_s"])
        r["lossless_vs_" + first] = (r.pop("outputs") == ref) if compared else None
    out = {"policies": results, "ranks": ranks, "max_new_tokens": args.max_new_tokens, "prompts": len(prompts),
           "repeat": args.repeat, "speedup_baseline": base, "sampling": "greedy" if greedy else sampling}
    if args.json:
        print(json.dumps(out))
        return 0
    mode = "greedy" if greedy else "sampled"
    print(f"pipeline of {ranks} ranks, {budget_words(args, residency, per_rank=True)}: {len(prompts)} prompts x "
          f"{args.repeat}, {args.max_new_tokens} new tokens, {mode} (policies run in turn)")
    print(f"| policy | TPOT ms | vs {base} | hit rate | H2D MB | stall s | per rank (hit rate, H2D MB, stall s) "
          f"| same tokens as {first} |")
    print("|---|---|---|---|---|---|---|---|")
    for p, r in results.items():
        each = "; ".join(f"r{i}: {_rate(s)}, {s.get('h2d_bytes', 0) / 1e6:.0f}, {s.get('stall_s', 0):.2f}"
                         for i, s in enumerate(r["per_rank"]))
        same = "" if r["lossless_vs_" + first] is None else ("yes" if r["lossless_vs_" + first] else "NO")
        ms, speedup = or_na(r["tpot_s"] and r["tpot_s"] * 1e3, "{:.1f}"), or_na(r["speedup_vs_" + base], "{:.2f}x")
        print(f"| {p} | {ms} | {speedup} | {_rate(r)} | "
              f"{r.get('h2d_bytes', 0) / 1e6:.0f} | {r.get('stall_s', 0):.2f} | {each} | {same} |")
    return 0


def _rate(s: dict) -> str:
    n = s.get("expert_hits", 0) + s.get("expert_misses", 0)
    return f"{s.get('expert_hits', 0) / n:.2f}" if n else "-"


def _measure(engine, prompts, max_new: int, repeat: int, sampling: dict) -> dict:
    engine.generate(prompts[0], max_new_tokens=4, **sampling)  # first-call costs out of the measurement
    a = dict(new_totals(), per_rank=None)
    for _ in range(repeat):
        for prompt in prompts:
            out = engine.generate(prompt, max_new_tokens=max_new, **sampling)
            s = out.stats
            add_run(a, out, SUM_KEYS)  # the single-process bench's totals, speculation's included
            h = a.setdefault("k_histogram", {})
            for k, n in (s.get("k_histogram") or {}).items():
                h[k] = h.get(k, 0) + n
            a["round_trips"] = a.get("round_trips", 0) + s["pipeline"]["round_trips"]
            for k, v in (s["pipeline"].get("optimistic") or {}).items():  # rank 0's pre-drafts (speculative.py)
                o = a.setdefault("optimistic", {})
                o[k] = o.get(k, 0) + v
            per = s["pipeline"]["per_rank"] or []
            if a["per_rank"] is None:
                a["per_rank"] = [{} for _ in per]
            for acc, r in zip(a["per_rank"], per):
                for k in PER_RANK:
                    acc[k] = acc.get(k, 0) + r.get(k, 0)
    r = {"tpot_s": tpot(a), "ttft_s": a["ttft_s"] / a["runs"], "decode_s": a["decode_s"],
         "new_tokens": sum(len(o) for o in a["outputs"]), "outputs": a["outputs"], "per_rank": a["per_rank"],
         "round_trips": a["round_trips"]}
    r.update({k: a[k] for k in SUM_KEYS if k in a})
    if r["new_tokens"]:
        r["h2d_bytes_per_token"] = r.get("h2d_bytes", 0) / r["new_tokens"]
    if a["k_histogram"]:
        r["k_histogram"] = a["k_histogram"]
    if "optimistic" in a:
        r["optimistic"] = a["optimistic"]
    return r
