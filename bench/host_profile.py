"""Where a generated token's host time goes: a greedy generation of the bundled model under cProfile.

    python bench/host_profile.py [--device cuda] [--policies on-demand,specter] [--residency 0.25]
                                 [--tokens 64] [--top 25]

On a GPU the engine is host-bound (docs/RESULTS.md, "Two more GPU runs": a decode-sized MoE call's
launches cost the host several times the device's time); this says which calls the rest of a token's
host time goes to. Per policy, after one warm-up generation of the same prompt, one generation runs
under cProfile (the decode thread only; the link's threads are not profiled). One JSON line a policy:
wall ms a token with and without the profiler (its overhead inflates Python-heavy calls, so rank by
it, do not add up), and the top functions by own time: calls a token, own and cumulative us a token.
C calls (torch ops, CUDA and Triton launches) show as their builtins ("{method 'copy_' ...}").
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

import torch

import specter
from specter.bench import DEFAULT_PROMPTS


def _name(func: tuple) -> str:
    file, line, name = func
    if file == "~":  # a builtin
        return name
    return f"{file.rsplit('/', 2)[-2]}/{file.rsplit('/', 1)[-1]}:{line} {name}"


def profile(engine, prompt: str, tokens: int, top: int) -> dict:
    gen = lambda: engine.generate(prompt, max_new_tokens=tokens, temperature=0.0)  # noqa: E731
    gen()  # warm: compiles, graph captures, caches
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    n = max(1, len(gen().token_ids))  # greedy: the profiled run below makes the same tokens
    sync()
    plain = time.perf_counter() - t0
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    gen()
    sync()
    prof.disable()
    profiled = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats  # func -> (primitive calls, calls, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return {"tokens": n, "ms_per_token": round(plain / n * 1e3, 2), "profiled_ms_per_token": round(profiled / n * 1e3, 2),
            "top": [[_name(f), round(s[1] / n, 1), round(s[2] / n * 1e6, 1), round(s[3] / n * 1e6, 1)]
                    for f, s in rows]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--policies", default="on-demand,specter")
    ap.add_argument("--residency", type=float, default=0.25)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    for policy in args.policies.split(","):
        engine = specter.load(device=args.device, policy=policy,
                              residency=None if policy == "resident" else args.residency)
        try:
            res = {"policy": policy, "device": args.device, **profile(engine, DEFAULT_PROMPTS[0], args.tokens, args.top)}
        finally:
            engine.close()
        print(json.dumps(res), flush=True)
        for name, calls, own, cum in res["top"][:12]:
            print(f"  {own:9.1f} us own {cum:9.1f} us cum {calls:7.1f} calls/token  {name}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
