"""K = 0's arms (`PlainArms`) in tests/test_governor.py's noisy world: a step costs 4 ms plus 6 ms a miss,
0 to 8 misses (twice that on a 64-token text's first step), the other arm `slow` times as much. Prints the
time over always running the faster arm, mean and worst draw, for the current PlainArms or one of an
earlier revision (its class read from git).

    python bench/experiments/arms_sim.py [--rev REV] [--seeds 16] [--steps 3000] [--budget 0.01]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from test_governor import run_noisy_arms  # noqa: E402


def arms_class(rev: str | None):
    if rev is None:
        from specter.speculative.arms import PlainArms
        return PlainArms
    for path in ("specter/speculative/arms.py", "specter/speculative/governor.py"):
        src = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True).stdout
        if "class PlainArms" in src:
            ns: dict = {}
            exec("from __future__ import annotations\nimport math\n" + src[src.index("class PlainArms"):], ns)
            return ns["PlainArms"]
    raise SystemExit(f"no PlainArms at {rev}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", help="a git revision whose PlainArms to simulate (default: the working tree's)")
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--budget", type=float, help="the probes' budget (default: the class's own)")
    args = ap.parse_args()
    arms = arms_class(args.rev)
    kw = {} if args.budget is None else {"budget": args.budget}
    for slow in (1.2, 1.05, 1.03, 0.95, 0.9, 0.8):
        over = [run_noisy_arms(arms(**kw), slow, s, steps=args.steps) - 1 for s in range(args.seeds)]
        print(f"other arm {slow}x: mean {100 * sum(over) / len(over):.1f}%, worst {100 * max(over):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
