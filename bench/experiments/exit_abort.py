"""How often a 2-rank `specter generate` exits with an abort (issue 26): the command of
tests/test_pipeline.py::test_rank_0_shares_one_processs_draft_cache's miss, run N times over a tiny
deepseek_v2 checkpoint, each rank launched as the tests launch them (rank 0 hosts the store), with
Python's faulthandler on; stops at the first rank whose exit status is not 0 and prints its stderr.

    python bench/experiments/exit_abort.py [--runs 150] [--core]

--core: run the ranks with core dumps on, in the scratch directory (then `gdb -batch -ex "thread
apply all bt" python core` names the thread that aborted).
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from specter.testing import make_tiny_checkpoint  # noqa: E402


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=150)
    ap.add_argument("--core", action="store_true")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="exit-abort-"))
    ck = tmp / "ck"
    make_tiny_checkpoint(ck, "deepseek_v2", vocab_size=131)
    if a.core:
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    argv = [sys.executable, "-m", "specter", "generate", "--model", str(ck), "--prompt-ids", "1,5,9,17,33",
            "--max-new-tokens", "10", "--greedy", "--residency", "0.5", "--json", "--pipeline-timeout", "60",
            "--draft-cache"]
    for run in range(a.runs):
        shutil.rmtree(tmp / "cache", ignore_errors=True)  # a miss: rank 0 quantises and writes the draft
        env = dict(os.environ, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port()),
                   PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
        procs = [subprocess.Popen(argv + [str(tmp / ("cache" if r == 0 else "rank1"))],
                                  env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), cwd=tmp,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
        outs = [p.communicate(timeout=600) for p in procs]
        codes = [p.returncode for p in procs]
        if codes != [0, 0]:
            print(f"run {run + 1}: exit statuses {codes}")
            for r, (_, err) in enumerate(outs):
                print(f"rank {r} stderr:\n{err[-1500:]}")
            print(f"scratch (checkpoint, core if --core): {tmp}")
            return
    print(f"{a.runs} runs, every rank exited 0")
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
