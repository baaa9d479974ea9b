"""The prefetch planner's cost a plain step: PrefetchPlanner.observe_use, once a layer a step.

    python bench/experiments/planner_hook_cost.py [--model uniform] [--calls 5000]

On a matrix model (uniform: 128 experts, top-8), each call one step's 8 experts of one layer, as a
plain step makes it; the best of 5 repeats, in microseconds a call. Run it at two commits (a git
worktree) to compare them: docs/RESULTS.md.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import governor_matrix as gm  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="uniform")
    ap.add_argument("--calls", type=int, default=5000)
    args = ap.parse_args()
    import specter

    with tempfile.TemporaryDirectory() as tmp:
        gm.build(args.model, Path(tmp) / args.model)
        engine = specter.load(Path(tmp) / args.model, policy="specter", residency=0.25, link="H100-PCIe5")
        try:
            planner, spec = engine.decoder.planner, engine.decoder.model.spec
            rng = random.Random(0)
            steps = [rng.sample(range(spec.n_experts), spec.top_k) for _ in range(64)]
            layers = range(spec.n_moe_layers)

            def step(i=[0]):  # noqa: B006 -- a counter kept across calls
                for layer in layers:
                    planner.observe_use(layer, steps[i[0] % 64])
                    i[0] += 1

            best = min(timeit.repeat(step, number=args.calls, repeat=5))
            print(f"{args.model}: {spec.n_experts} experts, top-{spec.top_k}: observe_use "
                  f"{best / args.calls / len(layers) * 1e6:.2f} us a call")
        finally:
            engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
