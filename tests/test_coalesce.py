"""Coalesced copies (issue 24): a layer call's misses cross the link in one transfer, charged one
latency and their bytes at bandwidth, each expert landing in its own slot with the bits of one copy
per expert; on CUDA the transfer waits for every slot's last reader; a staged (unpinned) CudaLink
copies one expert a transfer. And `specter bench --compare-compressed`."""
from __future__ import annotations

import json

import pytest
import torch

from specter.moe import ExpertWeights, ResidentExperts
from specter.offload.coded import encode_store
from specter.offload.link import EmulatedLink
from specter.offload.manager import OffloadedExperts

from test_compressed import PROMPTS, plain_link  # noqa: F401 (a fixture)
from test_link import VirtualClock, fake_link


def _store(L=2, E=8, H=32, I=16, bf16=False):
    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16 if bf16 else torch.float32
    return [ExpertWeights((torch.randn(E, 2 * I, H, generator=g) * 0.1).to(dt), (torch.randn(E, H, I, generator=g) * 0.1).to(dt))
            for _ in range(L)]


def _logged(link):
    """link.copy wrapped: returns the list of (tag, transfer) it issued."""
    log, real = [], link.copy
    link.copy = lambda dst, src, **kw: log.append((kw.get("tag"), t := real(dst, src, **kw))) or t
    return log


def test_a_calls_misses_are_one_transfer_charged_one_latency():
    store = _store()
    clock, lat, bw = VirtualClock(), 1e-3, 1e6
    with EmulatedLink(bw, lat, clock=clock) as link:
        mgr = OffloadedExperts(store, 4, torch.device("cpu"), link)
        log = _logged(link)
        x, ids, w = torch.randn(1, 32), torch.tensor([[1, 5, 6]]), torch.tensor([[0.5, 0.3, 0.2]])
        out = mgr(0, x, ids, w)
        (tag, t), = log
        assert tag == (0, (1, 5, 6)) and t.done()
        nbytes = 3 * store[0].expert_nbytes()
        assert t.nbytes == nbytes and mgr.stats()["h2d_bytes"] == nbytes
        assert t.seconds == pytest.approx(lat + nbytes / bw)        # one latency, not three
        assert clock.now() == pytest.approx(lat + nbytes / bw)
        # the measured cost a copy (LaneChoice, the draft's planner): one expert's share of the transfer
        assert link.copy_seconds(store[0].expert_nbytes()) == pytest.approx(t.seconds / 3)
        torch.testing.assert_close(out, ResidentExperts(store)(0, x, ids, w), rtol=0, atol=0)
        for e in (1, 5, 6):
            assert mgr.slots.is_ready(0, e) and (0, e) not in mgr.inflight
        log.clear()
        mgr(0, x, torch.tensor([[2, 5, 6]]), w)  # one miss: a copy of its own
        assert [tag for tag, _ in log] == [(0, 2)]


@pytest.mark.parametrize("coded", [False, True])
def test_coalesced_and_one_by_one_give_the_same_bits_and_bytes(coded):
    """Random routings, one token and a verification's several, through a pool smaller than a call's
    misses at times: coalesced or not, the same rows and bytes, fewer transfers coalesced."""
    store = _store(bf16=True)
    if coded:
        store = encode_store(store)
    ref = ResidentExperts([ExpertWeights(s.w13.float(), s.w2.float()) for s in _store(bf16=True)])
    g = torch.Generator().manual_seed(1)
    calls = []
    for _ in range(30):
        T = int(torch.randint(1, 5, (1,), generator=g))
        ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(T)])
        calls.append((int(torch.randint(0, 2, (1,), generator=g)), torch.randn(T, 32, generator=g), ids,
                      torch.softmax(torch.randn(T, 2, generator=g), -1)))
    results = {}
    for together in (False, True):
        with EmulatedLink(1e9, 1e-5) as link:
            mgr = OffloadedExperts(store, 3, torch.device("cpu"), link, dtype=torch.float32)
            mgr.coalesce = together
            outs = [mgr(layer, x, ids, w) for layer, x, ids, w in calls]
            link.synchronize()
            results[together] = (outs, mgr.stats()["h2d_bytes"], link.stats["transfers"], mgr.stats()["expert_misses"])
            mgr.slots.check()
    for (layer, x, ids, w), a, b in zip(calls, results[False][0], results[True][0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(b, ref(layer, x, ids, w), rtol=0, atol=0)
    assert results[False][1] == results[True][1] > 0 and results[False][3] == results[True][3]
    assert results[True][2] < results[False][2] == results[False][3]


def test_cuda_coalesced_copy_waits_for_each_slots_last_reader_and_staging_does_not_coalesce():
    store = _store(L=1, E=4, H=16, I=4)
    link, cuda = fake_link(pinned=True)
    with link:
        assert link.coalesces
        mgr = OffloadedExperts(store, 2, torch.device("cpu"), link, pool=2)
        x, w = torch.randn(1, 16), torch.tensor([[0.5, 0.5]])
        mgr(0, x, torch.tensor([[0, 1]]), w)  # two misses, then computed: each slot read
        link.synchronize()
        readers = {mgr.last_read[mgr.slots.slot_of(0, e)] for e in (0, 1)}
        assert len(readers) == 1 and None not in readers  # one call read both slots
        cuda.launch("later compute")
        mark, before = len(cuda.log), link.stats["transfers"]
        mgr(0, x, torch.tensor([[2, 3]]), w)  # evicts 0 and 1: one transfer, after both slots' reader
        link.synchronize()
        assert link.stats["transfers"] == before + 1
        waits = cuda.copy_waits(mark)
        assert waits and all(kind == "wait_event" and stream == "urgent" and ev in readers for kind, stream, ev in waits)
    link, _ = fake_link(pinned=False)
    with link:
        mgr = OffloadedExperts(store, 2, torch.device("cpu"), link, pool=2)
        assert not link.coalesces and not mgr.coalesce  # a staging buffer holds one expert
        mgr(0, x, torch.tensor([[0, 1]]), w)
        link.synchronize()
        assert link.stats["transfers"] == 2


def test_bench_compare_compressed(capsys, tiny, tmp_path, plain_link):  # noqa: F811
    from specter.bench import run_bench
    from specter.cli import main
    from specter.errors import ConfigError

    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    res = run_bench(str(path), ["on-demand", "specter"], prompts=PROMPTS[:2], max_new_tokens=8, residency=0.25,
                    device="cpu", compare_compressed=True)
    assert list(res["policies"]) == ["on-demand", "on-demand+coded", "specter", "specter+coded"]
    for p in ("on-demand", "specter"):
        c, raw, coded = res["coded_vs_raw"][p], res["policies"][p], res["policies"][p + "+coded"]
        assert c["same_tokens"] is True and coded["lossless_vs_on-demand"] is True
        assert c["tpot_speedup"] == pytest.approx(raw["tpot_s"] / coded["tpot_s"])
    c = res["coded_vs_raw"]["on-demand"]
    assert 0 < c["h2d_bytes_ratio"] < 1
    with pytest.raises(ConfigError, match="compare_compressed"):
        run_bench(str(path), ["on-demand"], prompts=PROMPTS[:1], max_new_tokens=2, residency=0.25, device="cpu",
                  compare_compressed=True, compress_experts=True)
    with pytest.raises(ConfigError, match="compare-compressed.*bf16 checkpoint; .* stores float32: drop it"):
        run_bench(str(tiny("qwen3_moe")[0]), ["on-demand"], prompts=PROMPTS[:1], max_new_tokens=2, residency=0.25,
                  device="cpu", compare_compressed=True)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS[:1]))
    argv = ["bench", "--model", str(path), "--device", "cpu", "--policies", "on-demand", "--residency", "0.25",
            "--prompts", str(prompts), "--max-new-tokens", "4", "--compare-compressed"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "on-demand+coded" in out and "coded (--compress-experts) against raw" in out, err
    assert main(argv + ["--compress-experts"]) == 2
    assert "--compare-compressed" in capsys.readouterr().err
