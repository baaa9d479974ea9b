"""Specter: lossless speculative expert offloading for Mixture-of-Experts language models.

    import specter
    engine = specter.load()                      # the bundled default model, on CUDA if present
    out = engine.generate("def add(a, b):", max_new_tokens=32)
    print(out.text, out.stats["tpot_s"])
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import (BudgetError, CheckpointError, ConfigError, ContextLengthError, NotAvailableError,
                     SpecterError, TokenizerError, UnsupportedModelError)
from .policy import BENCH_POLICIES, DEFAULT as DEFAULT_POLICY, POLICIES, get as get_policy, names as policy_names

if TYPE_CHECKING:  # (imported on first use: __getattr__)
    from .engine import Engine, GenerationOutput

__version__ = "0.1.0"
__all__ = ["load", "default_model_path", "Engine", "GenerationOutput", "POLICIES", "SpecterError",
           "CheckpointError", "ConfigError", "ContextLengthError", "BudgetError", "TokenizerError",
           "UnsupportedModelError", "NotAvailableError"]



def __getattr__(name: str):
    """Engine and GenerationOutput, and the submodules (`specter.sizes`), imported on first use: `import
    specter` (and the console script's first import, console.py) does not import torch."""
    import importlib

    if name in ("Engine", "GenerationOutput"):
        return getattr(importlib.import_module(".engine", __name__), name)
    if name.startswith("__"):  # (probes: __wrapped__, __path__ ...)
        raise AttributeError(f"module 'specter' has no attribute {name!r}")
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":  # a submodule's own missing import: its error
            raise
        raise AttributeError(f"module 'specter' has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"Engine", "GenerationOutput"})

def default_model_path() -> Path:
    """Directory of the bundled default model (package data: a wheel carries it)."""
    return Path(__file__).resolve().parent / "default_model"


def resolve_device(device: str | None):
    import torch

    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} was asked for but no CUDA GPU is available; use device 'cpu' "
                          f"(--device cpu)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= (n := torch.cuda.device_count()):
        raise ConfigError(f"device {device!r} was asked for but this machine has {n} CUDA GPU{'s' * (n != 1)} "
                          f"(cuda:0" + (f" to cuda:{n - 1})" if n > 1 else ")"))
    return dev


# load() options only some policies read (the Policy field that says which), and what the others do instead
READ_BY = {"residency": "offloads", "expert_memory": "offloads", "device_memory": "offloads", "k_max": "drafts",
           "link": "offloads", "compress_experts": "offloads", "draft_bits": "drafts", "host_threads": "host_lane"}
INSTEAD = {"offloads": "keeps every expert on the device", "drafts": "does not draft",
           "host_lane": "computes no expert on the host"}


def refuse_unused(policies: str | list[str], **options) -> None:
    """An option (READ_BY) that the policy would ignore (or every policy of a bench's run): a ConfigError
    naming the policies that read it; and draft_bits with k_max 0, which makes no draft."""
    policies = [policies] if isinstance(policies, str) else list(policies)
    pols = [get_policy(p) for p in policies]
    for k, v in options.items():
        if v is not None and not any(getattr(pol, field := READ_BY[k]) for pol in pols):
            who = f"policy {policies[0]!r} {INSTEAD[field]}" if len(pols) == 1 else \
                f"none of the policies {', '.join(policies)} reads it"
            raise ConfigError(f"{who}, so {k}={v!r} would be ignored; drop it, or pick a policy that reads it "
                              f"({', '.join(policy_names(field))})")
    if options.get("k_max") == 0 and options.get("draft_bits") is not None:
        raise ConfigError(f"k_max=0 makes no draft, so draft_bits={options['draft_bits']!r} would be ignored; drop one")


def load(model: str | Path | None = None, device: str = "auto", policy: str = DEFAULT_POLICY,
         residency: float | None = None, expert_memory: str | int | None = None, link: str | None = None,
         dtype=None, **options) -> Engine:
    """Load a local Hugging Face MoE checkpoint (None = the bundled default model).

    policy: one of POLICIES, the table in specter/policy.py (resident | on-demand | next-layer | host |
    spec-lru | specter).
    residency: share of the routed experts kept on the device (0 < F <= 1; one slot pool for all
    layers, each holding at most its share: slot_pool="layer" gives every layer the same slots), or
    expert_memory: a byte budget for the device slot pool ("6GiB"). Neither: all resident.
    (policy "resident" takes no budget: one given to it is refused, not ignored.)
    dtype: compute dtype, "float32" | "bfloat16" | "float16" (default: fp32 on CPU, the
    checkpoint's 16-bit dtype on CUDA).
    link: CPU only, the link profile that the emulated PCIe link is calibrated from.
    k_max: the longest draft the governor may choose (default 32; 0 = plain decoding only).
    compile: compile the decode steps (specter.compiled: the draft's sync-free one-token step and the
    verifier; a plain policy's one-token step) and, on CUDA, replay the MoE calls from CUDA graphs.
    None (default): on CUDA (CUDA graphs), off on CPU; True/False force it.
    host_threads: policies host and specter, the threads of the host lane that computes experts not
    on the device (default: physical cores less one). specter uses the lane on CPU, and on CUDA only
    when host_threads is given; host_threads=0 runs specter without it (every miss copied).
    compress_experts: keep the host store's experts losslessly coded (bf16 checkpoints only; the
    same bits): copies move the coded bytes and decode into the slot as they land (offload/coded.py).
    draft_bits: the draft experts' code width, 4 (default), 3 or 2: fewer bits, a smaller draft,
    fewer tokens accepted a cycle; the output is the same tokens either way.
    context: the most tokens a generation holds (prompt + output; default the model's context), and
    what a device_memory budget reserves KV cache for: a shorter one leaves those bytes to experts.
    """
    import torch

    from .builder import build_engine

    own = {} if options.get("shared") is not None else dict(  # (a checkpoint shared with others, bench's: theirs)
        draft_bits=options.get("draft_bits"), compress_experts=options.get("compress_experts") or None)
    refuse_unused(policy, residency=residency, expert_memory=expert_memory,  # (an unknown policy fails here too)
                  device_memory=options.get("device_memory"), k_max=options.get("k_max"), link=link, **own)
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise ConfigError(f"model must be a directory path (a str or a Path), got {type(model).__name__}")
    if dtype is not None and not isinstance(dtype, str) and not isinstance(dtype, torch.dtype):
        raise ConfigError(f"dtype must be a name such as 'bfloat16' or a torch.dtype, got {dtype!r}")
    threads = options.get("threads")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"threads must be an integer >= 1, got {threads!r}")
    path = Path(model) if model is not None else default_model_path()
    return build_engine(path, resolve_device(device), policy=policy, residency=residency,
                        expert_memory=expert_memory, link=link, dtype=dtype, **options)
