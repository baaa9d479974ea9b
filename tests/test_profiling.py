"""Profiling: named ranges on the hot path, and stall time measured on the device.

1. `specter profile --trace FILE.json` writes a Chrome/Perfetto trace of a short speculative
   generation holding every named range (draft step, plan, copy issue, verify, layer N, accept).
2. Ranges are free when profiling is off: `span` hands back one shared null context, and a
   profiled generation outside `ranges()` records none of them.
3. CUDA stall time: each wait's (compute reached, copy done) event pair counts max(0, done -
   reached); pairs not yet complete count later (event arithmetic checked with fake events here,
   on a real GPU below).
"""
from __future__ import annotations

import collections
import json
import types

import pytest
import torch

import specter
from specter import profiling
from specter.cli import main
from specter.offload.cuda_link import CudaLink

RANGES = {"draft step", "plan", "copy issue", "verify", "layer 0", "accept"}


def annotations(path) -> collections.Counter:
    events = json.loads(path.read_text())["traceEvents"]
    return collections.Counter(e["name"] for e in events if e.get("cat") == "user_annotation")


def test_profile_trace_has_the_named_ranges(tiny, tmp_path, capsys):
    path, _ = tiny("qwen3_moe")
    out = tmp_path / "trace.json"
    rc = main(["profile", "--trace", str(out), "--model", str(path), "--device", "cpu", "--residency", "0.5",
               "--max-new-tokens", "24"])
    assert rc == 0, capsys.readouterr()
    assert "wrote" in capsys.readouterr().out
    seen = annotations(out)
    assert RANGES <= set(seen), RANGES - set(seen)
    assert seen["verify"] == seen["accept"]  # one of each a cycle
    assert not profiling.enabled()           # and off again afterwards


def test_spans_are_free_and_silent_when_off(tiny, tmp_path):
    assert profiling.span("draft step") is profiling.span("verify")  # the shared null context
    path, _ = tiny("qwen3_moe")
    engine = specter.load(path, device="cpu", policy="specter", residency=0.5)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.generate([1, 5, 9], max_new_tokens=8)
        prof.export_chrome_trace(str(tmp_path / "off.json"))
    finally:
        engine.close()
    assert not RANGES & set(annotations(tmp_path / "off.json"))


class FakeEvent:
    def __init__(self, t_ms: float, done: bool = True):
        self.t, self.done = t_ms, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "FakeEvent") -> float:
        return end.t - self.t


def test_cuda_stall_arithmetic_with_fake_events():
    link = types.SimpleNamespace(_waits=collections.deque(), _stall_s=0.0)
    link._collect_stalls = lambda: CudaLink._collect_stalls(link)
    pending = FakeEvent(50.0, done=False)
    link._waits.extend([(FakeEvent(0.0), FakeEvent(3.0)),    # waited 3 ms
                        (FakeEvent(10.0), FakeEvent(8.0)),   # landed before compute got there: 0
                        (FakeEvent(20.0), pending)])         # not complete: counts next time
    assert CudaLink.drain_stall_s(link) == pytest.approx(0.003)
    pending.done = True
    assert CudaLink.drain_stall_s(link) == pytest.approx(0.030)
    assert CudaLink.drain_stall_s(link) == 0.0 and not link._waits


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_stall_is_measured():
    with CudaLink("cuda") as link:
        src = torch.randn(64 << 20).pin_memory()           # 256 MB: milliseconds over PCIe
        dst = torch.empty_like(src, device="cuda")
        link.copy(dst, src).wait()                          # compute waits at once: a real stall
        torch.cuda.synchronize()
        assert link.drain_stall_s() > 1e-4
