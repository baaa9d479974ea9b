"""The emulated link's calibration passes (offload/calibrate.py): each pass's expert throughput, and the
fastest over the median, for several calibrations of the bundled model's expert shape in one process.
The link's time scale is taken from the fastest pass (it was the median).

    python bench/experiments/calibration_passes.py [--runs 6]
"""
from __future__ import annotations

import argparse
import builtins
import statistics

import specter
from specter.offload import calibrate


def main(runs: int) -> None:
    spec = specter.load(None, device="cpu", policy="resident").model.spec
    real, seen = builtins.max, []

    def spy(*a, **kw):  # measure_expert_throughput's rates, as it takes their max (a module global over the builtin)
        if len(a) == 1 and isinstance(a[0], list):
            seen.append(list(a[0]))
        return real(*a, **kw)

    calibrate.max = spy
    try:
        for _ in range(runs):
            calibrate._THROUGHPUT_CACHE.clear()
            calibrate.measure_expert_throughput(spec.hidden, spec.expert_inter)
            r = seen[-1]
            print(f"{len(r)} passes, GB/s: {' '.join(f'{x / 1e9:.2f}' for x in r)}; "
                  f"fastest / median {max(r) / statistics.median(r):.3f}")
    finally:
        del calibrate.max


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=6)
    main(ap.parse_args().runs)
