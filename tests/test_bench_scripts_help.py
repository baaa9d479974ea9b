"""The bench scripts' command lines: `--help` prints the module docstring and exits 0 without running
anything (a script that ran its experiment instead would overrun the timeout), a bad argument is
argparse's error (exit 2), and the CUDA-only checks say so in one line on a CPU-only machine.
Each script runs in its own process, all at once: a few seconds in all, no experiment runs.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = ["bench/pinned_check.py", "bench/experiments/first_run_cost.py", "bench/experiments/align_pool_sizes.py",
           "bench/pipeline_draft_cache_reads.py", "bench/pipeline_timeline.py", "bench/experiments/slot_bound.py",
           "bench/experiments/sampling_coupling.py", "bench/experiments/penalty_cost.py",
           "bench/experiments/async_hop.py", "bench/device_summary.py"]
BAD = {  # calls the parsers with arguments refuse before any work (the option-less ones: the same one line)
    "bench/experiments/first_run_cost.py": ["--one", "nope"], "bench/experiments/align_pool_sizes.py": ["12x"],
    "bench/pipeline_draft_cache_reads.py": ["a", "b"], "bench/pipeline_timeline.py": ["record", "OUT"],
    "bench/device_summary.py": ["summary", "a", "b"]}


def _run_all(calls: list[tuple[str, list[str]]]) -> list[subprocess.CompletedProcess]:
    procs = [subprocess.Popen([sys.executable, str(REPO / s), *a], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for s, a in calls]
    done = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def test_help_and_bad_arguments():
    calls = [(s, ["--help"]) for s in SCRIPTS] + list(BAD.items())
    for (script, args), r in zip(calls, _run_all(calls)):
        if args == ["--help"]:
            first = ast.get_docstring(ast.parse((REPO / script).read_text())).splitlines()[0]
            assert r.returncode == 0 and r.stdout.startswith("usage:") and first in r.stdout, (script, r)
        else:
            assert r.returncode == 2 and "error:" in r.stderr and "Traceback" not in r.stderr, (script, args, r)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusal")
def test_cuda_checks_refuse_a_cpu_only_machine_in_one_line():
    calls = [("bench/pinned_check.py", []), ("bench/experiments/first_run_cost.py", [])]
    for (script, _), r in zip(calls, _run_all(calls)):
        assert r.returncode == 2 and r.stdout == "", (script, r)
        assert r.stderr.count("\n") == 1 and "needs a CUDA GPU" in r.stderr, (script, r.stderr)
