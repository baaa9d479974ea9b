"""Wires a checkpoint, a device and a policy into an Engine."""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch

from .engine import Engine, PlainDecoder
from .errors import ConfigError
from .loader import load_checkpoint, load_tokenizer, open_checkpoint
from .moe import ResidentExperts
from .offload.link import make_link
from .offload.manager import OffloadedExperts
from .offload.plan import make_plan
from .offload.oracle import OracleDecoder
from .offload.policies import NextLayerPrefetch
from .speculative.decoder import SpeculativeDecoder
from .speculative.draft import DraftExperts
from .speculative.governor import Governor
from .speculative.lookahead import Lookahead
from .speculative.planner import PrefetchPlanner

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def compute_dtype(device: torch.device, storage: torch.dtype, dtype=None) -> torch.dtype:
    """fp32 on CPU (exact, and what CPUs are fast at); the checkpoint's 16-bit dtype on CUDA."""
    if dtype is not None:
        if isinstance(dtype, str):
            if dtype not in _DTYPES:
                raise ConfigError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
            return _DTYPES[dtype]
        return dtype
    if device.type == "cpu":
        return torch.float32
    return storage if storage in (torch.float16, torch.bfloat16) else torch.bfloat16


def configure_threads(device: torch.device, threads: int | None) -> None:
    """CPU: leave one core to the emulated link's copy worker (and the OS); small decode matmuls gain
    nothing from more threads, and oversubscribed OpenMP pools are catastrophically slow."""
    if device.type == "cpu":
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 2) - 1))


def build_engine(path: Path, device: torch.device, *, policy: str, residency=None, expert_memory=None,
                 link=None, dtype=None, threads: int | None = None, eviction: str = "lru",
                 device_memory=None, k_max: int = 32, compile: bool | None = None, **options) -> Engine:
    if options:
        raise ConfigError(f"unknown option(s): {', '.join(sorted(options))}")
    if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 0:
        raise ConfigError(f"k_max must be an integer >= 0 (0 = no speculation), got {k_max!r}")
    if compile is not None and not isinstance(compile, bool):
        raise ConfigError(f"compile must be True, False or None (auto: on CUDA), got {compile!r}")
    ckpt = open_checkpoint(path)
    dt = compute_dtype(device, ckpt.dtype, dtype)
    configure_threads(device, threads)
    spec = ckpt.spec
    offload = policy != "resident"
    plan = None
    if offload:
        if residency is None and expert_memory is None and device_memory is None and device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            device_memory = int(free * 0.9)
        numel = ckpt.numel()
        plan = make_plan(spec, numel, dt, residency=residency, expert_memory=expert_memory,
                         device_memory=device_memory, draft=policy in ("spec-lru", "specter"))
    model, experts, _ = load_checkpoint(path, device, dt, pin_experts=offload and device.type == "cuda")
    tokenizer = load_tokenizer(path)
    if not offload:
        experts = [type(e)(e.w13.to(device), e.w2.to(device)) for e in experts]
        decoder = PlainDecoder(model, ResidentExperts(experts), device, dt)
    else:
        lk = make_link(device, link, calibration=(spec.hidden, spec.expert_inter, dt))
        mgr = OffloadedExperts(experts, plan.slots_per_layer, device, lk, eviction=eviction)
        mgr.warm()
        decoder = _decoder(policy, model, mgr, experts, device, dt, k_max)
        if hasattr(decoder, "draft"):
            decoder.draft_step = _draft_step(model, decoder.draft, compile, device)
    engine = Engine(model, experts, tokenizer, path=path, device=device, dtype=dt, policy=policy, decoder=decoder)
    engine.plan = plan
    return engine


def _draft_step(model, draft, compile: bool | None, device: torch.device):
    """The sync-free draft step the speculative decoder runs, or None for the eager draft.

    CUDA: compiled with CUDA graphs unless compile=False (a compile that fails at load falls back
    to the eager draft with a warning when compile was not asked for explicitly). CPU: only with
    compile=True -- measured (bench/compile_speedup.py), the compiled step makes decode 9% faster
    at 25% residency and 28% at 50%, for a 20-60 s compile at every load on two cores; a CLI that
    loads per command loses more than it gains, so it is not the CPU default. The sync-free step
    run eagerly is no win on CPU either (0.94-1.09x the eager draft's TPOT: it attends over the
    whole static cache)."""
    if compile is False or (compile is None and device.type != "cuda"):
        return None
    print("specter: compiling the draft step (torch.compile; once per load, Inductor caches it)",
          file=sys.stderr, flush=True)
    try:
        return _compiled_draft_step(model, draft)
    except Exception as e:  # noqa: BLE001 -- auto mode must never stop a load that works eagerly
        if compile:
            raise
        warnings.warn(f"compiling the draft step failed ({type(e).__name__}: {e}); drafting eagerly")
        return None


def _compiled_draft_step(model, draft, compile: bool = True):
    from specter.compiled.draft_step import DraftStep, draft_layers

    step = DraftStep(model, draft_layers(draft), draft.lookahead, compile=compile)
    step.warmup()
    return step


def _decoder(policy, model, mgr, experts, device, dt, k_max):
    """The decode loop each policy runs; all of them share the model and the offload manager."""
    if policy == "on-demand":
        return PlainDecoder(model, mgr, device, dt)
    if policy == "next-layer":
        mgr.next_layer_router = NextLayerPrefetch(model, mgr)
        return PlainDecoder(model, mgr, device, dt)
    if policy == "oracle":
        resident = ResidentExperts([type(e)(e.w13.to(device), e.w2.to(device)) for e in experts])
        return OracleDecoder(model, mgr, resident, device, dt)
    spec = model.spec
    lookahead = Lookahead(k_max, spec.n_moe_layers, spec.top_k, device)
    draft = DraftExperts(experts, lookahead, device, dt, packed=device.type == "cuda")
    if policy == "spec-lru":  # speculation alone: same governor, experts fetched when verification needs them
        return SpeculativeDecoder(model, mgr, draft, device, dt, governor=Governor(k_max))
    return SpeculativeDecoder(model, mgr, draft, device, dt, governor=Governor(k_max),
                              planner=PrefetchPlanner(mgr, lookahead), fallback=NextLayerPrefetch(model, mgr))
