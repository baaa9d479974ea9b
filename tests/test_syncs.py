"""Host syncs per speculative cycle, counted on CPU.

`HostReads` counts every read of a tensor value by the host (item, int, bool, tolist, cpu,
device-to-host copies): on CUDA each one stalls until the GPU queue drains. With the sync-free
draft step (compiled/draft_step.py) and the piecewise verifier (compiled/verify_step.py):
  - K draft steps make zero reads (greedy and sampled): tokens stay on the device, lookahead rows
    reach the planner through the host mirror;
  - verification reads at most one small routing tensor per MoE layer, acceptance exactly one.
The counter itself is checked to see reads where they are (the eager draft reads every token).
On CPU fused_moe runs its torch reference backend, which groups routing on the host; on CUDA the
Triton kernels read it on the device, so reads inside that stand-in are not counted.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import specter
from specter.builder import _compiled_draft_step, _compiled_verify_step
from specter.compiled.capture import HostReads

PROMPT = [1, 5, 9, 33, 2, 17, 4]
K = 4
ACTIVE: list[HostReads] = []  # the counters running now (a draft's nests in its cycle's)


def counting():
    @contextlib.contextmanager
    def run():
        with HostReads() as r:
            ACTIVE.append(r)
            try:
                yield r
            finally:
                ACTIVE.remove(r)
    return run()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from specter.testing import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("syncs")
    make_tiny_checkpoint(path, "qwen3_moe", eos_token_id=None)
    ref = specter.load(path, device="cpu", policy="resident")
    eng = specter.load(path, device="cpu", policy="specter", residency=0.5)
    eng.decoder.governor.fixed = K
    yield ref, eng
    eng.close()
    ref.close()


def count_phases(engine, monkeypatch, **gen):
    """Generate, counting host reads in each cycle's draft and in the whole cycle."""
    import importlib

    fm = importlib.import_module("specter.triton_ops.fused_moe")  # the module (the package exports a function of that name)
    real_rows = fm.moe_rows_torch

    def device_stand_in(*a, **kw):  # the CPU stand-in for the Triton kernels (see the docstring)
        with contextlib.ExitStack() as stack:
            for r in list(ACTIVE):
                stack.enter_context(r.paused())
            return real_rows(*a, **kw)

    monkeypatch.setattr(fm, "moe_rows_torch", device_stand_in)
    dec, per_cycle = engine.decoder, []
    draft_name = "_draft_on_device" if dec.draft_step is not None else "_draft"
    real_draft, real_cycle = getattr(dec, draft_name), dec._cycle

    def draft(*a):
        with counting() as r:
            out = real_draft(*a)
        per_cycle[-1]["draft"] = r.count
        return out

    def cycle(t, n, k, *a):
        per_cycle.append({"k": k})
        with counting() as r:
            out = real_cycle(t, n, k, *a)
        per_cycle[-1]["rest"] = r.count - per_cycle[-1].get("draft", 0)  # a plain step (K = 0) drafts nothing
        return out

    monkeypatch.setattr(dec, draft_name, draft)
    monkeypatch.setattr(dec, "_cycle", cycle)
    out = engine.generate(PROMPT, max_new_tokens=20, **gen)
    monkeypatch.undo()
    return out, [c for c in per_cycle if c["k"] == K]


@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.9, top_k=20, seed=3)], ids=["greedy", "sampled"])
def test_sync_free_draft_makes_no_host_reads(engines, monkeypatch, sampling):
    ref, eng = engines
    eng.decoder.draft_step = _compiled_draft_step(eng.model, eng.decoder.draft, compile=False)
    eng.decoder.verify_step = _compiled_verify_step(eng.model, K, compile=False)  # the verifier's pieces
    try:
        out, cycles = count_phases(eng, monkeypatch, **sampling)
    finally:
        eng.decoder.draft_step = eng.decoder.verify_step = None
    assert len(cycles) >= 2
    moe_layers = eng.spec.n_moe_layers
    for c in cycles:
        assert c["draft"] == 0, c
        assert c["rest"] <= moe_layers + 1, c  # a routing read per MoE layer + the acceptance read
    if not sampling:
        assert out.token_ids == ref.generate(PROMPT, max_new_tokens=20).token_ids


def test_the_counter_sees_the_eager_draft_reads(engines, monkeypatch):
    _, eng = engines
    _, cycles = count_phases(eng, monkeypatch)
    # the eager draft reads every drafted token back (and the planner its lookahead rows)
    assert cycles and all(c["draft"] >= K + 1 for c in cycles), cycles
