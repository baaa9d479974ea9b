"""Named ranges on the hot path, for Nsight Systems (NVTX) and torch.profiler traces.

    with span("draft step"): ...        # a shared no-op unless profiling is on

Ranges: "draft step" (one drafted token), "plan" (the planner reading lookahead rows and issuing
copies), "copy issue" (one expert copy handed to the link), "verify" (the verification pass),
"layer N" (each decoder layer, inside "draft step" or "verify"), "accept" (acceptance).

Off (the default) a span costs one function call returning a shared null context, and the layer
loop makes no call at all (it reads `ON`). On:
  - NVTX push/pop on CUDA, which `nsys profile -t cuda,nvtx` shows (SPECTER_NVTX=1 turns them on
    for a whole process, see README "Profiling");
  - torch.profiler user annotations (record_function), on CPU as on CUDA, while `trace` runs.
Inside torch.compile'd code spans are skipped (the traced graph must not depend on them).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

NULL = _NULL = contextlib.nullcontext()  # what a span site uses when ON is False: `span(n) if ON else NULL`
_on = {"nvtx": os.environ.get("SPECTER_NVTX", "") not in ("", "0"), "record": False}
ON = _on["nvtx"]  # any range on: read (not called) by the layer loop


class _Span:
    __slots__ = ("name", "rf")

    def __init__(self, name: str):
        self.name, self.rf = name, None

    def __enter__(self):
        if _on["nvtx"] and torch.cuda.is_available():
            torch.cuda.nvtx.range_push(self.name)
        if _on["record"]:
            self.rf = torch.profiler.record_function(self.name)
            self.rf.__enter__()
        return self

    def __exit__(self, *exc):
        if self.rf is not None:
            self.rf.__exit__(*exc)
        if _on["nvtx"] and torch.cuda.is_available():
            torch.cuda.nvtx.range_pop()
        return False


def span(name: str):
    """A context manager marking `name` on the timeline; free when profiling is off."""
    if torch.compiler.is_compiling() or not ON:  # is_compiling first: no guard on the flag
        return _NULL
    return _Span(name)


def enabled() -> bool:
    return ON


@contextlib.contextmanager
def ranges(*, record: bool = True, nvtx: bool | None = None):
    """Turn spans on for the duration (record: torch.profiler annotations; nvtx: default on CUDA)."""
    global ON
    old, was = dict(_on), ON
    _on["record"] = record
    _on["nvtx"] = torch.cuda.is_available() if nvtx is None else nvtx
    ON = _on["record"] or _on["nvtx"]
    try:
        yield
    finally:
        _on.update(old)
        ON = was


def trace(path: str | Path, fn, *, cuda: bool = False):
    """Run fn() under torch.profiler with spans on; write a Chrome/Perfetto trace to `path`.
    Returns fn's result."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof, ranges(record=True):
        result = fn()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return result
