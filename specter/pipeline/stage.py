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

from itertools import repeat
from types import SimpleNamespace

import torch
from torch import nn

from ..errors import ConfigError
from ..layers import KVCache
from ..moe import ExpertWeights, ResidentExperts
from ..policy import get as get_policy
from .stages import Stage, stage_fixed_bytes, stage_pool, stage_quota


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
    policy's stage also holds its layers' part of the speculation: `draft` (the INT4 experts of its
    layers, recording their routers into its own `lookahead` rows), `planner` (specter: prefetching
    its own layers' experts from those rows), `guessing` (specter's K = 0 steps: next-layer guesses
    within the stage) and `mgr`, the offload manager under them (None where the stage has no MoE
    layer)."""

    def __init__(self, model, provider, stage: Stage, device, dtype, plan=None, tokenizer=None, path=None):
        self.model, self.provider, self.stage = model, provider, stage
        self.device, self.dtype, self.plan, self.tokenizer, self.path = device, dtype, plan, tokenizer, path
        self.pieces = StagePieces(model, stage)
        self.cache: KVCache | None = None
        self.mgr = self.draft = self.planner = self.guessing = self.lookahead = None

    @property
    def all_resident(self) -> bool:
        """Nothing of this stage is ever copied (no MoE layer, every expert resident, or no offloading)."""
        return self.mgr is None or self.mgr.all_resident

    def begin(self, max_len: int) -> None:
        self.cache = stage_cache(self.model.spec, self.stage, max_len, self.device, self.dtype)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, start: int, experts=None, logits_for: str = "last") -> torch.Tensor:
        """Token ids [T] (first stage) or the hidden state [T, H] -> the hidden state [T, H], or fp32
        logits ([1, V] for "last", [T, V] for "all") on the last stage. `experts`: the provider to run
        (default the target's)."""
        if start + x.shape[0] > self.cache.max_len:
            raise IndexError(f"positions up to {start + x.shape[0]} exceed the KV cache ({self.cache.max_len})")
        return self.model.run(x, start, self.cache, self.provider if experts is None else experts, logits_for,
                              pieces=self.pieces)

    def stats(self) -> dict:
        s = self.provider.stats() if self.provider is not None else {}
        if self.planner is not None:
            s["cover_hits"], s["cover_total"] = self.planner.cover_hits, self.planner.cover_total
        return s

    def reset_stats(self) -> None:
        if self.provider is not None:
            self.provider.reset_stats()
        if self.planner is not None:
            self.planner.reset_stats()

    def close(self) -> None:
        if self.provider is not None:
            self.provider.close()


def load_stage(path, stage: Stage, device: torch.device, *, policy: str, residency=None, expert_memory=None,
               link=None, dtype=None, threads: int | None = None, k_max: int = 32) -> StageModel:
    """Loads the checkpoint at `path` and keeps `stage` of it, with `policy`'s provider over its MoE
    layers: resident weights; or its own offload manager (on-demand), with next-layer guesses made
    within the stage (the last layer of a stage guesses nothing: the next layer is another rank's), or
    with the host lane computing every miss (host; `threads` also sizes the lane). The drafting
    policies add the stage's draft (its layers' experts quantised as the single-process draft's),
    a lookahead of `k_max` rows over its own MoE layers and, for specter, its planner, its host lane
    (LaneChoice over the planner's scores, on CPU as builder.uses_host_lane says) and its next-layer
    guesses for K = 0 steps."""
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
    ckpt = open_checkpoint(path)
    spec = ckpt.spec
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
        plan = make_plan(spec, ckpt.numel(), dt, residency=residency, expert_memory=expert_memory,
                         draft=False, device=device, store_dtype=ckpt.dtype)
        pdt = getattr(torch, plan.pool_dtype)
        lk = make_link(device, link, calibration=dict(hidden=spec.hidden, intermediate=spec.expert_inter, dtype=dt,
                                                      storage=pdt))
    configure_threads(device, threads)
    model, mine, _ = load_checkpoint(path, device, dt, pin_experts=device.type == "cuda" and pin_wanted(),
                                     layers=(stage.first, stage.last))  # this stage's tensors only
    drop_others(model, stage, dt)
    tokenizer = load_tokenizer(path) if stage.is_first else None
    provider = stage_layers = pdt = None
    if mine:
        resident = None
        if not pol.offloads or plan.pool_rows == "resident":
            resident = [ExpertWeights(e.w13.to(device, dt), e.w2.to(device, dt)) for e in mine]
        if not pol.offloads:
            inner = ResidentExperts(resident)
        else:
            pool = stage_pool(plan, spec, len(mine), own)
            inner = OffloadedExperts(mine, stage_quota(plan, spec, len(mine), pool), device, lk, eviction=pol.eviction,
                                     dtype=pdt, alias=plan.aliased, rows=resident, pool=pool)
            inner.warm()
        guess = None
        stage_layers = SimpleNamespace(model=SimpleNamespace(layers=model.model.layers[stage.first:stage.last]))
        if pol.host_lane == "misses" and not inner.all_resident:  # policy host: every miss computed on the host
            inner = HostExperts(inner, make_host_lane(mine, device, lk, threads=threads, dtype=dt, charged_dtype=pdt))
        elif pol.prefetch == "next-layer" and not inner.all_resident:  # guesses within the stage's own layers
            guess = NextLayerPrefetch(stage_layers, inner)
        provider = ShiftedExperts(inner, stage.moe_first, guess)
    elif lk is not None:
        lk.close()
    st = StageModel(model, provider, stage, device, dt, plan=plan, tokenizer=tokenizer, path=path)
    if pol.drafts and mine:
        _speculate(st, pol, mine, stage_layers, k_max, threads, lk, pdt)
    return st


def _speculate(st: StageModel, pol, mine: list, stage_layers, k_max: int, threads, lk, pdt) -> None:
    """A drafting policy's part on this stage (see load_stage), built as builder._decoder builds it
    for the whole model."""
    from ..builder import uses_host_lane
    from ..offload.host_lane import LaneChoice, host_params, make_host_lane
    from ..offload.policies import NextLayerPrefetch
    from ..speculative.draft import DraftExperts, Lookahead, keep_packed
    from ..speculative.draft_cache import draft_int4
    from ..speculative.draft import PrefetchPlanner

    spec, device, dt, stage = st.model.spec, st.device, st.dtype, st.stage
    mgr = st.mgr = st.provider.inner
    st.lookahead = Lookahead(max(k_max, 1), len(mine), spec.top_k, device)
    int4 = list(draft_int4(mine, [], device, cache="off"))  # the draft cache keys whole models' layers
    n = len(mine) * spec.n_experts * spec.expert_numel()
    st.draft = ShiftedExperts(DraftExperts(int4, st.lookahead, device, dt, packed=keep_packed(device, n, dt)),
                              stage.moe_first)
    if pol.prefetch != "planner":  # spec-lru: verification fetches on miss
        return
    st.planner = PrefetchPlanner(mgr, st.lookahead)
    every = mgr.all_resident
    if uses_host_lane(pol, device, None, every_expert=every):  # both lanes: the misses ranked low go to the host
        mgr.host_lane = make_host_lane(mine, device, lk, threads=threads, dtype=dt, charged_dtype=pdt)
        mgr.host_choice = LaneChoice(mgr, host_params(mgr.host_lane), planner=st.planner)
    if not mgr.all_resident:
        st.guessing = ShiftedExperts(mgr, stage.moe_first, NextLayerPrefetch(stage_layers, mgr))
