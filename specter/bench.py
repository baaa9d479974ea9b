"""Policies side by side: one process, the same prompts, alternating policies so drift in machine
load hits all of them alike. Ratios measured here are the honest numbers; absolute CPU times are not.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

import specter

from . import default_model_path, resolve_device, workloads
from .builder import check_load_options, hold_threads, load_shared, plan_engine
from .errors import ConfigError, ContextLengthError, warn
from .offload.plan import check_context, compute_dtype
from .offload.threads import cuda_device
from .policy import BENCH_POLICIES, DEFAULT_K_MAX, get as get_policy
from .sampling import SamplingParams, idle_filters
from .speculative.decoder import acceptance_stats

DEFAULT_PROMPTS = list(workloads.DEFAULT)


def read_prompts(path: str | None, workload: str | None = None) -> list:
    """Prompts from a file, or a built-in workload (specter/workloads.py; `default` when neither is given)."""
    if path is not None and workload is not None:
        raise ConfigError("pass either --prompts FILE or --workload NAME, not both")
    if path is None:
        return workloads.workload_prompts(workload or "default")
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"prompts file {path!r} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text ({e})") from None
    if p.suffix.lower() == ".json":
        try:
            prompts = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: invalid JSON ({e})") from None
        if not isinstance(prompts, list) or not prompts:
            raise ConfigError(f"{path}: expected a non-empty JSON list of prompts (strings or token-id lists)")
        for i, p in enumerate(prompts):  # (before the load; the engine checks ids against the vocabulary)
            ids = isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
            if not (isinstance(p, str) or ids) or not p:
                raise ConfigError(f"{path}: prompt {i + 1} of {len(prompts)} is {json.dumps(p)[:60]}; each prompt "
                                  f"is a non-empty string or list of token ids")
        return prompts
    prompts = [line.replace("\\n", "\n") for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ConfigError(f"{path}: no prompts (one per line; write \\n for a newline)")
    return prompts


SUM_KEYS = ("expert_hits", "expert_misses", "h2d_bytes", "stall_s", "decode_stall_s", "prefetch_issued",
            "prefetch_used", "prefetch_cancelled", "cycles", "draft_s", "verify_s", "accepted_tokens",
            "drafted_tokens", "rejections", "recall_hits", "recall_total", "cover_hits",
            "cover_total", "host_experts", "host_bytes", "host_stall_s", "host_busy_s",
            "tier_hits", "tier_fills", "tier_evictions", "tier_decoded_bytes")


def new_totals() -> dict:
    """A policy's running totals over the bench's generations (add_run)."""
    return {"decode_s": 0.0, "decode_tokens": 0, "ttft_s": 0.0, "runs": 0, "outputs": []}


def add_run(a: dict, out, keys) -> None:
    """One generation into the totals `a`: decode time and tokens after the first, TTFT, its token
    ids, and the stats `keys` summed."""
    s = out.stats
    n = s["new_tokens"] - 1  # a generation that ended at its first token (EOS) decoded nothing
    if n > 0:
        a["decode_s"] += s["tpot_s"] * n
        a["decode_tokens"] += n
    a["ttft_s"] += s["ttft_s"]
    a["runs"] += 1
    a["outputs"].append(out.token_ids)
    for k in keys:
        if k in s:
            a[k] = a.get(k, 0) + s[k]


def tpot(a: dict) -> float | None:
    """The totals' TPOT: decode seconds over the tokens after each generation's first; None where every
    generation ended at its first token (EOS): nothing was decoded to time."""
    return a["decode_s"] / a["decode_tokens"] if a["decode_tokens"] else None


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, None where either is unknown (a TPOT with nothing decoded)."""
    return None if num is None or den is None or den == 0 else num / den


def or_na(value, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)


def budget_words(args, residency, per_rank: bool = False) -> str:
    """A bench table's budget in words: a byte budget (under torchrun each rank's own), else the residency."""
    for name in ("device_memory", "expert_memory"):
        if getattr(args, name, None):
            return f"{name.replace('_', ' ')} {getattr(args, name)}" + (" a rank" if per_rank else "")
    return f"residency {residency:g}"


def check_run(model, policies: list[str], *, device="auto", max_new_tokens: int = 64, sampling: dict | None = None,
              shared=None, compare_compressed: bool = False, residency=None, expert_memory=None, device_memory=None,
              link=None, **load_kw) -> tuple[dict, SamplingParams]:
    """run_bench's arguments checked before anything loads (a typo must not cost a big model's load and
    draft): the sampling values, the policies, each policy's own options as its load would check them,
    and its plan (plan_policies). The sampling keywords (greedy unless a temperature is given) and their params."""
    sampling = {"temperature": 0.0, **(sampling or {})}
    params = SamplingParams(**sampling)  # a bad value fails here, before any engine loads
    if idle := idle_filters(params):  # (bench's temperature is 0 unless given)
        warn(f"{idle} no effect at temperature 0, bench's default (greedy, tokens compared): give a temperature "
             f"(--temperature) to sample")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 2:
        raise ConfigError(f"max_new_tokens must be an integer >= 2 (TPOT is the time a token after the first), "
                          f"got {max_new_tokens!r}")
    unknown = [p for p in policies if p not in BENCH_POLICIES]
    if unknown:
        raise ConfigError(f"unknown policy {unknown[0]!r}; choose from {', '.join(BENCH_POLICIES)}")
    twice = [p for i, p in enumerate(policies) if p in policies[:i]]
    if twice:  # one row a policy: a second run would be added into the first's, and its engine left open
        raise ConfigError(f"policy {twice[0]!r} is listed twice; list each policy once (--repeat runs them again)")
    if compare_compressed and (load_kw.get("compress_experts") or shared is not None):
        raise ConfigError("compare_compressed runs each policy on the raw store and on the coded one: "
                          "give neither compress_experts nor shared")
    if compare_compressed:  # (else the coded load's refusal would say to drop a flag not given)
        from .loader import open_checkpoint

        ckpt = open_checkpoint(model if model is not None else default_model_path())
        if ckpt.dtype != torch.bfloat16:
            raise ConfigError(f"compare_compressed (--compare-compressed) runs a losslessly coded store, which needs a "
                              f"bf16 checkpoint; {ckpt.path} stores {str(ckpt.dtype)[6:]}: drop it")
    given = dict(residency=residency, expert_memory=expert_memory, device_memory=device_memory, link=link,
                 k_max=load_kw.get("k_max"), draft_bits=load_kw.get("draft_bits"),
                 compress_experts=load_kw.get("compress_experts") or None, host_threads=load_kw.get("host_threads"))
    specter.refuse_unused(policies, **given)  # (specter.load refuses them per policy; here: unread by the run)
    if any(get_policy(p).makes_draft(given["k_max"]) for p in policies) and given["draft_bits"] is not None:
        from .loader import open_checkpoint  # (headers only) a width the experts cannot pack, before the load
        from .speculative.draft_cache import check_packable

        spec = open_checkpoint(model if model is not None else default_model_path()).spec
        check_packable(given["draft_bits"], spec.hidden, spec.expert_inter)
    for p in policies:  # what each policy's load reads of the options, as run_bench passes them
        pol = get_policy(p)
        k_max = load_kw.get("k_max", DEFAULT_K_MAX) if pol.drafts else DEFAULT_K_MAX
        host_threads = load_kw.get("host_threads") if pol.host_lane else None
        check_load_options(pol, residency=residency, expert_memory=expert_memory, device_memory=device_memory,
                           link=link if pol.offloads else None, k_max=k_max, host_threads=host_threads)
    plan_policies(model, policies, device, shared=shared, compare_compressed=compare_compressed,
                  budget=dict(residency=residency, expert_memory=expert_memory, device_memory=device_memory),
                  **load_kw)
    return sampling, params


def plan_policies(model, policies: list[str], device, *, shared=None, compare_compressed: bool = False,
                  budget: dict, **load_kw) -> None:
    """Each offloading policy planned from the checkpoint's headers, as its engine will plan it (coded
    too with compare_compressed): a budget below a layer's top-k, or one the device cannot hold, is
    refused before bench's one load, not after it."""
    from .loader import open_checkpoint

    device = shared.device if shared is not None else resolve_device(device)
    ckpt = shared.ckpt if shared is not None else open_checkpoint(model if model is not None else default_model_path())
    dt = shared.dtype if shared is not None else compute_dtype(device, ckpt.dtype, load_kw.get("dtype"))
    context = check_context(load_kw.get("context"), ckpt.spec)
    for p in policies:
        pol = get_policy(p)
        for coded in (False, True) if compare_compressed else (bool(load_kw.get("compress_experts")),):
            with cuda_device(device):
                plan_engine(pol, ckpt, device, dt, **budget, context=context, compile=load_kw.get("compile"),
                            k_max=load_kw.get("k_max", DEFAULT_K_MAX) if pol.drafts else DEFAULT_K_MAX,
                            compress_experts=coded, draft_bits=load_kw.get("draft_bits", 4),
                            slot_pool=load_kw.get("slot_pool", "shared"))


def run_bench(model, policies: list[str], *, prompts: list, max_new_tokens: int = 64, repeat: int = 1,
              device: str = "auto", residency=None, expert_memory=None, device_memory=None, link=None,
              warmup: bool = True,
              sampling: dict | None = None, shared=None, compare_compressed: bool = False, **load_kw) -> dict:
    """`shared`: a checkpoint already loaded (`load_once`) for every policy to build on; default: one
    loaded here (one store, one model, one draft for all).
    `sampling`: generate()'s temperature / top_p / top_k / seed (default greedy: a benchmark never
    takes the model's generation_config.json, so its runs compare across models). Tokens are compared
    greedy, and sampled with a seed at fp32 (every policy draws the tokens plain decoding draws for it;
    sampling.py); sampled without one, or at 16 bits, not.
    `compare_compressed`: each policy twice, on the raw store and on a losslessly coded one ("POLICY
    +coded", compress_experts), alternating prompt by prompt in this one process (one link calibration
    for all), so `coded_vs_raw` (bytes a token and TPOT, coded against raw) compares like with like."""
    sampling, params = check_run(model, policies, device=device, max_new_tokens=max_new_tokens, sampling=sampling,
                                 shared=shared, compare_compressed=compare_compressed, residency=residency,
                                 expert_memory=expert_memory, device_memory=device_memory, link=link, **load_kw)
    engines, runs, coded_shared = {}, [], None
    release = hold_threads(shared.device if shared is not None else resolve_device(device))  # (the load sets
    try:                                                                  # torch's threads: put back at the end)
        if shared is None:  # one load every policy builds on (its options are the checkpoint's, not a policy's)
            shared = load_once(model, device, **load_kw)
        for p in policies:
            pol, kw = get_policy(p), dict(load_kw)
            if pol.offloads:
                kw.update(residency=residency, expert_memory=expert_memory, device_memory=device_memory)
            if not pol.host_lane:  # host_threads sizes the lane policies' lanes, as a budget the offloaders'
                kw.pop("host_threads", None)
            if not pol.drafts:  # and k_max the drafting policies' drafts
                kw.pop("k_max", None)
            engines[p] = specter.load(model, device=device, policy=p, link=link if pol.offloads else None,
                                      shared=shared, **kw)
            runs.append(p)
            if compare_compressed and pol.offloads:  # the same policy on the coded store, right after it
                name = p + CODED
                if coded_shared is None:  # one coded load for all, as the raw one (its draft at draft_bits)
                    coded_shared = load_once(model, device, **{**load_kw, "compress_experts": True})
                kw.pop("compress_experts", None)
                engines[name] = specter.load(model, device=device, policy=p, link=link, shared=coded_shared,
                                             compress_experts=True, **kw)
                runs.append(name)
        policies = runs
        first = engines[policies[0]]
        # tokens compared where there is one answer: greedy, or seeded at fp32 (at 16 bits a seeded draw
        # flips at near-ties of its noisy scores far more often than greedy at ties of logits: README)
        compared = params.greedy or (params.seed is not None and first.dtype == torch.float32)
        for i, prompt in enumerate(prompts):  # the run's own lengths, checked before the warm-up's shorter one
            if (n := len(first.encode(prompt))) + max_new_tokens > first.context:
                raise ContextLengthError(f"prompt {i + 1} of {len(prompts)} ({n} tokens) + max_new_tokens "
                                         f"({max_new_tokens}) = {n + max_new_tokens} exceeds the context of "
                                         f"{first.context} tokens; shorten the prompt or lower max_new_tokens")
        if warmup:  # first-call costs (allocator, lazy init) out of the measurement
            if torch.device(first.device).type == "cuda":  # each new length's one-time costs, which every
                for prompt in prompts:                      # engine of the process shares: else the first
                    first.generate(prompt, max_new_tokens=max_new_tokens, **sampling)  # policy pays them
            for e in engines.values():
                e.generate(prompts[0], max_new_tokens=4, **sampling)
        agg = {p: new_totals() for p in policies}
        for _ in range(repeat):
            for prompt in prompts:
                for p in policies:
                    out = engines[p].generate(prompt, max_new_tokens=max_new_tokens, **sampling)
                    a, s = agg[p], out.stats
                    add_run(a, out, SUM_KEYS)
                    a["cuda_graphs"] = s.get("cuda_graphs")  # recorded so far (the engine's own count)
                    for k, v in s.items():
                        if k == "k_histogram":
                            h = a.setdefault(k, {})
                            for kk, n in v.items():
                                h[kk] = h.get(kk, 0) + n
        first = policies[0]
        result = {}
        for p in policies:
            a = agg[p]
            r = {"tpot_s": tpot(a), "ttft_s": a["ttft_s"] / a["runs"],
                 "decode_s": a["decode_s"],
                 "new_tokens": sum(len(o) for o in a["outputs"]),
                 "lossless_vs_" + first: a["outputs"] == agg[first]["outputs"] if compared else None}
            r.update({k: a[k] for k in SUM_KEYS if k in a})
            if "k_histogram" in a:
                r["k_histogram"] = a["k_histogram"]
            if a.get("cuda_graphs") is not None:  # recordings, their count and device bytes (CUDA graphs)
                r["cuda_graphs"] = a["cuda_graphs"]
            if r["new_tokens"]:  # what the link carried a generated token (prefill's copies included)
                r["h2d_bytes_per_token"] = r.get("h2d_bytes", 0) / r["new_tokens"]
            hm = r.get("expert_hits", 0) + r.get("expert_misses", 0)
            if hm:  # a raw slot's; and on the device at all (a coded tier's hit is decoded there, no PCIe)
                r["hit_rate"] = r.get("expert_hits", 0) / hm
                r["device_hit_rate"] = (r.get("expert_hits", 0) + r.get("tier_hits", 0)) / hm
            if r.get("drafted_tokens"):
                spec_cycles = sum(n for k, n in r["k_histogram"].items() if k > 0)
                r.update(acceptance_stats(r["accepted_tokens"], r["drafted_tokens"], r["rejections"], spec_cycles))
            if r.get("recall_total") and r.get("prefetch_issued"):  # recall of no prefetch is not 1.0
                r["prefetch_recall"] = r["recall_hits"] / r["recall_total"]
            if r.get("cover_total"):
                r["route_coverage"] = r["cover_hits"] / r["cover_total"]
            plan = getattr(engines[p], "plan", None)
            if plan is not None:
                r["slots_per_layer"], r["residency"] = plan.slots_per_layer, plan.residency
                r["pool_slots"], r["slot_pool"] = plan.pool_slots, plan.pool  # the shared pool's slots in all
            if getattr(engines[p].decoder, "draft", None) is not None:  # the draft's width (its acceptance above)
                r["draft_bits"] = engines[p].shared.draft_bits
            result[p] = r
        base = speedup_baseline(policies)
        for p in policies:
            result[p]["speedup_vs_" + base] = ratio(result[base]["tpot_s"], result[p]["tpot_s"])
        out = {"policies": result, "max_new_tokens": max_new_tokens, "prompts": len(prompts), "repeat": repeat,
               "link": _link_name(engines), "speedup_baseline": base,
               "sampling": "greedy" if params.greedy else sampling}
        if (calibration := _calibration(engines)) is not None:
            out["link_calibration"] = calibration
        if compare_compressed:
            out["coded_vs_raw"] = coded_vs_raw(result, agg, compared)
        return out
    finally:
        for e in engines.values():
            e.close()
        release()


CODED = "+coded"  # compare_compressed: the name of a policy's run on the coded store


def coded_vs_raw(result: dict, agg: dict, compared: bool) -> dict:
    """Per policy run both ways: the coded run's H2D bytes a token over the raw run's, the raw run's
    TPOT over the coded run's (> 1: coded is faster), and whether their tokens are equal (when
    `compared`: greedy, or seeded at fp32)."""
    out = {}
    for name, r in result.items():
        if not name.endswith(CODED):
            continue
        p = name[: -len(CODED)]
        raw, b = result[p], r.get("h2d_bytes_per_token", 0)
        out[p] = {"h2d_bytes_ratio": b / raw["h2d_bytes_per_token"] if raw.get("h2d_bytes_per_token") else None,
                  "tpot_speedup": ratio(raw["tpot_s"], r["tpot_s"]),
                  "same_tokens": agg[p]["outputs"] == agg[name]["outputs"] if compared else None}
    return out


def load_once(model, device: str = "auto", **load_kw):
    """The checkpoint loaded once for several benches (a residency sweep): a builder.Loaded."""
    path = Path(model) if model is not None else default_model_path()
    return load_shared(path, resolve_device(device), dtype=load_kw.get("dtype"), threads=load_kw.get("threads"),
                       draft_cache=load_kw.get("draft_cache"), compress_experts=load_kw.get("compress_experts", False),
                       draft_bits=load_kw.get("draft_bits", 4))


def _link(engines):
    for e in engines.values():
        mgr = getattr(e.decoder, "experts", None) or getattr(e.decoder, "mgr", None)
        if (link := getattr(mgr, "link", None)) is not None:
            return link
    return None


def _link_name(engines) -> str | None:
    link = _link(engines)
    return None if link is None else link.name


def _calibration(engines) -> dict | None:
    """An emulated link's calibration: the expert throughput this CPU measured at load (a busy machine
    measures less, and its link is slower in proportion: compare runs calibrated alike, or fix it with
    SPECTER_EXPERT_THROUGHPUT), and the bandwidth and latency it gave."""
    link = _link(engines)
    if getattr(link, "expert_throughput", None) is None:
        return None
    out = {"expert_throughput_GBps": link.expert_throughput / 1e9, "bandwidth_GBps": link.bandwidth / 1e9,
           "latency_us": link.latency * 1e6}
    for e in engines.values():  # the bandwidth is of the slots' bytes (the width compute was calibrated at)
        if getattr(e.plan, "pool_dtype", None):
            out.update(slot_dtype=e.plan.pool_dtype, store_dtype=str(e.shared.ckpt.dtype)[6:])
            break
    return out


def speedup_baseline(policies) -> str:
    """Speed-ups are over on-demand (plain offloading, the baseline every smarter policy must beat)
    when it ran; otherwise over the first policy. Losslessness is always checked against the first."""
    return "on-demand" if "on-demand" in policies else policies[0]


def format_table(res: dict) -> str:
    pols = res["policies"]
    first, base = next(iter(pols)), speedup_baseline(list(pols))
    w = max(11, *map(len, pols))  # the policy column (a compare_compressed run's names are longer)
    head = f"{'policy':<{w}} {'TPOT ms':>8} {'speedup':>8} {'TTFT ms':>8} {'hit rate':>8} {'misses':>7} " \
           f"{'H2D MB':>8} {'H2D KB/tok':>10} {'host MB':>8} {'stall s':>8} {'accept':>7} {'effic':>6} {'tok/cyc':>7} {'recall':>7} {'cover':>7} " \
           f"{'lossless':>8}"
    lines = [head, "-" * len(head)]
    for p, r in pols.items():
        f = lambda k, fmt: (fmt.format(r[k]) if k in r else "-")  # noqa: E731
        same = _same_tokens(r["lossless_vs_" + first])
        lines.append(
            f"{p:<{w}} {or_na(r['tpot_s'] and r['tpot_s'] * 1e3, '{:.2f}'):>8} "
            f"{or_na(r['speedup_vs_' + base], '{:.2f}x'):>8} {r['ttft_s'] * 1e3:>8.1f} "
            f"{f('device_hit_rate', '{:.1%}'):>8} {r.get('expert_misses', 0) - r.get('tier_hits', 0):>7} "
            f"{(r.get('h2d_bytes', 0) / 1e6):>8.1f} {(r.get('h2d_bytes_per_token', 0) / 1e3):>10.1f} "
            f"{(r.get('host_bytes', 0) / 1e6):>8.1f} {f('stall_s', '{:.3f}'):>8} "
            f"{f('acceptance_rate', '{:.2f}'):>7} {f('draft_efficiency', '{:.2f}'):>6} "
            f"{f('accepted_per_cycle', '{:.2f}'):>7} {f('prefetch_recall', '{:.1%}'):>7} "
            f"{f('route_coverage', '{:.1%}'):>7} {same if p != first else 'ref':>8}")
    lines += ["", LEGEND.format(base=base, first=first), "", "where decode time goes (after the first token):"]
    lines += [f"  {p:<{w}} {time_split(r)}" for p, r in pols.items() if "decode_stall_s" in r]
    if res.get("coded_vs_raw"):
        lines += ["", "coded (--compress-experts) against raw, same process: H2D bytes a token (coded / raw), "
                      "TPOT speed-up (raw / coded), tokens"]
        for p, c in res["coded_vs_raw"].items():
            moved = "-" if c["h2d_bytes_ratio"] is None else f"{c['h2d_bytes_ratio']:.3f}x"
            same = "n/a" if c["same_tokens"] is None else "same" if c["same_tokens"] else "DIFFERENT"
            lines.append(f"  {p:<11} bytes {moved:>7}  speed-up {or_na(c['tpot_speedup'], '{:.3f}x')}  tokens {same}")
    tiered = [(p, r) for p, r in pols.items() if r.get("tier_hits") or r.get("tier_fills")]
    if tiered:  # the table's hit rate counts a use decoded from the coded tier (no PCIe) a hit, misses not
        lines += ["", "the compressed device tier (its share of the budget beside the raw slots that residency "
                      "counts): uses decoded from it on the device, no PCIe bytes (hits in the table; JSON hit_rate "
                      "counts raw slots only, device_hit_rate both)"]
        for p, r in tiered:
            misses = r.get("expert_misses", 0)
            share = f" ({r['tier_hits'] / misses:.1%} of the raw slots' misses)" if misses else ""
            lines.append(f"  {p:<{w}} tier hits {r.get('tier_hits', 0)}{share}, fills {r.get('tier_fills', 0)}")
    return "\n".join(lines)


def _same_tokens(v) -> str:
    return "n/a" if v is None else str(v)  # None: sampled without a seed (no one answer to compare)


def time_split(r: dict) -> str:
    """Decode time as draft | waiting on copies (on the host lane for a policy that copied nothing; on
    both for one that used both) | everything else (verify and step compute)."""
    total = r.get("decode_s", 0.0)
    if total <= 0:
        return "-"
    draft, stall = r.get("draft_s", 0.0), r.get("decode_stall_s", 0.0)
    host, h2d = r.get("host_experts"), r.get("h2d_bytes")
    waits = "host wait" if host and not h2d else "copy+host stall" if host else "copy stall"
    parts = [("draft", draft)] if draft else []
    parts += [(waits, stall), ("compute", max(total - draft - stall, 0.0))]
    return " | ".join(f"{name} {t / total:.0%}" for name, t in parts)


LEGEND = """\
speedup: TPOT of {base} / this one's. hit rate: expert uses found on the device (a raw slot, or the coded tier
of --compress-experts). misses: uses copied over the link or computed on the host. H2D KB/tok: bytes the link carried
per generated token (coded bytes with --compress-experts). host MB: expert weights the host
lane read in place (policies host, specter). stall: seconds waited on copies and the host lane.
accept: P(draft token accepted | the ones before it were). effic: accepted / drafted (falls as K grows).
tok/cyc: drafted tokens accepted per speculative cycle. recall: expert uses resident or in flight when
verification reached them (bounded by the slots). cover: expert uses the draft's routers predicted.
lossless: the same tokens as {first}'s (ref), greedy or seeded at fp32; n/a where a draw has no one answer."""
