"""Wires a checkpoint, a device and a policy into an Engine."""
from __future__ import annotations

from pathlib import Path

import torch

from .engine import Engine, PlainDecoder
from .errors import ConfigError, NotAvailableError
from .loader import load_checkpoint, load_tokenizer, open_checkpoint
from .moe import ResidentExperts

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


def build_engine(path: Path, device: torch.device, *, policy: str, residency=None, expert_memory=None,
                 link=None, dtype=None, **options) -> Engine:
    if options:
        raise ConfigError(f"unknown option(s): {', '.join(sorted(options))}")
    if residency is not None and expert_memory is not None:
        raise ConfigError("give residency or expert_memory, not both")
    ckpt = open_checkpoint(path)
    if policy != "resident":
        raise NotAvailableError(f"policy {policy!r} is not available yet in this build; use policy='resident'")
    dt = compute_dtype(device, ckpt.dtype, dtype)
    model, experts, _ = load_checkpoint(path, device, dt)
    experts = [type(e)(e.w13.to(device), e.w2.to(device)) for e in experts]
    decoder = PlainDecoder(model, ResidentExperts(experts), device, dt)
    return Engine(model, experts, load_tokenizer(path), path=path, device=device, dtype=dt,
                  policy=policy, decoder=decoder)
