"""How much project code one generated token walks: distinct functions, files and calls per token.

    python bench/trace_cycle.py [--policy specter] [--residency 0.25] [--tokens 32] [--top 15] [--runs 1]

A greedy generation of the bundled model (after one warm-up generation) runs under sys.setprofile;
every Python call into the `specter` package (compiled/ and triton_ops/ included) is counted. The
next change to the decode path can be held to these numbers (issue 25's goal: <= 90 functions in
<= 12 files and <= 300 calls a token for specter at 25%). Which code a generation walks depends on
the governor's choices (plain steps or not), so `--runs N` traces N generations one after another
on the same engine, a line each, and lists the functions of the one that walked the most.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import threading

import specter

ROOT = os.path.dirname(os.path.abspath(specter.__file__))
ROOTS = tuple(os.path.realpath(os.path.join(ROOT, p)) for p in (".", "../compiled", "../triton_ops"))


def _ours(filename: str) -> bool:
    return os.path.realpath(filename).startswith(ROOTS)


def trace(fn):
    """Run fn() with every thread profiled; -> Counter of (file, function) calls."""
    calls: collections.Counter = collections.Counter()
    seen_files: dict[str, bool] = {}

    def profile(frame, event, arg):
        if event == "call":
            f = frame.f_code.co_filename
            ours = seen_files.get(f)
            if ours is None:
                ours = seen_files[f] = _ours(f)
            if ours:
                calls[(f, frame.f_code.co_qualname if hasattr(frame.f_code, "co_qualname")
                       else frame.f_code.co_name)] += 1

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return calls


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="specter")
    ap.add_argument("--residency", type=float, default=0.25)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", default="def fibonacci(n):")
    ap.add_argument("--top", type=int, default=15, help="the most called functions to list")
    ap.add_argument("--runs", type=int, default=1, help="generations traced, one after another")
    a = ap.parse_args(argv)
    kw = {} if a.policy == "resident" else {"residency": a.residency}
    engine = specter.load(None, device="cpu", policy=a.policy, **kw)
    base = os.path.dirname(ROOT)
    widest = None
    try:
        engine.generate(a.prompt, max_new_tokens=a.tokens, temperature=0.0)  # warm-up
        for _ in range(a.runs):
            out = []
            calls = trace(lambda: out.append(engine.generate(a.prompt, max_new_tokens=a.tokens, temperature=0.0)))
            n = max(1, len(out[0].token_ids))
            files = {f for f, _ in calls}
            print(f"policy {a.policy}, residency {a.residency}, {n} tokens: {len(calls)} distinct functions in "
                  f"{len(files)} files, {sum(calls.values()) / n:.0f} project calls a token", flush=True)
            if widest is None or len(calls) > len(widest[0]):
                widest = (calls, n)
    finally:
        engine.close()
    calls, n = widest
    for (f, name), c in calls.most_common(a.top):
        print(f"  {c / n:8.1f}/token  {os.path.relpath(f, base)}:{name}")


if __name__ == "__main__":
    main()
