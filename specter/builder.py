"""Wires a checkpoint, a device and a policy into an Engine."""
from __future__ import annotations

import copy
import difflib
import functools
import inspect
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from .engine import Engine
from .errors import BudgetError, ConfigError, NotAvailableError, warn
from .generation_defaults import read_generation_defaults
from .layers import cuda_attention_backends
from .loader import Checkpoint, StoredExperts, load_checkpoint, load_tokenizer, open_checkpoint
from .model import MoETransformer
from .moe import ExpertWeights, ResidentExperts
from .offload.coded import cache_entry, coded_ratio, coded_store, emulate_from, read_cached, ready_on_cuda
from .offload.coded_tier import attach as attach_tier, emulation_rows, plan_tier
from .offload.host_experts import HostExperts
from .offload.host_lane import LaneChoice, host_params, make_host_lane
from .offload.cuda_link import make_link
from .offload.manager import OffloadedExperts
from .offload.calibrate import load_profile
from .offload.plan import (check_budget, check_context, check_device_room, compute_dtype, draft_widths, make_plan,
                           pool_dtype, verify_scratch)
from .offload.slots import POLICIES as EVICTIONS
from .offload.store import pin_wanted
from .offload.threads import cuda_device
from .offload.oracle import OracleDecoder
from .policy import DEFAULT_K_MAX, Policy, get as get_policy
from .speculative.decoder import PlainDecoder, SpeculativeDecoder
from .speculative.draft import DraftExperts, Lookahead, keep_packed
from .speculative.draft_cache import check_packable, draft_along, draft_entry, draft_int4
from .speculative.governor import Governor
from .speculative.draft import NextLayerPrefetch, PrefetchPlanner
from .triton_ops import fused_moe


def configure_threads(device: torch.device, threads: int | None) -> None:
    """CPU: leave one core to the emulated link's copy worker (and the OS); small decode matmuls gain
    nothing from more threads, and oversubscribed OpenMP pools are catastrophically slow."""
    if device.type == "cpu":
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 2) - 1))


_THREADS_LOCK = threading.Lock()
_THREADS_HELD = {"engines": 0, "before": None}  # open CPU engines, and torch's threads before the first


def hold_threads(device: torch.device):
    """CPU: torch's threads are process-wide, and configure_threads sets them for an engine. Called before
    it, this remembers what they were when no engine was open, and returns the release an engine calls
    when it closes: the last one to close puts them back (a user's torch.set_num_threads survives load and
    close). Engines loaded at once with different `threads` run with the last one's. Elsewhere: a no-op."""
    if device.type != "cpu":
        return lambda: None
    with _THREADS_LOCK:
        if _THREADS_HELD["engines"] == 0:
            _THREADS_HELD["before"] = torch.get_num_threads()
        _THREADS_HELD["engines"] += 1
    held = {"open": True}

    def release() -> None:  # (once: close() and a dropped engine's finalizer may both call it)
        with _THREADS_LOCK:
            if not held["open"]:
                return
            held["open"] = False
            _THREADS_HELD["engines"] -= 1
            if _THREADS_HELD["engines"] == 0:
                torch.set_num_threads(_THREADS_HELD["before"])
    return release


def holding_threads(build):
    """`build(path, device, ..., on_close=)` given hold_threads' release, which the engine it returns calls
    when it closes, and which is called here if the build fails."""
    @functools.wraps(build)
    def run(path, device, *args, **kwargs):
        release = hold_threads(device)
        try:
            return build(path, device, *args, **{**kwargs, "on_close": release})
        except BaseException:
            release()
            raise
    return run


def on_its_device(build):
    """`build(path, device, ...)` run with `device` the current CUDA device (offload/threads.py): what its
    Triton launches, graph captures, streams and offload threads then use, on `cuda:N` as on device 0."""
    @functools.wraps(build)
    def run(path, device, *args, **kwargs):
        with cuda_device(device):
            return build(path, device, *args, **kwargs)
    return run


@dataclass
class Loaded:
    """One checkpoint loaded once: what every engine over it shares (`specter bench` builds all its
    policies on one). The store is the only host copy of the routed experts; the draft is quantised
    at most once."""

    path: Path
    ckpt: Checkpoint
    device: torch.device
    dtype: torch.dtype               # compute dtype
    model: MoETransformer
    store: list[ExpertWeights]       # host, the checkpoint's dtype (pinned in place on CUDA); with
    tokenizer: object                # compress_experts, CodedLayer per layer (offload/coded.py)
    draft_cache: str | None = None   # None: $SPECTER_DRAFT_CACHE or the user cache; "off": none
    draft: DraftExperts | None = None
    draft_bits: int = 4              # the draft experts' code width (4, 3 or 2)
    resident: list[ExpertWeights] | None = None  # every expert on the device in the compute dtype (resident_experts)
    compressed: bool = False         # the store is losslessly coded (compress_experts)
    raw: list[ExpertWeights] | None = None  # compressed only: the raw store a host lane reads (host_rows)

    def decoded_store(self):
        """The store as bf16 ExpertWeights: itself, or (compressed) the raw copy if one is kept, else the
        checkpoint's experts read a layer at a time as they are indexed, nothing kept (loader.StoredExperts:
        the draft's quantisation, resident_experts)."""
        if not self.compressed:
            return self.store
        return self.raw if self.raw is not None else StoredExperts(self.ckpt)

    def host_rows(self) -> list[ExpertWeights]:
        """What a host lane computes from: the store, or (compressed) the raw experts, read from the
        checkpoint once and kept: the lane reads experts in place at memory speed, which a decode per
        job would not (and reading is faster than decoding the coded store)."""
        if not self.compressed:
            return self.store
        if self.raw is None:
            self.raw = list(StoredExperts(self.ckpt))
        return self.raw

    def resident_experts(self) -> list[ExpertWeights]:
        """Every routed expert on the device in the compute dtype, made once and shared: the resident
        policy's weights, the oracle's, and what a CPU budget holding every expert computes on when
        the store is narrower (tensors of the store itself where no conversion or move is needed)."""
        if self.resident is None:
            store, spec = self.decoded_store(), self.ckpt.spec
            # CPU, past POOL_UPCAST_MIN_BYTES: a narrower store's rows as they are, as a pool reads them then
            # (plan.pool_dtype: the torch backend converts each expert it runs, exactly), not a second copy
            dt = pool_dtype(self.device, self.ckpt.dtype, self.dtype, spec.n_moe_layers * spec.n_experts,
                            spec.expert_numel())
            self.resident = [ExpertWeights(e.w13.to(self.device, dt), e.w2.to(self.device, dt)) for e in store]
        return self.resident


@on_its_device
def load_shared(path: Path, device: torch.device, *, dtype=None, threads: int | None = None,
                draft_cache=None, compress_experts: bool = False, draft_bits: int = 4,
                keep_raw: bool = False, drafts: bool = False) -> Loaded:
    """`compress_experts`: the store is coded losslessly (offload/coded.py; bf16 only), read from its
    on-disk cache when every layer is there (no expert read from the checkpoint), else coded as it
    loads and cached (`draft_cache` places or disables the cache, as the draft's). Hints from the engine
    to be built, so that a coded load reads the experts once: `keep_raw`, it keeps the raw copy (keeps_raw):
    read first, and the layers the cache misses are coded from it; else `drafts`, it quantises a draft:
    each layer read to be coded is quantised into the draft cache too (draft_cache.draft_along)."""
    ckpt = open_checkpoint(path)
    check_compressible(ckpt, compress_experts)
    check_draft_bits(draft_bits)
    dt = compute_dtype(device, ckpt.dtype, dtype)
    tokenizer = load_tokenizer(path)  # a broken one fails before the weights load, not after
    configure_threads(device, threads)
    pin = device.type == "cuda" and pin_wanted()
    raw = None
    if not compress_experts:
        model, store, _ = load_checkpoint(path, device, dt, pin_experts=pin)
    else:
        entry = cache_entry(ckpt.files.values(), draft_cache)
        cached = read_cached(entry, ckpt.spec.n_moe_layers, ckpt.spec.expert_shapes())
        model, _, _ = load_checkpoint(path, device, dt, experts=False)  # a layer the cache misses: read, coded
        raw = list(StoredExperts(ckpt)) if keep_raw else None  # (the raw copy: Loaded.host_rows)
        also = draft_along(ckpt.files.values(), device, draft_cache, draft_bits) \
            if drafts and raw is None and any(c is None for c in cached) else None  # (a layer to code: read)
        store = coded_store(StoredExperts(ckpt) if raw is None else raw, cached, entry, cuda=device.type == "cuda",
                            pin=pin, also=also)  # one by one
        if device.type == "cuda":
            ready_on_cuda(store, device)
    return Loaded(Path(path), ckpt, device, dt, model, store, tokenizer, draft_cache,
                  compressed=bool(compress_experts), draft_bits=draft_bits, raw=raw)


def check_draft_bits(draft_bits) -> None:
    if isinstance(draft_bits, bool) or draft_bits not in (4, 3, 2):
        raise ConfigError(f"draft_bits must be 4, 3 or 2 (the draft experts' code width), got {draft_bits!r}")


def _plans(spec, numel: int, dt, bits: int, planned: dict) -> bool:
    try:
        make_plan(spec, numel, dt, draft_bits=bits, **planned)
        return True
    except BudgetError:
        return False


def check_compressible(ckpt: Checkpoint, compress_experts) -> None:
    """compress_experts is a bool, and the checkpoint bf16 when it is set."""
    if not isinstance(compress_experts, bool):
        raise ConfigError(f"compress_experts must be True or False, got {compress_experts!r}")
    if compress_experts and ckpt.dtype != torch.bfloat16:
        raise ConfigError(f"compress_experts codes bf16 checkpoints losslessly; this one stores "
                          f"{str(ckpt.dtype)[6:]} (fp16 and fp32 are not supported): load it without "
                          f"compress_experts (--compress-experts)")


def check_has_experts(ckpt: Checkpoint, policy: str) -> None:
    """An offloading policy needs routed experts: a model with no MoE layer has none to offload or draft."""
    if get_policy(policy).offloads and ckpt.spec.n_moe_layers == 0:
        raise ConfigError(f"{ckpt.path} has no MoE layer (its config routes no layer to experts), so policy "
                          f"{policy!r} has nothing to offload: run it with policy 'resident' (--policy resident)")


def plan_engine(pol: Policy, ckpt: Checkpoint, device: torch.device, dt: torch.dtype, *, residency=None,
                expert_memory=None, device_memory=None, context: int, k_max: int = DEFAULT_K_MAX,
                compile: bool | None = None, compress_experts: bool = False, draft_bits: int = 4,
                slot_pool: str = "shared"):
    """An offloading policy's plan from the checkpoint's headers alone, and make_plan's arguments (the
    engine plans again at the coded store's measured ratio); (None, None) for a policy that does not
    offload. Bench calls it for every policy before its one load, so a budget too small fails first.
    On CUDA with no budget: 90% of the free memory; a plan the free memory cannot hold is refused."""
    if not pol.offloads:
        return None, None
    spec = ckpt.spec
    drafts = pol.makes_draft(k_max)
    if residency is None and expert_memory is None and device_memory is None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        device_memory = int(free * 0.9)
    planned = dict(residency=residency, expert_memory=expert_memory, device_memory=device_memory,
                   context=context, draft=drafts, device=device, store_dtype=ckpt.dtype,
                   compressed=compress_experts, pool=slot_pool,
                   coded_tier=plan_tier(pol, device, dt, compress_experts),
                   kv_scratch=verify_scratch(pol, device, compile, k_max))
    try:
        plan = make_plan(spec, ckpt.numel(), dt, draft_bits=draft_bits, **planned)
    except BudgetError as e:  # a narrower draft may leave the pool its top-k (plan --device-memory picks one)
        if not drafts or device_memory is None:
            raise
        fits = [b for b in draft_widths(spec) if b < draft_bits and _plans(spec, ckpt.numel(), dt, b, planned)]
        if not fits:
            raise
        raise BudgetError(f"{e}; or a narrower draft: draft_bits (--draft-bits) {' or '.join(map(str, fits))} "
                          f"fits") from None
    if device.type == "cuda":
        check_device_room(plan, torch.cuda.mem_get_info(device)[0])
    return plan, planned


def check_load_options(pol: Policy, *, residency=None, expert_memory=None, device_memory=None, link=None,
                       k_max: int = DEFAULT_K_MAX, host_threads: int | None = None) -> None:
    """The load options that need no checkpoint, checked before anything loads (bench's one load for every
    policy included): the budget (offloading policies), the link profile's name, k_max, host_threads."""
    pol.check_host_threads(host_threads)
    if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 0:
        raise ConfigError(f"k_max must be an integer >= 0 (0 = no speculation), got {k_max!r}")
    if pol.offloads:
        check_budget(residency, expert_memory, device_memory)
        if link is not None:
            load_profile(link)  # an unknown name: UnknownProfileError, with the names there are


@on_its_device
@holding_threads
def build_engine(path: Path, device: torch.device, *, policy: str, residency=None, expert_memory=None,
                 link=None, dtype=None, threads: int | None = None, eviction: str | None = None,
                 device_memory=None, k_max: int = DEFAULT_K_MAX, compile: bool | None = None,
                 shared: Loaded | None = None,
                 draft_cache=None, host_threads: int | None = None,
                 compress_experts: bool = False, draft_bits: int = 4, slot_pool: str = "shared",
                 context: int | None = None, on_close=None, **options) -> Engine:
    """An engine for `policy` (a name in specter/policy.py's table). `shared`: a checkpoint already
    loaded (load_shared) to build on instead of loading it again; its store, model and draft are
    reused, never copied. `host_threads`: the host lane's threads (policies with a host lane, see
    uses_host_lane; default: physical cores less one). `eviction`: the slot cache's rule (default:
    the policy's). `slot_pool`: "shared" (one expert pool for every layer) or "layer" (its per-layer rule)."""
    pol = get_policy(policy)
    if options:
        known = [n for n, p in inspect.signature(build_engine).parameters.items()
                 if p.kind is p.KEYWORD_ONLY and n not in ("policy", "shared", "on_close")]
        near = [m for n in options for m in difflib.get_close_matches(n, known, n=1)]
        raise ConfigError(f"unknown option(s): {', '.join(sorted(options))}"
                          + (f" (did you mean {', '.join(near)}?)" if near else "")
                          + f"; specter.load takes model, device, policy and {', '.join(known)}")
    check_load_options(pol, residency=residency, expert_memory=expert_memory, device_memory=device_memory,
                       link=link, k_max=k_max, host_threads=host_threads)
    drafts = pol.makes_draft(k_max)  # k_max 0 never drafts: no draft is quantised, planned or held
    if eviction is not None and eviction not in EVICTIONS:
        raise ConfigError(f"eviction must be one of {', '.join(EVICTIONS)} (the slot cache's rule), got {eviction!r}")
    if compile is not None and not isinstance(compile, bool):
        raise ConfigError(f"compile must be True, False or None (auto: on CUDA), got {compile!r}")
    if shared is not None and Path(path).resolve() != shared.path.resolve():
        raise ConfigError(f"shared: {shared.path} was loaded, but {path} was asked for")
    ckpt = shared.ckpt if shared is not None else open_checkpoint(path)
    check_has_experts(ckpt, policy)
    check_compressible(ckpt, compress_experts)
    if shared is not None and shared.compressed != compress_experts:
        raise ConfigError(f"shared: its store was loaded with compress_experts={shared.compressed}, but "
                          f"compress_experts={compress_experts} was asked for")
    check_draft_bits(draft_bits)
    if drafts:  # a width the experts cannot pack: refused here, not once the load reaches the draft
        check_packable(draft_bits, ckpt.spec.hidden, ckpt.spec.expert_inter)
    if shared is not None and shared.draft_bits != draft_bits:
        raise ConfigError(f"shared: its draft is {shared.draft_bits}-bit, but draft_bits={draft_bits} was asked for")
    defaults = read_generation_defaults(path)  # a malformed file fails before the weights load
    if shared is None and draft_cache is not None and drafts:  # a named cache that cannot be written: refused
        draft_entry(ckpt.files.values(), draft_cache, draft_bits)  # before the load (the
        # coded store's, load_shared's cache_entry, is checked before it reads a weight too)
    dt = shared.dtype if shared is not None else compute_dtype(device, ckpt.dtype, dtype)
    if device.type == "cuda":
        cuda_attention_backends()
    spec = ckpt.spec
    context = check_context(context, spec)
    plan, planned = plan_engine(pol, ckpt, device, dt, residency=residency, expert_memory=expert_memory,
                                device_memory=device_memory, context=context, k_max=k_max, compile=compile,
                                compress_experts=compress_experts, draft_bits=draft_bits, slot_pool=slot_pool)
    # every expert a slot: so too after the tier is split at the store's measured ratio below (tier_split)
    every_slot = plan is not None and plan.pool_slots >= spec.n_moe_layers * spec.n_experts
    if compress_experts and pol.offloads and shared is None and every_slot:  # (shared: bench's runs, whose
        # sweep may hold every expert)
        warn(f"compress_experts (--compress-experts): every expert has a slot in this budget, so {policy} copies "
             f"none and the coded store only costs its encoding; give a smaller budget or drop it")
    if pol.offloads:
        pdt = getattr(torch, plan.pool_dtype)
        if shared is None:  # calibrated on the threads it decodes with (load_shared sets them too, later)
            configure_threads(device, threads)
        # calibrating allocates a working set of experts: before the store exists, not beside it
        lk = make_link(device, link, calibration=dict(hidden=spec.hidden, intermediate=spec.expert_inter, dtype=dt,
                                                      storage=pdt))
    if shared is None:
        # what the engine will read beside a coded store (a raw copy, or the checkpoint for its draft), so
        # that the load reads each expert once
        raw_bytes = spec.n_moe_layers * spec.n_experts * spec.expert_numel() * ckpt.dtype.itemsize
        shared = load_shared(path, device, dtype=dt, threads=threads, draft_cache=draft_cache,
                             compress_experts=compress_experts, draft_bits=draft_bits, drafts=drafts,
                             keep_raw=compress_experts and keeps_raw(pol, device, host_threads, raw_bytes, every_slot))
    model, store = shared.model, shared.store
    if plan is not None and planned["coded_tier"] is not None:  # the tier split at the store's measured ratio, as
        planned["coded_tier"] = coded_ratio(store)                # `specter plan` splits it (PLAN_RATIO before)
        plan = make_plan(spec, ckpt.numel(), dt, draft_bits=draft_bits, **planned)
        pdt = getattr(torch, plan.pool_dtype)
    if compress_experts and device.type == "cpu" and pol.offloads:  # coded copies: from a decoded copy if kept
        emulate_from(store, emulation_rows(shared))
    graphed = moe_graphs(device, compile)
    if not pol.offloads:
        experts = shared.resident_experts()
        resident = ResidentExperts(experts) if graphed is None else ResidentExperts(experts, graphed.fused_moe)
        decoder = PlainDecoder(model, resident, device, dt, step=_compiled_steps(model, None, compile, device, 0)[1])
    else:
        experts = store
        every = plan.pool_slots >= spec.n_moe_layers * spec.n_experts
        pool_rows = shared.resident_experts() if plan.pool_rows == "resident" else None
        mgr = OffloadedExperts(store, plan.slots_per_layer, device, lk, eviction=eviction or pol.eviction, dtype=pdt,
                               alias=plan.aliased, rows=pool_rows, pool=plan.pool_slots)
        if graphed is not None:
            mgr.expert_rows, mgr.fused_moe = graphed, graphed.fused_moe
        if plan.tier_bytes:  # the compressed device tier (CPU: emulated, its decode charged from the profile)
            attach_tier(mgr, plan.tier_bytes, lk)  # (CPU: its hits write from emulate_from's rows, as copies)
        mgr.warm()
        if uses_host_lane(pol, device, host_threads, every_expert=every):  # misses may compute where the store holds them
            lane = make_host_lane(shared.host_rows(), device, lk, threads=host_threads, dtype=dt, charged_dtype=pdt)
            if pol.host_lane == "misses":
                mgr = HostExperts(mgr, lane)
            else:  # "split": LaneChoice (ranked by the planner, in _decoder) picks which misses the host computes
                mgr.host_lane = lane
        decoder = _decoder(pol, shared, mgr, k_max, compile, graphed)
    engine = Engine(model, experts, shared.tokenizer, path=path, device=device, dtype=dt, policy=policy,
                    decoder=decoder, generation_defaults=defaults, plan=plan, shared=shared, context=context,
                    on_close=on_close)
    return engine


def moe_graphs(device: torch.device, compile: bool | None):
    """CUDA, unless compile=False or SPECTER_MOE_GRAPHS=0: a GraphedRows, so each MoE call's launches
    replay from a CUDA graph (triton_ops/graphed.py: the same kernels, the same bits); else None."""
    if device.type != "cuda" or compile is False or os.environ.get("SPECTER_MOE_GRAPHS", "1") == "0":
        return None
    from specter.triton_ops.graphed import GraphedRows

    return GraphedRows()


def keeps_raw(pol: Policy, device: torch.device, host_threads: int | None, raw_bytes: int,
              every_expert: bool = False) -> bool:
    """Whether an engine of `pol` over a coded store keeps a raw copy of its experts beside it
    (Loaded.host_rows; a pipeline rank's, pipeline.plan.raw_copy): for its host lane, and on CPU for coded
    copies to write from, up to ROWS_MAX_BYTES (coded_tier.emulation_rows)."""
    from .offload.coded_tier import ROWS_MAX_BYTES  # (when called, as emulation_rows reads it)

    return pol.offloads and (uses_host_lane(pol, device, host_threads, every_expert)
                             or (device.type == "cpu" and raw_bytes <= ROWS_MAX_BYTES))


def uses_host_lane(policy: Policy | str, device: torch.device, host_threads: int | None = None,
                   every_expert: bool = False) -> bool:
    """Whether `policy` computes experts on the host lane on `device` (Policy.computes_on_host)."""
    pol = get_policy(policy) if isinstance(policy, str) else policy
    return pol.computes_on_host(device.type, host_threads, every_expert)


def _compiled_steps(model, draft, compile: bool | None, device: torch.device, k_max: int):
    """(draft step, verify step) the speculative decoder runs, or (None, None) for eager ones; for a
    plain decoder (draft None) (None, its one-token step: the verifier at width 1, k_max 0).

    CUDA: compiled with CUDA graphs unless compile=False (a compile that fails at load falls back
    to the eager steps with a warning when compile was not asked for explicitly). CPU: only with
    compile=True: the compile runs at every load, which a CLI that loads per command pays each time
    for a modest gain on a short generation, so it is not the CPU default (figures:
    docs/RESULTS.md, bench/compile_speedup.py)."""
    if compile is False or (compile is None and device.type != "cuda"):
        return None, None
    what = "the one-token step" if draft is None else "the draft step and the verifier"
    print(f"specter: compiling {what} (torch.compile; once per load, Inductor caches it)", file=sys.stderr,
          flush=True)
    try:
        if draft is None:
            return None, _compiled_verify_step(model, 0)
        return _compiled_draft_step(model, draft), _compiled_verify_step(model, k_max)
    except Exception as e:  # noqa: BLE001 -- auto mode must never stop a load that works eagerly
        why = next((line.strip() for line in str(e).splitlines() if line.strip()), "")[:300]
        if compile:  # asked for: refused in one line (Inductor's own error is ~100 lines: a missing C++ compiler)
            raise NotAvailableError(f"compile=True (--compile): compiling {what} failed ({type(e).__name__}: {why}); "
                                    f"fix that (a C++ compiler on CPU) or load without it") from e
        warn(f"compiling {what} failed ({type(e).__name__}: {why}); decoding eagerly")
        return None, None


def _compiled_draft_step(model, draft, compile: bool = True):
    from specter.compiled.draft_step import DraftStep, draft_layers

    step = DraftStep(model, draft_layers(draft), draft.lookahead, compile=compile)
    step.warmup()
    return step


def _compiled_verify_step(model, k_max: int, compile: bool = True):
    from specter.compiled.verify_step import VerifyStep

    step = VerifyStep(model, k_max, compile=compile)
    step.warmup()
    return step


def _decoder(policy: Policy, shared: Loaded, mgr, k_max, compile: bool | None = None, graphed=None):
    """The decode loop each policy runs (its record's decoder and prefetch), with its collaborators;
    all of them share the model and the offload manager (and `graphed`, a GraphedRows, on CUDA)."""
    model, device, dt = shared.model, shared.device, shared.dtype
    if policy.decoder == "plain":
        guess = None
        if policy.prefetch == "next-layer" and not mgr.all_resident:  # all resident: nothing to prefetch
            guess = NextLayerPrefetch(model, mgr)
        step = _compiled_steps(model, None, compile, device, 0)[1]
        return PlainDecoder(model, mgr, device, dt, guess=guess, step=step)
    if policy.decoder == "oracle":
        resident = ResidentExperts(shared.resident_experts())
        return OracleDecoder(model, mgr, resident, device, dt)
    spec = model.spec
    lookahead = Lookahead(k_max, spec.n_moe_layers, spec.top_k, device)
    if k_max:
        draft = _draft(shared, lookahead)
        draft.fused_moe = fused_moe if graphed is None else graphed.fused_moe  # eager drafting (penalties) replays too
        draft_step, verify_step = _compiled_steps(model, draft, compile, device, k_max)
    else:  # the governor never drafts: plain steps (and both lanes), the one-token step compiled
        draft, (draft_step, verify_step) = None, _compiled_steps(model, None, compile, device, 0)
    steps = dict(governor=Governor(k_max), draft_step=draft_step, verify_step=verify_step)
    if policy.prefetch != "planner":  # speculation alone: same governor, experts fetched when verification needs them
        return SpeculativeDecoder(model, mgr, draft, device, dt, **steps)
    planner = PrefetchPlanner(mgr, lookahead)
    if mgr.host_lane is not None:  # both lanes: the misses the planner ranks low go to the host
        mgr.host_choice = LaneChoice(mgr, host_params(mgr.host_lane), planner=planner)
    return SpeculativeDecoder(model, mgr, draft, device, dt, planner=planner,
                              fallback=NextLayerPrefetch(model, mgr), **steps)


def _draft(shared: Loaded, lookahead: Lookahead) -> DraftExperts:
    """The shared draft's INT4 experts (quantised on first use) behind this engine's own lookahead."""
    if shared.draft is None:
        int4 = draft_int4(shared.decoded_store(), shared.ckpt.files.values(), shared.device, cache=shared.draft_cache,
                          bits=shared.draft_bits)
        spec = shared.ckpt.spec
        n = spec.n_moe_layers * spec.n_experts * spec.expert_numel()
        packed = keep_packed(shared.device, n, shared.dtype)
        shared.draft = DraftExperts(int4, lookahead, shared.device, shared.dtype, packed=packed)
        return shared.draft
    draft = copy.copy(shared.draft)  # shares the quantised weights; lookahead and row are per engine
    draft.lookahead, draft.row = lookahead, None
    return draft
