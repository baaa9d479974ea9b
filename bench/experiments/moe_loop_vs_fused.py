"""CPU: one MoE layer through fused_moe's torch backend beside the per-expert loop it replaced
(`moe.run_experts` before issue 9), alternated in one process so a drifting machine cancels out.

    python bench/experiments/moe_loop_vs_fused.py [--threads 1]

Prints per T the median microseconds of each and the median of the per-round ratios new/old.
The bundled model's expert shapes (16 experts, hidden 256, intermediate 192, top-2), fp32.
With one thread the clock is this thread's CPU time, so time the machine gives to other
processes does not count (it dominates wall time on a shared machine); with more, wall time.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from specter.triton_ops import fused_moe


def per_expert_loop(x, ids, weights, w13, w2):
    """The old hot path: group on the host, each expert's rows through F.linear, weighted sum."""
    T, k = ids.shape
    groups: dict[int, list[int]] = {}
    for row, e in enumerate(ids.reshape(-1).tolist()):
        groups.setdefault(e, []).append(row)
    out = x.new_empty(T * k, x.shape[1])
    for e in sorted(groups):
        rows = groups[e]
        idx = torch.tensor(rows) if T > 1 else rows[0]
        gate, up = F.linear(x[idx // k] if T > 1 else x, w13[e]).chunk(2, -1)
        y = F.linear(F.silu(gate) * up, w2[e])
        out[idx] = y if T > 1 else y[0]
    return (out.view(T, k, -1) * weights[..., None].to(out.dtype)).sum(1)


def seconds(fn, args, n, clock=time.perf_counter):
    t0 = clock()
    for _ in range(n):
        fn(*args)
    return (clock() - t0) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=25)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    g = torch.Generator().manual_seed(0)
    E, H, I, k = 16, 256, 192, 2
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.05, torch.randn(E, H, I, generator=g) * 0.05
    new = lambda x, ids, w, w13, w2: fused_moe(x, ids, w, w13, w2, backend="torch")  # noqa: E731
    for T in (1, 8, 33):
        x = torch.randn(T, H, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        w = torch.softmax(torch.rand(T, k, generator=g), -1)
        args, n = (x, ids, w, w13, w2), (400 if T == 1 else 60)
        seconds(per_expert_loop, args, n), seconds(new, args, n)  # warm-up
        old_s, new_s = [], []
        for _ in range(a.rounds):
            old_s.append(seconds(per_expert_loop, args, n, clock))
            new_s.append(seconds(new, args, n, clock))
        ratios = [b / o for o, b in zip(old_s, new_s)]
        q = statistics.quantiles(ratios, n=4)
        print(f"T={T:2d}  per-expert loop {statistics.median(old_s) * 1e6:7.0f} us   fused_moe(torch) "
              f"{statistics.median(new_s) * 1e6:7.0f} us   new/old {statistics.median(ratios):.2f} "
              f"(IQR {q[0]:.2f}-{q[2]:.2f})")


if __name__ == "__main__":
    main()
