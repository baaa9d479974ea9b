"""Decode misses per text, paired across engines: how far a policy's cache trail differs from a
baseline's text by text, and on average (greedy, so each engine decodes the same tokens).

    python bench/experiments/text_misses.py --model disagree --residency 0.5 --link H100-PCIe5
        [--max-new-tokens 16] [--prompts 64] --engines specter:k0+guess0+lane1,on-demand

Each engine (cell_counters' POLICY[:VARIANT]) warms up on the first prompt, then generates every
prompt once, in order; a generation's misses are its decode steps' (prefill's subtracted). Printed:
misses a generation, over the first 8 texts (the matrix's old sample) and over all, and the per-text
difference from the last engine (mean and spread). The counts hang on the link's measured copy time
only where a host lane chooses, so run alone.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cell_counters as cc  # noqa: E402


def main() -> int:
    ap = cc.cell_parser(__doc__, "disagree", 0.5, 1)
    ap.add_argument("--engines", default="specter:k0+guess0+lane1,specter:k0+guess0+lane1+noprefillhost,on-demand")
    ap.set_defaults(prompts=64)  # many texts: one sample each
    args = ap.parse_args()
    names = args.engines.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        prompts, engines = cc.cell_engines(args, names, tmp)
        misses = {}
        try:
            for n, e in engines.items():
                snap = {}
                cc.hook_prefill(e, snap)
                e.generate(prompts[0], max_new_tokens=args.max_new_tokens, temperature=0.0)
                misses[n] = []
                for p in prompts:
                    s = e.generate(p, max_new_tokens=args.max_new_tokens, temperature=0.0).stats
                    misses[n].append(s["expert_misses"] - snap["expert_misses"])
        finally:
            for e in engines.values():
                e.close()
    base = misses[names[-1]]
    print(f"{args.model} residency {args.residency} {args.link} x {args.max_new_tokens} tokens, {len(prompts)} texts")
    for n in names:
        d = [a - b for a, b in zip(misses[n], base)]
        print(f"  {n:<45} decode misses a text {statistics.mean(misses[n]):6.2f} (first 8 texts "
              f"{statistics.mean(misses[n][:8]):6.2f}); minus {names[-1]}'s: mean {statistics.mean(d):+.2f} "
              f"sd {statistics.pstdev(d):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
