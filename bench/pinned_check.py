"""GPU check of the pinned host store (run by bench/device_check.sh; needs CUDA).

1. rounding: PyTorch's caching host allocator (`pin_memory=True`) for a 1.5 x 2^k byte block, read
   from torch.cuda.host_memory_stats(): expected to reserve the next power of two;
2. exact: the store's arena pinned in place (cudaHostRegister) is pinned (`is_pinned()`), adds
   nothing to the caching allocator's reservation, and copies to the device at pinned speed
   (compared with a pageable tensor of the same size);
3. fallback: a registration the driver refuses (the same range twice) warns, leaves the tensor
   pageable, and the next kernel launch does not trip over the failed call's error;
4. staging: CudaLink copying experts out of a pageable store goes through its two pinned staging
   buffers (h2d_path says so), lands bit for bit, pins nothing per copy, and its throughput is
   printed beside the same copies from a pinned store.
Prints one line per check and `pinned check: OK` or `pinned check: FAILED`.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch

from specter.offload.cuda_link import CudaLink
from specter.offload.staging import staged_nbytes
from specter.offload.store import page_aligned, pin_in_place


def _stats() -> dict:
    try:
        return {k: v for k, v in torch.cuda.host_memory_stats().items() if "bytes" in k}
    except (AttributeError, RuntimeError):
        return {}


def _reserved(stats: dict) -> int:
    for key in ("reserved_bytes.current", "allocated_bytes.current", "reserved_bytes.all.current"):
        if key in stats:
            return stats[key]
    return -1


def _h2d_gbps(src: torch.Tensor) -> float:
    dst = torch.empty_like(src, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * src.nbytes / (time.perf_counter() - t0) / 1e9


def _link_gbps(pinned: bool, E: int = 8, H: int = 4096, I: int = 2048) -> tuple[str, bool, float]:
    """(h2d_path, bit-exact, GB/s) copying E bf16 experts [2I, H] + [H, I] through a CudaLink, twice over."""
    arena = page_aligned(E * 3 * H * I, torch.bfloat16)
    arena.copy_(torch.randn(arena.numel()))
    if pinned:
        pin_in_place(arena)
    w13, w2 = arena[:E * 2 * I * H].view(E, 2 * I, H), arena[E * 2 * I * H:].view(E, H, I)
    d13 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device="cuda")
    d2 = torch.empty(E, H, I, dtype=torch.bfloat16, device="cuda")
    pins = []
    real_pin = torch.Tensor.pin_memory
    torch.Tensor.pin_memory = lambda self, *a, **kw: pins.append(self.nbytes) or real_pin(self)
    try:
        with CudaLink("cuda") as link:
            link.prepare([w13, w2], staged_nbytes([w13[0], w2[0]]))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(2):
                for e in range(E):
                    link.copy([d13[e], d2[e]], [w13[e], w2[e]])
            link.synchronize()
            elapsed = time.perf_counter() - t0
            exact = torch.equal(d13.cpu(), w13) and torch.equal(d2.cpu(), w2) and not pins
            return link.h2d_path, exact, 2 * arena.nbytes / elapsed / 1e9
    finally:
        torch.Tensor.pin_memory = real_pin


def main() -> int:
    if not torch.cuda.is_available():  # pin_memory and cudaHostRegister need a CUDA GPU: say so, not a traceback
        print(f"pinned check: needs a CUDA GPU; torch {torch.__version__} sees none", file=sys.stderr)
        return 2
    ok = True
    n = 3 << 28  # 768 MiB: 1.5 x 512 MiB
    before = _reserved(_stats())
    cached = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    rounded = _reserved(_stats()) - before
    print(f"1. pin_memory=True, {n >> 20} MiB asked: the caching host allocator reserved {rounded >> 20} MiB "
          f"({rounded / n:.2f}x){'' if rounded >= 0 else ' (stats unavailable)'}")
    print(f"   host_memory_stats: {_stats()}")
    del cached

    arena = torch.empty(n, dtype=torch.uint8)
    before = _reserved(_stats())
    pinned = pin_in_place(arena)
    extra = _reserved(_stats()) - before
    good = pinned and arena.is_pinned() and extra == 0
    ok &= good
    pageable = torch.empty(n, dtype=torch.uint8)
    print(f"2. arena pinned in place: {pinned}, is_pinned {arena.is_pinned()}, caching allocator +{extra} B "
          f"(exact: {n >> 20} MiB locked); H2D {_h2d_gbps(arena):.1f} GB/s pinned vs "
          f"{_h2d_gbps(pageable):.1f} GB/s pageable -> {'ok' if good else 'FAILED'}")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = pin_in_place(arena[: 1 << 20])  # already registered: the driver refuses
    launch = True
    try:
        torch.ones(4, device="cuda").add_(1).sum().item()  # a launch: must not see a stale error
    except RuntimeError as e:
        launch = False
        print(f"   launch after the refusal failed: {e}")
    good = (not again) and launch and any("could not pin" in str(w.message) for w in caught)
    ok &= good
    print(f"3. refused registration -> pinned {again}, warning {[str(w.message)[:90] for w in caught]}, "
          f"next launch ok {launch} -> {'ok' if good else 'FAILED'}")
    path_s, exact_s, gbps_s = _link_gbps(pinned=False)
    path_p, exact_p, gbps_p = _link_gbps(pinned=True)
    good = path_s.startswith("staging buffers (2 x ") and path_p == "pinned store" and exact_s and exact_p
    ok &= good
    print(f"4. CudaLink: {path_s}: exact {exact_s}, {gbps_s:.1f} GB/s; {path_p}: exact {exact_p}, {gbps_p:.1f} GB/s "
          f"-> {'ok' if good else 'FAILED'}")
    print(f"pinned check: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    # no options: the parser gives --help and refuses stray arguments (main() stays bare: tests/test_cuda.py)
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    raise SystemExit(main())
