"""astream against the blocking API, side by side in one process: for each policy, two engines on one
loaded checkpoint; "sync" generates with `generate` (the decoder's one body on the calling thread),
"async" consumes `astream` on an event loop (the same body on a thread of its own, chunks handed to
the loop: streaming.in_thread). TPOT is measured as the engine measures it (first to last chunk).

    nice python bench/async_vs_sync.py [--residency 0.25] [--policies specter,spec-lru]
        [--workloads default,diverse] [--prompts 4] [--max-new-tokens 64] [--rounds 4]
        [--temperature 0] [--device cpu|cuda] [--compile | --no-compile] [--instant-link]

Rounds alternate the engines' order (bench/governor_matrix.py's `alternate`); an engine's TPOT is its
median round. Prints, per workload and policy, TPOT sync / async and the ratio async / sync (the gate:
<= 1, "no slower than the synchronous manager"), stall seconds a token, and whether the greedy tokens
of the two drivers are identical. --instant-link (CPU): copies take no emulated time, so TPOT is
compute plus each driver's own cost -- the ratio then isolates the drivers' overhead.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from types import SimpleNamespace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from governor_matrix import alternate  # noqa: E402

import specter  # noqa: E402
import specter.builder as builder  # noqa: E402
from specter.bench import load_once  # noqa: E402
from specter.offload.link import EmulatedLink  # noqa: E402
from specter.workloads import workload_prompts  # noqa: E402

DRIVERS = ("sync", "async")


class Streamed:
    """An engine whose `generate` consumes `astream` on an event loop (what an asyncio server does)."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompt, max_new_tokens: int, **sampling):
        stats: dict = {}

        async def consume():
            return "".join([p async for p in self.engine.astream(prompt, max_new_tokens, stats=stats, **sampling)])

        return SimpleNamespace(text=asyncio.run(consume()), stats=stats)

    def close(self) -> None:
        self.engine.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--residency", type=float, default=0.25)
    ap.add_argument("--policies", default="specter,spec-lru")
    ap.add_argument("--workloads", default="default,diverse")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="compiled draft step and verifier (default: the device's default)")
    ap.add_argument("--instant-link", action="store_true", help="CPU: an emulated link with no transfer time")
    args = ap.parse_args()
    if args.instant_link:
        builder.make_link = lambda device, profile=None, **kw: EmulatedLink(1e12, 0.0, name="instant")
    sampling = dict(temperature=args.temperature, seed=0)
    shared = load_once(None, device=args.device)
    policies = args.policies.split(",")
    engines = {f"{p}/{d}": specter.load(None, device=args.device, policy=p, residency=args.residency, shared=shared,
                                        compile=args.compile)
               for p in policies for d in DRIVERS}
    engines = {name: Streamed(e) if name.endswith("/async") else e for name, e in engines.items()}
    try:
        for workload in args.workloads.split(","):
            prompts = workload_prompts(workload)[:args.prompts]
            tokens = {name: [] for name in engines}
            stall = {name: [0.0, 0] for name in engines}

            def count(name: str, s: dict) -> None:
                stall[name][0] += s["decode_stall_s"]
                stall[name][1] += max(s["new_tokens"] - 1, 1)

            rounds = alternate(engines, prompts, args.rounds, args.max_new_tokens, sampling, count)
            if args.temperature == 0:  # the drivers' texts, one more pass (alternate keeps none)
                for name, e in engines.items():
                    tokens[name] = [e.generate(p, max_new_tokens=args.max_new_tokens, **sampling).text
                                    for p in prompts]
            print(f"workload {workload} ({len(prompts)} prompts x {args.max_new_tokens} tokens, {args.rounds} rounds, "
                  f"residency {args.residency}, {'greedy' if args.temperature == 0 else sampling}):")
            for p in policies:
                ts, ta = (statistics.median(rounds[f"{p}/{d}"]) for d in DRIVERS)
                st = [stall[f"{p}/{d}"][0] / stall[f"{p}/{d}"][1] * 1e3 for d in DRIVERS]
                same = tokens[f"{p}/sync"] == tokens[f"{p}/async"] if args.temperature == 0 else None
                print(f"  {p:9s} TPOT sync {ts * 1e3:6.2f} ms  async {ta * 1e3:6.2f} ms  async/sync {ta / ts:.3f}  "
                      f"stall/token sync {st[0]:.2f} ms async {st[1]:.2f} ms  "
                      f"rounds async/sync {[round(a / s, 3) for a, s in zip(rounds[f'{p}/async'], rounds[f'{p}/sync'])]}"
                      + ("" if same is None else f"  greedy text identical: {same}"))
    finally:
        for e in engines.values():
            e.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
