"""Is the lossless decode kernel's shape the fast one? The H200 (2026-12-04) decoded a Mixtral w13
expert at 1677 GB/s, 35% of its HBM and 18.6x the profile's PCIe bandwidth (issue 24's goal: 20x),
with BLOCK = 1024 elements a program and NUM_WARPS = 2. Compiled ahead of time (`--aot`, no GPU),
two warps need 64 registers and a 1 KB shared-memory round trip a program, four 40 registers and
none: a guess at what keeps the kernel from HBM speed, which only a GPU can time.

    python bench/experiments/decode_tune.py                 # CUDA: every variant timed, bits checked
    python bench/experiments/decode_tune.py --aot           # registers, spills, shared memory (any machine)
                                                            # --variants 1024x4,... --targets 90: fewer
    TRITON_INTERPRET=1 python bench/experiments/decode_tune.py --device cpu --shapes tiny
                                                            # the same code on CPU (a smoke run)

A variant is (BLOCK, NUM_WARPS): lossless.py's two constants, patched for the run (BLOCK is also the
format's escape-offset granularity, so each BLOCK encodes the weights anew). Per shape and variant,
one JSON line: the single-tensor kernel decoding one expert into a slot (`decode_into`, what
bench/test_kernels.py times) and the batch kernel decoding --batch experts' w13 and w2 from staged
bytes (`decode_staged_pairs`: a coalesced copy's and a tier's path); us a call (CUDA events, back to
back: a small shape shows its launch), GB/s of coded bytes read + bf16 written, `x_link` the bf16
bytes a second over the profile's PCIe bandwidth, `exact` the bits. The current constants' line
says `current: true`.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

SHAPES = {"mixtral-8x7b": (4096, 14336), "qwen3-30b-a3b": (2048, 768), "tiny": (64, 96)}  # (hidden, inter)
VARIANTS = tuple(itertools.product((1024, 2048), (2, 4, 8)))  # (BLOCK, NUM_WARPS)


def patched(block: int, warps: int):
    """lossless.py's decode shape set to (block, warps); the launch cache that bakes them in cleared."""
    from specter.triton_ops import lossless

    lossless.BLOCK, lossless.NUM_WARPS = block, warps
    lossless._pair_launch.cache_clear()
    return lossless


def timed(fn, device, iters: int) -> float:
    """us a call: back to back, CUDA events (bench/test_kernels.py's cuda_time); on CPU one call's wall time."""
    if device.type == "cuda":
        if (bench := str(Path(__file__).resolve().parents[1])) not in sys.path:
            sys.path.insert(0, bench)
        from test_kernels import cuda_time

        return cuda_time(fn, iters) * 1e6
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e6


def pcie_bandwidth(device) -> float:
    from specter.offload.calibrate import load_profile, profile_for_gpu

    name = profile_for_gpu(torch.cuda.get_device_name()) if device.type == "cuda" else None
    return load_profile(name).pcie_bandwidth if name else float("nan")


def shape_rows(name: str, device, iters: int, batch: int, defaults: tuple[int, int], variants) -> list[dict]:
    H, I = SHAPES[name]
    g = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(batch, 2 * I, H, device=device, generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(batch, H, I, device=device, generator=g) * 0.02).bfloat16()
    link = pcie_bandwidth(device)
    rows = []
    for block in sorted({b for b, _ in variants}):
        lossless = patched(block, defaults[1])
        a, b = lossless.encode(w13), lossless.encode(w2)      # this BLOCK's escape offsets
        pair = lossless.layer_major(a.to("cpu"), b.to("cpu"))
        staged = [lossless.stage_pair(pair, e, device) for e in range(batch)]
        for warps in sorted({w for bb, w in variants if bb == block}):
            lossless = patched(block, warps)
            slot = torch.full(w13.shape[1:], float("nan"), dtype=torch.bfloat16, device=device)
            pools = [torch.full(w.shape, float("nan"), dtype=torch.bfloat16, device=device) for w in (w13, w2)]
            jobs = [(e, staged[e], pools[0][e], pools[1][e]) for e in range(batch)]
            one = timed(lambda: a.decode_into(slot, 0), device, iters)
            many = timed(lambda: lossless.decode_staged_pairs(pair, jobs), device, iters)
            exact = (torch.equal(slot.view(torch.int16), w13[0].view(torch.int16))
                     and all(torch.equal(p.view(torch.int16), w.view(torch.int16)) for p, w in zip(pools, (w13, w2))))
            one_bytes = a.expert_nbytes(0) + slot.numel() * 2
            many_bytes = sum(s.numel() for s in staged) + (w13.numel() + w2.numel()) * 2
            rows.append({"shape": name, "block": block, "warps": warps, "current": (block, warps) == defaults,
                         "one_us": round(one, 1), "one_GBps": round(one_bytes / one / 1e3, 1),
                         "one_x_link": round(slot.numel() * 2 / (one * 1e-6) / link, 1) if link == link else None,
                         "batch_us": round(many, 1), "batch_GBps": round(many_bytes / many / 1e3, 1),
                         "exact": exact})
            print(json.dumps(rows[-1]), flush=True)
    patched(*defaults)
    return rows


def aot_rows(variants, targets) -> int:
    """Registers, spill bytes and shared memory of the single-tensor kernel on a Mixtral w13 expert, per
    variant and target (triton_ops/aot.py: compiled, not run)."""
    from specter.triton_ops import aot, lossless

    defaults = (lossless.BLOCK, lossless.NUM_WARPS)
    for (block, warps), cc in itertools.product(variants, targets):
        lossless = patched(block, warps)
        H, I = SHAPES["mixtral-8x7b"]
        packed = aot.stand_in_lossless(2, 2 * I, H, 3)
        with aot.recording(lossless, ("_decode_kernel",)) as log:
            lossless.decode_triton(packed, 1, torch.empty(2 * I, H, dtype=torch.bfloat16))
        r = aot.inspect(log[0], cc)
        print(json.dumps({"block": block, "warps": warps, "cc": cc, "registers": r.registers,
                          "spill_bytes": r.spill_bytes, "shared_bytes": r.shared_bytes}), flush=True)
    patched(*defaults)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="mixtral-8x7b,qwen3-30b-a3b", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--batch", type=int, default=2, help="experts a batch-kernel call decodes")
    ap.add_argument("--variants", default=",".join(f"{b}x{w}" for b, w in VARIANTS),
                    help="comma-separated BLOCKxNUM_WARPS")
    ap.add_argument("--aot", action="store_true", help="compile each variant for --targets instead (no GPU)")
    ap.add_argument("--targets", default="80,89,90", help="--aot: compute capabilities")
    args = ap.parse_args(argv)
    variants = [tuple(int(n) for n in v.split("x")) for v in args.variants.split(",")]
    if args.aot:
        return aot_rows(variants, [int(cc) for cc in args.targets.split(",")])
    from specter.triton_ops import lossless

    defaults = (lossless.BLOCK, lossless.NUM_WARPS)
    device = torch.device(args.device)
    for name in args.shapes.split(","):
        shape_rows(name, device, args.iters, args.batch, defaults, variants)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
