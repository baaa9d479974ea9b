"""`specter plan --ranks N`: what each rank of an N-rank pipeline holds, and whether it fits.

Each rank's device holds its stage's non-expert weights (its layers; the embedding on the first,
the final norm and lm_head on the last), its layers' KV cache at the context, and its expert slot
pool; its host holds its MoE layers' expert store. The pool is sized as the ranks size it when they
load (load.load_stage): a residency gives each stage its layers' share of the whole model's pool;
--expert-memory is each rank's own; --device-memory is each rank's own device, the pool taking
what the stage's weights, KV cache and draft leave (it fits when that is at least one layer's
top-k). Drafting policies (unless --k-max 0: no draft): the first rank runs the whole draft
(stage.StageModel.whole), so it holds every layer's non-expert weights, every MoE layer's draft
experts and a KV cache of every layer; the others hold no draft. --compress-experts: each rank's
host store is its layers' coded bytes (measured from the weights), with the raw copy a rank keeps
beside it (raw_copy), and where the engine builds one (coded_tier.tier_wanted) its device also holds
its share of the compressed tier, sized as the ranks size it (stages.stage_tier over a plan at the
tier's planning ratio).

A drafting policy given --device-memory is also planned without its draft: where every rank would
then hold all of its layers' experts and with the draft some rank does not, a tip says so (plain
decoding then copies nothing after warm-up, and may beat speculation that misses)."""
from __future__ import annotations

import json

from ..errors import BudgetError, ConfigError
from ..offload.plan import DRAFT_BITS, make_plan
from ..policy import get as get_policy
from ..sizes import format_size, parse_size
from .stages import make_stages, stage_device_bytes, stage_expert_memory, stage_plan, stage_pool, stage_tier

PIPELINED = ("resident", "on-demand", "next-layer", "host", "spec-lru", "specter")  # launch.PIPELINED_POLICIES


def rank_plans(spec, numel: int, dtype, store_dtype, ranks: int, *, policy: str, residency=None,
               expert_memory=None, device_memory=None, context: int | None = None, device=None,
               draft_bits: int = 4, coded_layers: list[int] | None = None, k_max: int | None = None,
               host_threads: int | None = None) -> list[dict]:
    """One dict per rank: layers, moe_layers, non_expert_bytes, kv_bytes, draft_bytes, pool_slots,
    pool_bytes, tier_bytes, total_bytes, store_bytes, raw_rows_bytes, fits. `coded_layers`
    (--compress-experts): each MoE layer's coded bytes (coded_store_bytes' per_layer); the store is then
    coded, and raw_rows_bytes is the raw copy a rank keeps beside it (raw_copy). `k_max` 0: a drafting
    policy that never drafts holds no draft (as load_stage)."""
    if policy not in PIPELINED:
        raise ConfigError(f"policy {policy!r} is not pipelined; plan --ranks for {', '.join(PIPELINED)}")
    drafts = get_policy(policy).makes_draft(k_max)
    stages = make_stages(spec, ranks, store_dtype.itemsize, drafts, draft_bits)
    item, E, k = dtype.itemsize, spec.n_experts, spec.top_k
    out = []
    compressed = coded_layers is not None
    coded_tier = None
    if compressed and device is not None:
        from ..offload.coded_tier import plan_tier

        coded_tier = plan_tier(policy, device, dtype, compressed)  # as load_stage
    for st in stages:
        mine = st.moe_last - st.moe_first
        non, kv, draft = stage_device_bytes(spec, st, item, drafts, draft_bits, context)
        tier = 0
        if policy == "resident":
            slots, expert = mine * E, spec.expert_numel() * item
        else:
            budget = expert_memory
            try:
                if device_memory is not None:
                    budget = stage_expert_memory(spec, st, item, device_memory, drafts, draft_bits, context)
                plan = stage_plan(lambda tier: make_plan(spec, numel, dtype, residency=residency,
                                                         expert_memory=budget, draft=False, device=device,
                                                         store_dtype=store_dtype, context=context,
                                                         compressed=compressed, coded_tier=tier, verifies=drafts),
                                  spec, mine, budget is not None, coded_tier)  # (as load_stage)
                slots, expert = stage_pool(plan, spec, mine, budget is not None), plan.expert_bytes
                tier = stage_tier(plan, spec, mine, slots, budget is not None)
            except BudgetError:  # less than one layer's top-k left
                slots, expert = 0, spec.expert_numel() * item
        store = raw = mine * E * spec.expert_numel() * store_dtype.itemsize
        if compressed:
            store = sum(coded_layers[st.moe_first:st.moe_last])
        out.append(dict(rank=st.rank, layers=[st.first, st.last], moe_layers=mine, non_expert_bytes=non,
                        kv_bytes=kv, draft_bytes=draft, pool_slots=slots, experts=mine * E, pool_bytes=slots * expert,
                        tier_bytes=tier, total_bytes=non + kv + draft + slots * expert + tier,
                        store_bytes=0 if policy == "resident" else store,
                        raw_rows_bytes=raw if compressed and raw_copy(policy, device, raw, host_threads) else 0,
                        fits=mine == 0 or slots >= k))
    return out


def raw_copy(policy: str, device, raw_bytes: int, host_threads: int | None) -> bool:
    """Whether a rank with a coded store keeps its layers' experts decoded beside it (load.load_stage): one
    process's rule, builder.keeps_raw (a host lane's rows; CPU: coded copies', up to ROWS_MAX_BYTES)."""
    from ..builder import keeps_raw

    return device is not None and bool(raw_bytes) and keeps_raw(get_policy(policy), device, host_threads, raw_bytes)


def holds_all(rows: list[dict]) -> bool:
    """Every rank's pool holds all of its layers' experts."""
    return all(r["fits"] and r["pool_slots"] >= r["experts"] for r in rows)


def draftless_tip(rows: list[dict], plain: list[dict], policy: str, device_memory: int) -> str | None:
    """A tip when `plain` (the same ranks planned without a draft) holds every expert and `rows` does not."""
    if not holds_all(plain) or holds_all(rows):
        return None
    short = ", ".join(f"rank {r['rank']} {r['pool_slots']} of {r['experts']}" for r in rows
                      if r["pool_slots"] < r["experts"])
    draft = format_size(rows[0]["draft_bytes"])
    return (f"without a draft each rank's {format_size(device_memory)} holds all of its layers' experts (policy "
            f"on-demand copies nothing after warm-up); {policy}'s draft on rank 0 ({draft}) leaves {short}. "
            f"Compare both under torchrun: specter bench --policies on-demand,{policy}")


def print_rank_plans(rows: list[dict], as_json: bool, device_memory=None, tip: str | None = None,
                     draft_bits: int | None = None) -> None:
    if as_json:  # draft_bits: the draft's width planned (the one to run with), None without a draft
        print(json.dumps({"ranks": rows, "draft_bits": draft_bits, **({"tip": tip} if tip else {})}))
        return
    for r in rows:
        a, b = r["layers"]
        line = (f"rank {r['rank']}: layers [{a}, {b}) ({r['moe_layers']} MoE): non-expert "
                f"{format_size(r['non_expert_bytes'])}, KV {format_size(r['kv_bytes'])}, "
                + (f"draft {format_size(r['draft_bytes'])}, " if r["draft_bytes"] else "") + "slot pool "
                f"{r['pool_slots']} of {r['experts']} experts ({format_size(r['pool_bytes'])}), "
                + (f"coded tier {format_size(r['tier_bytes'])}, " if r["tier_bytes"] else "") + "device total "
                f"{format_size(r['total_bytes'])}; host store {format_size(r['store_bytes'])}"
                + (f" and its raw copy {format_size(r['raw_rows_bytes'])}" if r["raw_rows_bytes"] else ""))
        if device_memory is not None:
            line += "; fits" if r["fits"] else "; does NOT fit (less than one layer's top-k experts left)"
        print(line)
    if tip:
        print(f"tip: {tip}")


def cmd_plan_ranks(args, device) -> int:
    """`specter plan --ranks N` (cli/plan.py hands over): the per-rank table, or {"ranks": [...]}."""
    from .. import default_model_path
    from ..loader import describe
    from ..offload.plan import check_context, compute_dtype

    path = args.model or default_model_path()
    spec, store_dtype, numel, weights = describe(path)
    check_context(args.context, spec)  # as the one-rank plan (and the load) refuses them
    if getattr(args, "draft_bits", None) is not None:
        from ..speculative.draft_cache import check_packable

        check_packable(args.draft_bits, spec.hidden, spec.expert_inter)
    coded = None
    if getattr(args, "compress_experts", False):
        from ..offload.coded import coded_store_bytes

        if not weights:
            raise ConfigError("--compress-experts: the coded size is measured from the weights, and this "
                              "model directory has config.json only")
        coded = []
        coded_store_bytes(path, coded)
    dtype = compute_dtype(device, store_dtype, getattr(args, "dtype", None))

    def plan(policy, bits=getattr(args, "draft_bits", None) or 4):
        return rank_plans(spec, numel, dtype, store_dtype, args.ranks, policy=policy, residency=args.residency,
                          expert_memory=args.expert_memory, device_memory=args.device_memory, context=args.context,
                          device=device, draft_bits=bits, coded_layers=coded, k_max=args.k_max,
                          host_threads=getattr(args, "host_threads", None))

    rows, tip, chosen = plan(args.policy), None, ""
    drafts = get_policy(args.policy).makes_draft(args.k_max)  # (--k-max 0: no draft on rank 0)
    bits = (getattr(args, "draft_bits", None) or 4) if drafts else None
    if args.device_memory is not None and drafts and getattr(args, "draft_bits", None) is None:
        for b in DRAFT_BITS[1:]:  # as the one-rank plan: a narrower draft where the default does not fit
            if all(r["fits"] for r in rows):
                break
            narrower = plan(args.policy, b)
            if all(r["fits"] for r in narrower):
                rows, chosen, bits = narrower, f", draft INT{b} (the widest that fits)", b
    if args.device_memory is not None and drafts:
        tip = draftless_tip(rows, plan("on-demand"), args.policy, parse_size(args.device_memory))
    if not args.json:
        print(f"model {path} ({spec.arch}) over {args.ranks} ranks, policy {args.policy}{chosen}, computed "
              f"{str(dtype)[6:]} on {device.type}" + (", experts losslessly coded" if coded is not None else ""))
    print_rank_plans(rows, args.json, args.device_memory, tip, bits)
    return 0 if all(r["fits"] for r in rows) else 1  # as the one-rank plan
