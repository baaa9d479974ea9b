"""The alignment kernel compiled ahead of time at the weight-row counts the engine passes it: R is the
one slot pool every layer shares (n_layers x slots a layer: thousands on a big GPU), which
triton_ops/aot.py's engine_launches never reaches (a per-layer pool of E/4). Registers, spill bytes
and shared memory per target, from the launch align_rows_triton makes for one decode step (T = 1,
top-8 over 128 experts) at each R.

    python bench/experiments/align_pool_sizes.py 128 2048 4096 6144
    PYTHONPATH=.triton-lowest python bench/experiments/align_pool_sizes.py 6144   # Triton 3.6
"""
from __future__ import annotations

import argparse

import torch
import triton

from specter.triton_ops import aot, kernels


def main(pools: list[int]) -> None:
    print(f"triton {triton.__version__}")
    for R in pools:
        with aot.recording() as log:
            kernels.align_rows_triton(torch.randint(0, 128, (1, 8)), R, torch.randperm(max(R, 128))[:128].int())
        for cc in aot.TARGETS:
            r = aot.inspect(log[0], cc)
            print(f"R {R:6d}  sm_{cc}: {r.registers} registers, {r.spill_bytes} B spilled, {r.shared_bytes} B shared")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pools", nargs="*", type=int, metavar="R", help="weight-row counts (default: 128 2048 4096 6144)")
    main(ap.parse_args().pools or [128, 2048, 4096, 6144])
