"""Where a decode-sized fused_moe call spends its time on a GPU: the host (Python and launches) or
the device. The first GPU run (2026-12-04, H200) timed every T = 1 and T = 8 call of the Qwen3-30B
and DeepSeek-V2-Lite layers at ~200 us whatever the bytes (bench/test_kernels.py times back-to-back
calls, so a host-bound call shows its host cost): x 48 MoE layers that is ~10 ms a token, and the
verifier runs its experts eagerly between its compiled pieces.

    python bench/experiments/moe_host_cost.py [--iters 200] [--launches jit]   # CUDA
    TRITON_INTERPRET=1 python bench/experiments/moe_host_cost.py --device cpu --iters 2000
                                  # the call's Python and dispatch alone: host tensors on the CPU, the
                                  # weights on meta, the four kernel launches stubbed (host_us only)
    python bench/experiments/moe_host_cost.py --device cpu --launches stub|jit
                                  # the same with Triton's launch path on a stub driver (compiled for
                                  # sm_90, nothing launched): the engine's launches, or the JIT's

Per model shape at T = 1 and 8 (bf16 experts, routing as bench/test_kernels.py's):
  host_us    perf_counter per call, calls enqueued back to back without a sync (the host's cost);
  graph_us   the same call captured once in a CUDA graph, per replay (the device's cost alone);
  pieces     host us of each step alone: align_rows_triton, the two expert kernels' launches,
             combine_triton, the allocations (new_empty/new_zeros).
  graphed_host_us  host_us of the engine's CUDA path (triton_ops/graphed.py: GraphedRows' inputs
             copied in, its graph replayed, the rows cloned out, then combine_triton);
             graphed_fused_host_us, GraphedRows.fused_moe's (the combine inside the graph: an
             all-resident layer's call).
A host_us far above graph_us says the call is launch-bound: fewer launches, or capture, pay.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch

SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "deepseek-v2-lite": (64, 2048, 1408, 6),
          "mixtral-8x7b": (8, 4096, 14336, 2)}


def host_us(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t / iters * 1e6


def graph_us(fn, iters: int) -> float | str:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    from specter.triton_ops.graphed import CudaGraphs

    try:
        g, _ = CudaGraphs().capture(fn)  # as the engine captures (triton_ops/graphed.py)
    except Exception as e:  # a host sync inside the call makes capture fail: itself a finding
        return f"capture failed: {type(e).__name__}: {str(e)[:120]}"
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def python_only(iters: int, launches: str = "noop") -> int:
    """--device cpu: fused_moe's own host cost without a GPU (see the module docstring)."""
    from specter.triton_ops import aot, fused_moe, kernels
    from specter.triton_ops.launch import through_the_jit

    class Noop:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    kernels.LAUNCHES_ON_CPU = True
    os.environ["TRITON_INTERPRET"] = "1"  # fused_moe's check, read at call time (the kernels stay compiled ones)
    if launches == "noop":
        for name in aot.KERNELS:
            setattr(kernels, name, Noop())
    elif launches == "jit":
        kernels.launch = through_the_jit
    with aot.stub_driver(90, record=False) if launches != "noop" else contextlib.nullcontext():
        return _python_only(iters, launches, fused_moe)


def _python_only(iters: int, launches: str, fused_moe) -> int:
    sync = time.perf_counter  # nothing to wait for
    for name, (E, H, I, k) in SHAPES.items():
        w13 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device="meta")
        w2 = torch.empty(E, H, I, dtype=torch.bfloat16, device="meta")
        for T in (1, 8):
            x, w = torch.zeros(T, H, dtype=torch.bfloat16), torch.zeros(T, k, dtype=torch.bfloat16)
            ids = torch.arange(T * k).view(T, k) % E
            call = lambda: fused_moe(x, ids, w, w13, w2, backend="triton")  # noqa: E731
            for _ in range(50):
                call()
            best = float("inf")
            for _ in range(3):
                t0 = sync()
                for _ in range(iters):
                    call()
                best = min(best, (sync() - t0) / iters * 1e6)
            print(json.dumps({"model": name, "T": T, "host_us": round(best, 1), "launches": launches}), flush=True)
    return 0


def main() -> int:
    from specter.triton_ops import fused_moe
    from specter.triton_ops.graphed import GraphedRows
    from specter.triton_ops.kernels import align_rows_triton, combine_triton, moe_rows_triton

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--launches", choices=("noop", "stub", "jit"),
                    help="--device cpu: the launches do nothing (noop, the default), go through Triton's launch path "
                         "on a stub driver as the engine launches (stub), or all through Triton's JIT (jit); CUDA: "
                         "jit sends the real launches through the JIT (the engine before launch.py)")
    args = ap.parse_args()
    if args.device == "cpu":
        return python_only(args.iters, args.launches or "noop")
    if args.launches not in (None, "jit"):
        ap.error(f"--launches {args.launches} needs --device cpu")
    if args.launches == "jit":
        from specter.triton_ops import kernels
        from specter.triton_ops.launch import through_the_jit
        kernels.launch = through_the_jit
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (E, H, I, k) in SHAPES.items():
        w13 = torch.randn(E, 2 * I, H, device="cuda", generator=g).mul_(0.02).bfloat16()
        w2 = torch.randn(E, H, I, device="cuda", generator=g).mul_(0.02).bfloat16()
        for T in (1, 8):
            x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
            ids = torch.rand(T, E, device="cuda", generator=g).topk(k, dim=1).indices
            w = torch.softmax(torch.randn(T, k, device="cuda", generator=g), -1).bfloat16()
            call = lambda: fused_moe(x, ids, w, w13, w2, backend="triton")  # noqa: E731
            rows = moe_rows_triton(x, ids, w, w13, w2, None)
            pieces = {"align": lambda: align_rows_triton(ids, E, None),
                      "expert_rows": lambda: moe_rows_triton(x, ids, w, w13, w2, None),
                      "combine": lambda: combine_triton(rows),
                      "alloc": lambda: (x.new_empty(64, I), x.new_zeros(T * k, H))}
            out = {"model": name, "T": T, "launches": args.launches or "engine",
                   "host_us": round(host_us(call, args.iters), 1)}
            gu = graph_us(call, args.iters)
            out["graph_us"] = round(gu, 1) if isinstance(gu, float) else gu
            out["pieces_host_us"] = {p: round(host_us(f, args.iters), 1) for p, f in pieces.items()}
            graphed = GraphedRows()  # the engine's path on CUDA: inputs copied in, replay, clone, combine
            gcall = lambda: combine_triton(graphed(x, ids, w, w13, w2))  # noqa: E731
            out["graphed_host_us"] = round(host_us(gcall, args.iters), 1)
            fcall = lambda: graphed.fused_moe(x, ids, w, w13, w2)  # noqa: E731  (the combine in the graph too)
            out["graphed_fused_host_us"] = round(host_us(fcall, args.iters), 1)
            assert torch.equal(combine_triton(rows), call()) and torch.equal(gcall(), call())
            assert torch.equal(fcall(), call()) and graphed.stats["graphs"] == 2, graphed.stats
            print(json.dumps(out), flush=True)
        del w13, w2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
