"""The host expert store: every routed expert once, in the checkpoint's own dtype, in one arena.

    arena  [host]  one flat buffer, exactly sum over MoE layers of E * 3 * I * H elements
    store          ExpertWeights views into it per MoE layer: w13 [E, 2I, H], w2 [E, H, I]

On CUDA the arena is page-locked in place with cudaHostRegister, exactly its size: PyTorch's
caching host allocator (`pin_memory=True`) rounds every block up to a power of two, which can
double the pinned RAM of a store allocated layer by layer. When the host cannot pin that much
(RLIMIT_MEMLOCK, container limits), or pinning is turned off (SPECTER_PIN_STORE=0), the store stays
pageable and CudaLink copies through two pinned staging buffers of its own (staging.py: slower, but
it runs); a refusal warns, naming the shortfall. A store larger than the memory the host has
available is refused up front, naming the shortfall.
"""
from __future__ import annotations

import os
import resource
import weakref

import torch

from ..config import ModelSpec
from ..errors import BudgetError, warn
from ..moe import ExpertWeights
from ..sizes import format_size


_PAGE = 4096


def store_bytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    item = torch.empty((), dtype=dtype).element_size()
    return spec.n_moe_layers * spec.n_experts * spec.expert_numel() * item


def allocate_store(spec: ModelSpec, dtype: torch.dtype, *, pin: bool = False,
                   n_layers: int | None = None) -> list[ExpertWeights]:
    """Empty store views over one arena (pages are touched only as the loader fills them); `n_layers`
    MoE layers of it (default all: a pipeline stage holds its own)."""
    E, I, H = spec.n_experts, spec.expert_inter, spec.hidden
    L = spec.n_moe_layers if n_layers is None else n_layers
    nbytes = store_bytes(spec, dtype) * L // max(spec.n_moe_layers, 1)
    available = host_available()
    if available is not None and nbytes > available:
        raise BudgetError(f"the expert store needs {format_size(nbytes)} of host memory but only "
                          f"{format_size(available)} is available ({format_size(nbytes - available)} short): "
                          f"free host memory or use a machine with more RAM")
    numel = L * E * 3 * I * H
    if pin:  # page-aligned, so the locked range is exactly the arena's pages and no neighbour's
        arena = page_aligned(numel, dtype)
        pin_in_place(arena)
    else:
        arena = torch.empty(numel, dtype=dtype)
    store, off = [], 0
    for _ in range(L):
        w13 = arena[off:off + E * 2 * I * H].view(E, 2 * I, H)
        off += w13.numel()
        w2 = arena[off:off + E * H * I].view(E, H, I)
        off += w2.numel()
        store.append(ExpertWeights(w13, w2))
    return store


def pin_wanted() -> bool:
    """Whether a CUDA load pins the store: yes unless SPECTER_PIN_STORE=0 (copies then go through
    CudaLink's staging buffers, for hosts where locking that much memory hurts the rest)."""
    return os.environ.get("SPECTER_PIN_STORE", "1").strip() != "0"


def page_aligned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty host tensor of `numel` elements starting on a page boundary."""
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(numel + _PAGE // item, dtype=dtype)
    start = (-raw.data_ptr() % _PAGE) // item
    return raw[start:start + numel]


def pin_in_place(t: torch.Tensor) -> bool:
    """Page-lock `t`'s exact bytes (cudaHostRegister). False, with a warning naming the shortfall and
    the way out, when the host refuses; the tensor then stays pageable and everything still runs."""
    error = register(t)
    if error is not None:
        _unpinned(t.numel() * t.element_size(), f"{error}; {host_limits()}")
        return False
    return True


def register(t: torch.Tensor) -> str | None:
    """cudaHostRegister `t`'s exact bytes until it (its base, for a view) dies: None, or why the host
    refused. A dtype view (`.view(torch.int32)`) does not keep its base alive: keep a reference."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return None
    cudart = torch.cuda.cudart()
    res = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    if res != cudart.cudaError.success:
        _clear_cuda_error()
        return f"cudaHostRegister: {res}"
    note_locked(t.data_ptr(), nbytes)
    owner = t if t._base is None else t._base  # what every view keeps alive: unregister when it dies
    weakref.finalize(owner, _unregister, cudart, t.data_ptr())
    return None


# The byte ranges `register` page-locked: start -> end. Tensor.is_pinned() asks the driver about the
# first byte of the tensor's *storage*, and a page-aligned arena is a view that starts past it, so
# its tensors read as pageable although every byte they own is locked: `is_locked` asks here first.
_locked: dict[int, int] = {}


def note_locked(start: int, nbytes: int) -> None:
    _locked[start] = start + nbytes


def _unregister(cudart, start: int) -> None:
    _locked.pop(start, None)
    cudart.cudaHostUnregister(start)


def is_locked(t: torch.Tensor) -> bool:
    """Whether `t` (host, contiguous) lies inside one range `register` page-locked, or is pinned."""
    if t.is_contiguous():
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        if any(s <= start and end <= e for s, e in list(_locked.items())):  # a few arenas: a short scan
            return True
    return t.is_pinned()


def _unpinned(nbytes: int, why: str) -> None:
    warn(f"could not pin the {format_size(nbytes)} expert store ({why}); it stays pageable and copies "
         f"go through two pinned staging buffers (slower). Raise `ulimit -l` (memlock) or free host "
         f"memory to pin it.")


def _clear_cuda_error() -> None:
    """A failed runtime call leaves the thread's last error set, and PyTorch's next kernel-launch check
    would raise it: read it back (cudaGetLastError resets it) from the runtime already loaded."""
    import ctypes

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except OSError:
            continue


def host_limits() -> str:
    """What bounds pinning here, for error messages."""
    avail, limit = host_available(), memlock_limit()
    return (f"host MemAvailable {format_size(avail) if avail is not None else 'unknown'}, "
            f"RLIMIT_MEMLOCK {format_size(limit) if limit is not None else 'unlimited'}")


def memlock_limit() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def host_available() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
