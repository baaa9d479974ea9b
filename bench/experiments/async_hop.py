"""For the asyncio driver (issue 10 item 4; built: specter/sansio.py): what handing compute to a worker thread
costs from an event loop, against the verifier's pieces' own time on CPU (bundled model).

    python bench/experiments/async_hop.py

Measured (2 loaded cores, two runs): run_in_executor round trip 33-90 us, await of a completed
transfer ~13 us; a verification piece 250-400 us at T = 1, 0.8-1.3 ms at T = 8, 1.4-3 ms at T = 33.
So on CPU the emulated device's compute belongs on the loop's thread, yielding between pieces: a
worker hop per piece would add 8-35% at T = 1.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import time

import torch

import specter
from specter.compiled.verify_step import VerifyStep
from specter.layers import KVCache


async def hop_s(n: int) -> float:
    loop, pool = asyncio.get_running_loop(), concurrent.futures.ThreadPoolExecutor(1)
    await loop.run_in_executor(pool, lambda: None)
    t0 = time.perf_counter()
    for _ in range(n):
        await loop.run_in_executor(pool, lambda: None)
    pool.shutdown()
    return (time.perf_counter() - t0) / n


async def await_done_s(n: int) -> float:
    fut = concurrent.futures.Future()
    fut.set_result(None)
    t0 = time.perf_counter()
    for _ in range(n):
        await asyncio.wrap_future(fut)
    return (time.perf_counter() - t0) / n


def main() -> None:
    print(f"run_in_executor round trip: {asyncio.run(hop_s(2000)) * 1e6:.1f} us")
    print(f"await of a completed transfer's future: {asyncio.run(await_done_s(20000)) * 1e6:.1f} us")
    eng = specter.load(None, policy="resident")
    model, experts = eng.decoder.model, eng.decoder.experts
    step = VerifyStep(model, 32)
    cache = KVCache(model.spec, 256, eng.device, eng.dtype)
    model(torch.arange(20), 0, cache, experts)
    pieces = 2 + len(model.model.layers)
    for T in (1, 8, 33):
        toks = torch.arange(T) + 5
        step.step(toks, 20, cache, experts)
        t0, reps = time.perf_counter(), 30
        for _ in range(reps):
            step.step(toks, 20, cache, experts)
        dt = (time.perf_counter() - t0) / reps
        print(f"verify T={T}: {dt * 1e3:.2f} ms over {pieces} pieces and {model.spec.n_moe_layers} MoE calls "
              f"(~{dt / pieces * 1e6:.0f} us a piece)")
    eng.close()


if __name__ == "__main__":
    # no options: the parser gives --help and refuses stray arguments before the run
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
