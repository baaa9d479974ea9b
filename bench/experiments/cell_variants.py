"""One governor-matrix cell's TPOT for scratch variants of a policy, interleaved as the matrix pairs them.

    python bench/experiments/cell_variants.py --model top8 --residency 0.5 [--max-new-tokens 16] [--rounds 12]
        [--link A100-40GB-PCIe4] --engines on-demand,on-demand#2,specter:k0,specter:k0+nohost

Every engine builds on one load of the checkpoint and generates each prompt back to back with the
others (`governor_matrix.interleave`: ABBA orders, young garbage collected between generations); a
variant is a policy and `cell_counters.variant`'s names after ':' (k0, nohost, guess0, lane1, lru,
nohook, ...; '#n' makes a second identical engine). Each engine's ratio is the median over samples of
its TPOT / the first engine's on the same prompt and round, with the 95% CI of that median: where
counts (cell_counters.py) match but a cell's time does not, this says which part of a policy the
time is in. Timings: report them with the machine's load.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cell_counters as cc  # noqa: E402
import governor_matrix as gm  # noqa: E402


def main() -> int:
    ap = cc.cell_parser(__doc__, "top8", 0.5, 12)
    ap.add_argument("--engines", default="on-demand,on-demand#2,spec-lru:k0,specter:k0,specter")
    args = ap.parse_args()

    names = args.engines.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        prompts, engines = cc.cell_engines(args, names, tmp)
        try:
            out = gm.interleave(engines, prompts, args.rounds, args.max_new_tokens,
                                dict(temperature=0.0, top_p=0.95, seed=0))
        finally:
            for e in engines.values():
                e.close()
    print(f"{args.model} residency {args.residency} {args.link} x {args.max_new_tokens} tokens, "
          f"{len(out[names[0]])} samples; ratio to {names[0]} [95% CI of the median]")
    for n in names:
        r = [a / b for a, b in zip(out[n], out[names[0]])]
        lo, hi = gm.median_ci(r)
        print(f"  {n:<40} median TPOT {statistics.median(out[n]) * 1e3:7.2f} ms  ratio {statistics.median(r):.3f} "
              f"[{lo:.2f}-{hi:.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
