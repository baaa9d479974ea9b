"""Loading one rank's stage: its layers' tensors of the checkpoint, its expert provider and, under a
drafting policy, its part of the speculation (stage.py says what a stage holds)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from ..errors import BudgetError, ConfigError
from ..moe import ExpertWeights, ResidentExperts
from ..policy import DEFAULT_K_MAX, get as get_policy
from ..sizes import format_size, parse_size
from .stage import ShiftedExperts, StageModel, drop_others, lookahead_columns
from .stages import Stage, stage_budget, stage_plan, stage_pool, stage_quota, stage_tier


def load_stage(path, stage: Stage, device: torch.device, *, policy: str, residency=None, expert_memory=None,
               device_memory=None, link=None, dtype=None, threads: int | None = None, k_max: int = DEFAULT_K_MAX,
               draft_cache=None, host_threads: int | None = None, draft_bits: int = 4,
               compress_experts: bool = False, context: int | None = None) -> StageModel:
    """Loads the checkpoint at `path` and keeps `stage` of it, with `policy`'s provider over its MoE
    layers: resident weights; or its own offload manager (on-demand), with next-layer guesses made
    within the stage (the last layer of a stage guesses nothing: the next layer is another rank's), or
    with the host lane computing every miss (host; `host_threads` sizes the lane, default `threads`,
    as builder.load's host_threads: also the opt-in to specter's lane on CUDA). A byte budget is the
    rank's own: `expert_memory` its pool's, `device_memory` its device's (the pool takes what the stage's
    weights, KV cache and draft leave; on CUDA without a budget, 90% of what is free). The drafting
    policies add a lookahead of `k_max` rows over the stage's own MoE layers and, for specter, its
    planner, its host lane (LaneChoice over the planner's scores, on CPU as builder.uses_host_lane
    says) and its next-layer guesses for K = 0 steps; their first stage also reads every layer and
    holds the whole draft (every MoE layer's experts quantised as the single-process draft's, at
    `draft_bits`; the
    other layers' routed experts are read only to be quantised), read from and written to the draft
    cache `draft_cache` under one process's key (speculative/draft_cache.py), so either run's entry
    serves the other. When that entry holds every layer, the other layers' routed experts are not
    read at all. The other stages never touch the cache. `compress_experts`: the stage's own layers'
    experts are held losslessly coded, as one process's store (builder.load_shared): read from the
    coded cache under one process's key and layer numbers where it holds them, else coded and
    written there; on CPU with the compressed device tier of the stage's share of the plan's."""
    from ..builder import configure_threads
    from ..loader import load_checkpoint, load_tokenizer, open_checkpoint
    from ..offload.cuda_link import make_link
    from ..offload.host_experts import HostExperts
    from ..offload.host_lane import make_host_lane
    from ..offload.manager import OffloadedExperts
    from ..speculative.draft import NextLayerPrefetch
    from ..offload.plan import compute_dtype, make_plan
    from ..offload.store import pin_wanted

    pol = get_policy(policy)
    from ..builder import check_draft_bits

    check_draft_bits(draft_bits)
    if draft_bits != 4 and not pol.drafts:
        raise ConfigError(f"policy {policy!r} runs no draft, so draft_bits would be ignored; drop it")
    if draft_bits != 4 and k_max == 0:  # as specter.load refuses it
        raise ConfigError(f"k_max=0 makes no draft, so draft_bits={draft_bits} would be ignored; drop one")
    pol.check_host_threads(host_threads)
    ckpt = open_checkpoint(path)
    spec = ckpt.spec
    from ..builder import check_compressible, check_has_experts

    check_has_experts(ckpt, policy)
    check_compressible(ckpt, compress_experts)
    drafts = pol.makes_draft(k_max)  # k_max 0 never drafts: rank 0 holds no draft (as one process makes none)
    dt = compute_dtype(device, ckpt.dtype, dtype)
    plan = lk = pdt = None  # pdt: the slot pool's dtype (the plan's: fp32 on CPU for a small pool)
    configure_threads(device, threads)  # before the link's calibration: measured on the threads it decodes with
    if not pol.offloads:
        if residency is not None or expert_memory is not None or device_memory is not None or link is not None:
            raise ConfigError(f"policy {policy!r} keeps every expert on the device, so a budget or --link would be "
                              "ignored; drop it or use --policy on-demand")
    else:
        expert_memory, own = stage_budget(spec, stage, dt.itemsize, device, residency, expert_memory, device_memory,
                                          drafts, draft_bits, context)
        # the plan of the whole model; each rank's pool is sized from it (stage_pool)
        from ..offload.coded_tier import plan_tier

        try:
            plan = stage_plan(lambda tier: make_plan(spec, ckpt.numel(), dt, residency=residency,
                                                     expert_memory=expert_memory, context=context, draft=False,
                                                     device=device, store_dtype=ckpt.dtype,
                                                     compressed=compress_experts, coded_tier=tier, verifies=drafts),
                              spec, stage.moe_last - stage.moe_first, own,
                              plan_tier(pol, device, dt, compress_experts))  # (the tier as build_engine)
        except BudgetError as e:
            if device_memory is None:
                raise
            whole = drafts and stage.is_first  # rank 0 holds the whole draft, whatever the ranks
            raise BudgetError(f"rank {stage.rank}: device_memory {format_size(parse_size(device_memory))} leaves "
                              f"its expert pool {format_size(expert_memory)} after its stage's weights"
                              f"{', KV cache and the whole draft' if whole else ' and KV cache'}; {e}; raise it, or "
                              + ("run without the draft (--k-max 0)" if whole else "run more ranks")) from None
        pdt = getattr(torch, plan.pool_dtype)
        lk = make_link(device, link, calibration=dict(hidden=spec.hidden, intermediate=spec.expert_inter, dtype=dt,
                                                      storage=pdt))
    whole = drafts and stage.is_first and any(l in spec.moe_layer_ids for l in range(spec.n_layers))
    cached = None
    if whole:  # the draft cache holds every layer's draft experts: the other stages' experts are not read
        from ..speculative.draft_cache import cached_draft

        cached = cached_draft(ckpt.files.values(), spec.n_moe_layers, draft_cache, bits=draft_bits)
    pin = device.type == "cuda" and pin_wanted()
    entry = hits = None
    if compress_experts:  # this stage's layers of one process's coded cache
        from ..offload.coded import cache_entry, read_cached

        entry = cache_entry(ckpt.files.values(), draft_cache)
        hits = read_cached(entry, stage.moe_last - stage.moe_first, spec.expert_shapes(), first=stage.moe_first)
    model, mine, _ = load_checkpoint(path, device, dt, pin_experts=pin and not compress_experts,
                                     layers=None if whole else (stage.first, stage.last),  # this stage's only
                                     expert_layers=(stage.first, stage.last) if cached is not None else None,
                                     experts=not (hits is not None and all(h is not None for h in hits)
                                                  and (not whole or cached is not None)))
    every = None
    if whole:  # the whole draft's: every layer (run by draft_forward); the target's experts are this stage's
        if cached is None:
            from ..speculative.draft_cache import draft_int4

            every = draft_int4(mine, ckpt.files.values(), device, cache=draft_cache, bits=draft_bits)  # one process's
            mine = mine[:stage.moe_last - stage.moe_first]
        else:
            every = cached
    else:
        drop_others(model, stage, dt)
    decoded = None  # compress_experts: the stage's store decoded, where a reader keeps it (as Loaded.host_rows)
    if compress_experts:
        from ..offload.coded import coded_store, ready_on_cuda

        mine = coded_store(mine, hits, entry, cuda=device.type == "cuda", pin=pin, first=stage.moe_first)
        if device.type == "cuda":
            ready_on_cuda(mine, device)
        from .plan import raw_copy  # (the rule plan --ranks counts the copy by)

        raw_bytes = sum(layer.w13.raw_nbytes + layer.w2.raw_nbytes for layer in mine)
        if raw_copy(policy, device, raw_bytes, host_threads):  # a host lane computes from it; CPU: coded copies
            decoded = [layer.decoded() for layer in mine]      # and tier hits write from it (emulate_from)
        if device.type == "cpu" and pol.offloads and mine:
            from ..offload.coded import emulate_from

            emulate_from(mine, decoded)
    tokenizer = load_tokenizer(path) if stage.is_first else None
    provider = stage_layers = None
    if mine:
        resident = None
        if not pol.offloads or plan.pool_rows == "resident":
            from ..offload.coded import DecodedStore

            resident = [ExpertWeights(e.w13.to(device, dt), e.w2.to(device, dt))
                        for e in (DecodedStore(mine) if compress_experts else mine)]
        if not pol.offloads:
            inner = ResidentExperts(resident)
        else:
            pool = stage_pool(plan, spec, len(mine), own)
            inner = OffloadedExperts(mine, stage_quota(plan, spec, len(mine), pool), device, lk, eviction=pol.eviction,
                                     dtype=pdt, alias=plan.aliased, rows=resident, pool=pool)
            tier = stage_tier(plan, spec, len(mine), pool, own)
            if tier:  # the compressed device tier: the stage's share, as its pool's
                from ..offload.coded_tier import attach as attach_tier

                attach_tier(inner, tier, lk)  # (CPU: its hits write from emulate_from's rows, as copies)
            inner.warm()
        guess = None
        stage_layers = SimpleNamespace(model=SimpleNamespace(layers=model.model.layers[stage.first:stage.last]))
        if pol.host_lane == "misses" and not inner.all_resident:  # policy host: every miss computed on the host
            inner = HostExperts(inner, make_host_lane(decoded or mine, device, lk, threads=host_threads or threads,
                                                      dtype=dt, charged_dtype=pdt))
        elif pol.prefetch == "next-layer" and not inner.all_resident:  # guesses within the stage's own layers
            guess = NextLayerPrefetch(stage_layers, inner)
        provider = ShiftedExperts(inner, stage.moe_first, guess)
    elif lk is not None:
        lk.close()
    st = StageModel(model, provider, stage, device, dt, plan=plan, tokenizer=tokenizer, path=path)
    st.k_max = k_max if pol.drafts else 0
    if pol.drafts and (mine or whole):
        _speculate(st, pol, mine, every, stage_layers, k_max, threads, lk, pdt, host_threads, decoded)
    return st


def _speculate(st: StageModel, pol, mine: list, every, stage_layers, k_max: int, threads, lk, pdt,
               host_threads: int | None = None, decoded=None) -> None:
    """A drafting policy's part on this stage (see load_stage), built as builder._decoder builds it
    for the whole model; `every` (the first stage: the whole draft): every MoE layer's INT4 draft
    experts, as draft_int4 yields them (from the draft cache or quantised), else None. `decoded`: a
    coded store's decoded rows, which the host lane computes from."""
    from ..builder import uses_host_lane
    from ..offload.host_lane import LaneChoice, host_params, make_host_lane
    from ..speculative.draft import NextLayerPrefetch
    from ..speculative.draft import DraftExperts, Lookahead, keep_packed
    from ..speculative.draft import PrefetchPlanner

    spec, device, dt, stage = st.model.spec, st.device, st.dtype, st.stage
    if every is not None:
        st.whole = True
        whole = st.whole_lookahead = Lookahead(max(k_max, 1), spec.n_moe_layers, spec.top_k, device)
        int4 = list(every)
        n = spec.n_moe_layers * spec.n_experts * spec.expert_numel()
        st.draft = DraftExperts(int4, whole, device, dt, packed=keep_packed(device, n, dt))
        st.lookahead = lookahead_columns(whole, len(mine))  # stage 0's MoE layers come first
    else:
        st.lookahead = Lookahead(max(k_max, 1), len(mine), spec.top_k, device)
    if not mine:
        return
    mgr = st.mgr = st.provider.inner
    if pol.prefetch != "planner":  # spec-lru: verification fetches on miss
        return
    st.planner = PrefetchPlanner(mgr, st.lookahead)
    if uses_host_lane(pol, device, host_threads, every_expert=mgr.all_resident):  # both lanes: misses ranked low: host
        mgr.host_lane = make_host_lane(decoded or mine, device, lk, threads=host_threads or threads, dtype=dt,
                                       charged_dtype=pdt)
        mgr.host_choice = LaneChoice(mgr, host_params(mgr.host_lane), planner=st.planner)
    if not mgr.all_resident:
        st.guessing = ShiftedExperts(mgr, stage.moe_first, NextLayerPrefetch(stage_layers, mgr))
