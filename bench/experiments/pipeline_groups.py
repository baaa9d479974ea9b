"""What a process holds after opening pipelines' startup groups n times (issue 26): threads, open fds
and torch.distributed's groups on rank 0 of a 2-rank gloo group on this machine.

    python bench/experiments/pipeline_groups.py [--opens 6] [--keep]

Each open is `join` on the initialised group (a new startup group, as open_pipeline makes one), one
exchange on it, then `Group.end_startup()` as open_pipeline calls it after loading (--keep: not,
as before adbbadd, when each startup group lived as long as the process).
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def rank(opens: int, keep: bool) -> None:
    import torch.distributed as dist

    from specter.pipeline.group import join

    group = join("cpu", None, 120.0)
    before = len(os.listdir("/proc/self/task"))
    for _ in range(opens):
        g = join("cpu", None, 120.0)
        box = [None] if g.rank else ["x"]
        dist.broadcast_object_list(box, src=0, group=g.startup)
        if not keep:
            g.end_startup()
    if group.rank == 0:
        print(f"{opens} opens: threads {before} -> {len(os.listdir('/proc/self/task'))}, open fds "
              f"{len(os.listdir('/proc/self/fd'))}, groups {len(dist.distributed_c10d._world.pg_map)}")
    group.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--opens", type=int, default=6)
    ap.add_argument("--keep", action="store_true", help="keep each startup group (the old behaviour)")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank:
        rank(args.opens, args.keep)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", "--opens", str(args.opens)]
                              + (["--keep"] if args.keep else []),
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
             for r in range(2)]
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
