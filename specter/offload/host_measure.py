"""This machine's host lane, measured: a STREAM-like bandwidth and the lane's achieved expert GB/s.

    stream_triad()                         bytes/s of a = b + s * c over arrays larger than the caches
    lane_throughput(H, I, T, ...)          bytes/s of expert weights a HostLane reads, T tokens an expert

`specter profile` prints both beside the profiles' hosts, at the expert shapes of MODEL_SHAPES.
The lane is memory-bound at a few tokens an expert, so its GB/s at T = 1 against the triad's is how
much of the host's bandwidth it turns into expert compute.
"""
from __future__ import annotations

import math
import statistics
import time

import torch

from ..moe import ExpertWeights
from .host_lane import HostLane, physical_cores

MODEL_SHAPES = {"Mixtral-8x7B": (4096, 14336), "Qwen3-30B-A3B": (2048, 768), "DeepSeek-V2-Lite": (2048, 1408)}
_WORKING_SET = 256 << 20  # bytes of experts per pass: well past any last-level cache


def stream_triad(nbytes: int = 64 << 20, threads: int | None = None, budget_s: float = 0.3) -> float:
    """STREAM's triad in torch (fp32 a = b + 3 * c; three arrays of `nbytes` each, counted as
    STREAM counts them: 3 * nbytes a pass), best of the passes that fit in `budget_s`."""
    n = nbytes // 4
    a, b, c = torch.empty(n), torch.full((n,), 1.0), torch.full((n,), 2.0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        best, stop = 0.0, time.perf_counter() + budget_s
        torch.add(b, c, alpha=3.0, out=a)  # warm-up: pages touched
        while True:
            t0 = time.perf_counter()
            torch.add(b, c, alpha=3.0, out=a)
            best = max(best, 3 * nbytes / (time.perf_counter() - t0))
            if time.perf_counter() > stop:
                return best
    finally:
        torch.set_num_threads(before)


def lane_throughput(hidden: int, intermediate: int, tokens: int, *, dtype=torch.float32, storage=None,
                    threads: int = 1, budget_s: float = 0.2, store: ExpertWeights | None = None) -> float:
    """Bytes/s of expert weights (as stored) a HostLane of `threads` reads running `tokens` tokens
    through each of a working set of experts (jobs of up to 8 experts, as a layer's cold experts),
    compute in `dtype` over a store in `storage` (default `dtype`). Median over the jobs that fit in
    `budget_s` (at least one pass)."""
    storage = storage or dtype
    expert_bytes = 3 * hidden * intermediate * storage.itemsize
    if store is None:
        store = make_store(hidden, intermediate, storage, max(2, math.ceil(_WORKING_SET / expert_bytes)))
    n = store.w13.shape[0]
    lane = HostLane([store], "cpu", threads=threads, dtype=dtype)
    try:
        x = torch.full((tokens, hidden), 0.1, dtype=dtype)
        k = min(n, 8)
        rates, e, stop = [], 0, time.perf_counter() + budget_s
        for first in (True, False):  # a warm-up job, then timed ones
            while True:
                experts = [(e + j) % n for j in range(k)]
                e = (e + k) % n
                ids = torch.tensor([experts] * tokens)                    # [T, k]
                w = torch.full((tokens, k), 1.0 / k, dtype=dtype)          # [T, k]
                t0 = time.perf_counter()
                lane.submit(0, x, ids, w, experts).wait()
                if not first:
                    rates.append(k * expert_bytes / (time.perf_counter() - t0))
                if first or (time.perf_counter() > stop and len(rates) * k >= n):
                    break
        return statistics.median(rates)
    finally:
        lane.close()


def make_store(hidden: int, intermediate: int, dtype, n: int) -> ExpertWeights:
    """n constant experts (matmul speed does not depend on values; fill_ is far cheaper than randn)."""
    return ExpertWeights(torch.empty(n, 2 * intermediate, hidden, dtype=dtype).fill_(0.01),
                         torch.empty(n, hidden, intermediate, dtype=dtype).fill_(0.01))


def measure(threads: int, tokens=(1, 4, 16), shapes=None, budget_s: float = 0.15) -> dict:
    """{"stream_GBps" (all physical cores), "stream_lane_threads_GBps", "threads", "lane": [{model, hidden,
    intermediate, mode, T, GBps}]}; modes:
    fp32 (fp32 store), bf16 (bf16 store and compute), bf16->fp32 (a bf16 store computed in fp32:
    the CPU emulation's path, each expert converted into a reused buffer)."""
    shapes = shapes or MODEL_SHAPES
    rows = []
    for model, (H, I) in shapes.items():
        for mode, dtype, storage in (("fp32", torch.float32, torch.float32), ("bf16", torch.bfloat16, torch.bfloat16),
                                     ("bf16->fp32", torch.float32, torch.bfloat16)):
            nb = 3 * H * I * storage.itemsize
            store = make_store(H, I, storage, max(2, math.ceil(_WORKING_SET / nb)))
            for T in tokens:
                rate = lane_throughput(H, I, T, dtype=dtype, storage=storage, threads=threads, budget_s=budget_s,
                                       store=store)
                rows.append(dict(model=model, hidden=H, intermediate=I, mode=mode, T=T, GBps=rate / 1e9))
            del store
    cores = physical_cores()
    return {"stream_GBps": stream_triad(threads=cores) / 1e9, "stream_cores": cores,
            "stream_lane_threads_GBps": stream_triad(threads=threads) / 1e9, "threads": threads, "lane": rows}
