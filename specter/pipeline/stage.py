"""One rank's part of the model: its layers' weights, KV cache and expert provider.

The rank reads only its stage's tensors from the checkpoint (loader.load_checkpoint(layers=)):
its layers, the embedding on the first stage, the final norm and lm_head on the last; the modules
it never runs are replaced by empty ones, and its expert provider (resident weights, or an offload
manager with its own slot pool and link) is built over its own MoE layers' store only.

`StagePieces` is what the model's own layer loop (MoETransformer.run, `pieces=`) runs for a stage:
the model's pieces over this stage's layers, entered from the previous stage's hidden state
(positions from `start`), leaving with the hidden state [T, H] (the last MLP's output added), or
with the logits on the last stage. Both sides of a boundary therefore hold x + out exactly as the
single-process loop does.
"""
from __future__ import annotations

import time
from itertools import repeat
from types import SimpleNamespace

import torch
from torch import nn

from ..errors import ConfigError
from ..layers import KVCache
from ..moe import ExpertWeights, ResidentExperts
from ..policy import get as get_policy
from .stages import Stage, stage_fixed_bytes, stage_pool, stage_quota, stage_tier


class _NoZeros:
    """run's `pieces.zeros[:T]` (the MLP output before the first layer): None, as without pieces."""

    def __getitem__(self, _):
        return None


class StagePieces:
    """MoETransformer's pieces restricted to one stage (see the module docstring)."""

    zeros = _NoZeros()

    def __init__(self, model, stage: Stage):
        self.model, self.stage = model, stage
        self.dense, self.pre_experts = model.dense, model.pre_experts

    def layers(self, cache: KVCache):
        return zip(self.model.model.layers[self.stage.first:self.stage.last], repeat(cache))

    def enter(self, x, start):
        """First stage: token ids [T] -> embeddings; later stages: the hidden state [T, H] as received.
        Then cos/sin of positions start .. start+T-1."""
        if self.stage.is_first:
            return self.model.enter(x, start)
        pos = torch.arange(x.shape[0], device=x.device) + start
        cos, sin = self.model.rope.cos_sin(pos, x.dtype)
        return x, cos, sin

    def head(self, x, out, logits_for: str = "all"):
        if self.stage.is_last:
            return self.model.head(x, out, logits_for)
        return x if out is None else x + out


class ShiftedExperts:
    """A provider over a stage's own MoE layers, called with the model's MoE layer numbers. `guess`:
    the next-layer policy's guesses, over the stage's own layers (passed on each call, as
    PlainDecoder passes them)."""

    def __init__(self, inner, offset: int, guess=None):
        self.inner, self.offset, self.guess = inner, offset, guess

    def __call__(self, layer, x, ids, weights):
        if self.guess is not None:
            return self.inner(layer - self.offset, x, ids, weights, guess=self.guess)
        return self.inner(layer - self.offset, x, ids, weights)

    def stats(self) -> dict:
        return dict(getattr(self.inner, "stats", lambda: {})())

    def reset_stats(self) -> None:
        getattr(self.inner, "reset_stats", lambda: None)()

    def close(self) -> None:
        getattr(self.inner, "close", lambda: None)()


def stage_cache(spec, stage: Stage, max_len: int, device, dtype) -> KVCache:
    """A KV cache holding only this stage's layers (the others' entries are 1-row placeholders)."""
    cache = KVCache(spec, 1, device, dtype)
    for l in range(stage.first, stage.last):
        k, v = cache.k[l], cache.v[l]
        big = k.new_zeros(k.shape[0], max_len, k.shape[2])
        cache.v[l] = big[..., :v.shape[-1]] if v.data_ptr() == k.data_ptr() else v.new_zeros(v.shape[0], max_len,
                                                                                                v.shape[2])
        cache.k[l] = big
    cache.max_len = max_len
    return cache


def drop_others(model, stage: Stage, dtype: torch.dtype) -> None:
    """Removes what this stage never runs (left on the meta device by a stage's load): other layers'
    modules, the embedding table (all but the first stage), the final norm and lm_head (all but the
    last). model.dtype (lm_head's dtype) still answers."""
    layers = model.model.layers
    for l in range(len(layers)):
        if not stage.first <= l < stage.last:
            layers[l] = nn.Identity()
    if not stage.is_first:
        model.model.embed_tokens.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
    if not stage.is_last:
        model.lm_head.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        model.lm_head.bias = None
        model.model.norm = nn.Identity()


class StageModel:
    """This rank's loaded stage: the model's loop over its layers with its own provider. A drafting
    policy's stage also holds its layers' part of the speculation: `lookahead` (rows over its own MoE
    layers), `planner` (specter: prefetching its own layers' experts from those rows), `guessing`
    (specter's K = 0 steps: next-layer guesses within the stage) and `mgr`, the offload manager under
    them (None where the stage has no MoE layer). The first stage of a drafting policy also holds the
    whole draft (`whole`): every layer's non-expert weights, every MoE layer's INT4 experts (`draft`,
    recording into `whole_lookahead`, whose first rows' columns are its own `lookahead`) and a KV
    cache of every layer, so the K draft steps of a cycle cross no boundary (speculative.py)."""

    def __init__(self, model, provider, stage: Stage, device, dtype, plan=None, tokenizer=None, path=None):
        self.model, self.provider, self.stage = model, provider, stage
        self.device, self.dtype, self.plan, self.tokenizer, self.path = device, dtype, plan, tokenizer, path
        self.pieces = StagePieces(model, stage)
        self.cache: KVCache | None = None
        self.mgr = self.draft = self.planner = self.guessing = self.lookahead = self.whole_lookahead = None
        self.whole = False  # this stage holds the whole draft and a KV cache of every layer
        self.k_max = 0  # a drafting policy's longest draft (the wire's inline rows follow it)
        self.step_s = 0.0  # wall seconds in `forward` since reset_stats (stats: step_s)

    @property
    def all_resident(self) -> bool:
        """Nothing of this stage is ever copied (no MoE layer, every expert resident, or no offloading)."""
        return self.mgr is None or self.mgr.all_resident

    def begin(self, max_len: int) -> None:
        spec = self.model.spec
        self.cache = (KVCache(spec, max_len, self.device, self.dtype) if self.whole
                      else stage_cache(spec, self.stage, max_len, self.device, self.dtype))

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, start: int, experts=None, logits_for: str = "last") -> torch.Tensor:
        """Token ids [T] (first stage) or the hidden state [T, H] -> the hidden state [T, H], or fp32
        logits ([1, V] for "last", [T, V] for "all") on the last stage. `experts`: the provider to run
        (default the target's)."""
        if start + x.shape[0] > self.cache.max_len:
            raise IndexError(f"positions up to {start + x.shape[0]} exceed the KV cache ({self.cache.max_len})")
        t = time.perf_counter()
        try:
            return self.model.run(x, start, self.cache, self.provider if experts is None else experts, logits_for,
                                  pieces=self.pieces)
        finally:
            self.step_s += time.perf_counter() - t

    @torch.inference_mode()
    def draft_forward(self, tokens: torch.Tensor, start: int, logits_for: str = "last") -> torch.Tensor:
        """One step of the whole draft (`whole` only): token ids [T] -> fp32 logits, every layer run here
        with the INT4 experts, as the single-process draft runs."""
        if start + tokens.shape[0] > self.cache.max_len:
            raise IndexError(f"positions up to {start + tokens.shape[0]} exceed the KV cache ({self.cache.max_len})")
        return self.model.run(tokens, start, self.cache, self.draft, logits_for)

    def stats(self) -> dict:
        s = self.provider.stats() if self.provider is not None else {}
        s["step_s"] = self.step_s
        if self.planner is not None:
            s["cover_hits"], s["cover_total"] = self.planner.cover_hits, self.planner.cover_total
        return s

    def reset_stats(self) -> None:
        self.step_s = 0.0
        if self.provider is not None:
            self.provider.reset_stats()
        if self.planner is not None:
            self.planner.reset_stats()

    def close(self) -> None:
        if self.provider is not None:
            self.provider.close()


def kv_row_bytes(spec, dtype: torch.dtype) -> int:
    """Bytes of one layer's K/V at one position (MLA: the latent and its rotary key)."""
    n = spec.kv_lora_rank + spec.qk_rope_dim if spec.attention == "mla" else 2 * spec.n_kv_heads * spec.head_dim
    return n * dtype.itemsize


def kv_rows(cache: KVCache, spec, first: int, last: int, start: int, T: int) -> torch.Tensor:
    """Layers [first, last)'s K/V at positions [start, start+T), as bytes (layer by layer, k then v)."""
    parts = []
    for l in range(first, last):
        parts.append(cache.k[l][:, start:start + T].reshape(-1).view(torch.uint8))
        if spec.attention != "mla":  # MLA's v is a view of k
            parts.append(cache.v[l][:, start:start + T].reshape(-1).view(torch.uint8))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def put_kv_rows(cache: KVCache, spec, first: int, last: int, start: int, T: int, data: torch.Tensor) -> None:
    """Writes kv_rows' bytes `data` into `cache`."""
    o = 0
    for l in range(first, last):
        for t in (cache.k[l],) if spec.attention == "mla" else (cache.k[l], cache.v[l]):
            dst = t[:, start:start + T]
            n = dst.numel() * dst.element_size()
            dst.copy_(data[o:o + n].view(dst.dtype).view(dst.shape))
            o += n


def lookahead_columns(whole, n: int):
    """A Lookahead over the first `n` MoE layers of `whole`'s, sharing its rows (views)."""
    from ..speculative.draft import Lookahead

    la = Lookahead.__new__(Lookahead)
    la.__dict__.update(whole.__dict__)
    la.ids, la.weights, la.host = whole.ids[:, :n], whole.weights[:, :n], whole.host[:, :n]
    la.n_layers, la._events = n, [None] * whole.k_max
    return la


def load_stage(path, stage: Stage, device: torch.device, *, policy: str, residency=None, expert_memory=None,
               link=None, dtype=None, threads: int | None = None, k_max: int = 32, draft_cache=None,
               host_threads: int | None = None, draft_bits: int = 4, compress_experts: bool = False) -> StageModel:
    """Loads the checkpoint at `path` and keeps `stage` of it, with `policy`'s provider over its MoE
    layers: resident weights; or its own offload manager (on-demand), with next-layer guesses made
    within the stage (the last layer of a stage guesses nothing: the next layer is another rank's), or
    with the host lane computing every miss (host; `host_threads` sizes the lane, default `threads`,
    as builder.load's host_threads: also the opt-in to specter's lane on CUDA). The drafting
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
    from ..offload.policies import NextLayerPrefetch
    from ..offload.plan import compute_dtype, make_plan
    from ..offload.store import pin_wanted

    pol = get_policy(policy)
    from ..builder import check_draft_bits, check_host_threads

    check_draft_bits(draft_bits)
    if draft_bits != 4 and not pol.drafts:
        raise ConfigError(f"policy {policy!r} runs no draft, so draft_bits would be ignored; drop it")
    check_host_threads(policy, host_threads)
    ckpt = open_checkpoint(path)
    spec = ckpt.spec
    from ..builder import check_compressible

    check_compressible(ckpt, compress_experts)
    dt = compute_dtype(device, ckpt.dtype, dtype)
    plan = lk = None
    if not pol.offloads:
        if residency is not None or expert_memory is not None or link is not None:
            raise ConfigError(f"policy {policy!r} keeps every expert on the device, so a budget or --link would be "
                              "ignored; drop it or use --policy on-demand")
    else:
        own = expert_memory is not None
        if residency is None and expert_memory is None and device.type == "cuda":  # 90% of what is free,
            free, _ = torch.cuda.mem_get_info(device)                              # less the stage's own
            expert_memory = max(0, int(free * 0.9) - sum(stage_fixed_bytes(spec, stage, dt.itemsize)))
            own = True
        # the plan of the whole model; each rank's pool is sized from it (stage_pool)
        from ..offload.coded_tier import PLAN_RATIO

        plan = make_plan(spec, ckpt.numel(), dt, residency=residency, expert_memory=expert_memory,
                         draft=False, device=device, store_dtype=ckpt.dtype, compressed=compress_experts,
                         coded_tier=PLAN_RATIO if compress_experts and device.type == "cpu"
                         and pol.host_lane != "misses" else None)  # as builder.build_engine plans it
        pdt = getattr(torch, plan.pool_dtype)
        lk = make_link(device, link, calibration=dict(hidden=spec.hidden, intermediate=spec.expert_inter, dtype=dt,
                                                      storage=pdt))
    configure_threads(device, threads)
    whole = pol.drafts and stage.is_first and any(l in spec.moe_layer_ids for l in range(spec.n_layers))
    cached = None
    if whole:  # the draft cache holds every layer's draft experts: the other stages' experts are not read
        from ..speculative.draft_cache import cached_draft

        cached = cached_draft(ckpt.files.values(), spec.n_moe_layers, draft_cache, bits=draft_bits)
    pin = device.type == "cuda" and pin_wanted()
    entry = hits = None
    if compress_experts:  # this stage's layers of one process's coded cache
        from ..offload.coded import cache_entry, read_cached

        entry = cache_entry(ckpt.files.values(), draft_cache)
        hits = read_cached(entry, stage.moe_last - stage.moe_first, first=stage.moe_first)
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
        from ..offload.coded import coded_store

        mine = coded_store(mine, hits, entry, pin=pin, first=stage.moe_first)
        if device.type == "cpu" and pol.offloads and mine:  # coded copies and tier hits write from it (emulate_from)
            from ..offload.coded import emulate_from
            from ..offload.coded_tier import ROWS_MAX_BYTES

            raw_bytes = sum(layer.w13.raw_nbytes + layer.w2.raw_nbytes for layer in mine)
            if pol.host_lane or raw_bytes <= ROWS_MAX_BYTES:
                decoded = [layer.decoded() for layer in mine]
            emulate_from(mine, decoded)
        from ..builder import uses_host_lane

        if decoded is None and mine and uses_host_lane(pol, device, host_threads):  # a host lane computes from it
            decoded = [layer.decoded() for layer in mine]
    tokenizer = load_tokenizer(path) if stage.is_first else None
    provider = stage_layers = pdt = None
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

                attach_tier(inner, tier, lk, rows=decoded)
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
    from ..offload.policies import NextLayerPrefetch
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
