"""bench/pipeline_sim.py runs the real OptimisticCycles and Governor on a virtual clock. It broke silently
once (a decoder method it did not have); this runs it, one seed and generation a case, on every world."""
import importlib.util
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def sim(monkeypatch):
    spec = importlib.util.spec_from_file_location("pipeline_sim", REPO / "bench" / "pipeline_sim.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # as its main() does: the virtual clock, and no K/V to save on rank 0
    monkeypatch.setattr(mod.optimistic, "time", types.SimpleNamespace(perf_counter=mod.CLOCK.perf_counter))
    monkeypatch.setattr(mod.optimistic, "kv_rows", lambda *a: None)
    monkeypatch.setattr(mod.optimistic, "put_kv_rows", lambda *a: None)
    return mod


@pytest.mark.parametrize("world", ["quiet", "draft-bound", "slow-verify", "low-accept"])
def test_the_simulator_runs_a_pinned_k_and_the_governor(sim, world):
    """Every cycle commits the target's tokens (the simulator asserts it); a pinned K runs K, or its
    fresh_share on a fresh draft, or less at a generation's end (where drafting is the pace, a kept
    chain stays at the fresh K: its pre-draft stops at the running K once the result says kept);
    the counters add up."""
    w = sim.WORLDS[world]
    per, ks, _ = sim.run(w, 0, 1, 8)
    assert len(per) == 1 and per[0] > 0
    assert set(ks[:-3]) <= {4, 8} and 4 in ks and (8 in ks) == (world != "draft-bound"), ks
    per, ks, why = sim.run(w, 0, 2, None)
    assert len(per) == 2 and all(p > 0 for p in per)
    assert any(ks) and ks.count(0) == sum(why.values()), (ks, why)  # plain steps, each with its reason
    p = sim.Pipeline(w, sim.Pinned(6), 1)
    ks = p.generate(1000, 64)
    o = p.opt
    assert o["kept_cycles"] > 0 and o["fresh_cycles"] > 0, o
    # every token but the first (the prompt's step) and any plain step's came from a cycle
    assert o["kept_tokens"] + o["fresh_tokens"] == 63 - ks.count(0), o
