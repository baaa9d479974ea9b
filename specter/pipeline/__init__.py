"""Layer pipeline over torch.distributed: each rank runs a contiguous range of decoder layers.

    group.py    the process group: torchrun's environment (or one already initialised), the
                backend (NCCL between GPUs, gloo on CPU), collective timeouts, errors on every rank
    stages.py   layer ranges balanced by bytes, one per rank; the checkpoint-and-config fingerprint
                every rank must share
    stage.py    one rank's part: its layers' weights, KV cache and expert provider, and the pieces
                it hands the model's own layer loop (MoETransformer.run)
    load.py     loading a rank's stage from its layers' tensors of the checkpoint
    wire.py     the messages' header and flags, and `Wire`: this rank's sends and receives
    decoder.py  the protocol, plain decoding's rank-0 decoder (an Engine decoder) and every other
                rank's loop
    speculative.py  rank 0's decoder for spec-lru and specter: SpeculativeDecoder over stand-ins
                for the model and the offload manager that reach every stage (standins.py)
    optimistic.py   its greedy cycles: rank 0 drafts the next cycle while the others verify
    launch.py   `torchrun ... -m specter generate|chat|serve`: the whole run on one rank, errors included
    bench.py    `torchrun ... -m specter bench`: the pipelined policies, per-rank stats
    plan.py     `specter plan --ranks N`: what each rank holds, and whether it fits

This module stays light (no torch): the CLI asks `launched()` before anything loads.
"""
from __future__ import annotations

import os
import re

def rank_prefixed(message: str) -> str:
    """Under torchrun, `message` as "rank R of N: message" (this process's rank), unless it names a rank
    first already (a peer's failure, relayed); else as it is."""
    if not launched() or re.match(r"rank \d+ of \d+: ", message):
        return message
    return f"rank {os.environ.get('RANK', '0')} of {os.environ['WORLD_SIZE']}: {message}"


def launched() -> bool:
    """True when this process is one rank of several (torchrun's WORLD_SIZE > 1)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def run(args, body, serving: bool = False, waits: bool = False) -> int:
    """The CLI's pipelined `generate`, `chat` and `serve` (see launch.py)."""
    from .launch import run as launch_run

    return launch_run(args, body, serving, waits)


def bench(args) -> int:
    """The CLI's pipelined `bench` (see bench.py)."""
    from .bench import run as bench_run

    return bench_run(args)
