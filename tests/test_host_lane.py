"""The host lane and the `host` policy: bit-identical rows, emulated time from the profile, injected
costs (never wall-clock bounds from load), and greedy decoding equal to `resident`.

The greedy-equality loops over policies live in tests/test_offload.py (LOSSLESS_POLICIES includes
`host`); here: the lane alone, its cost model, the profiles' hosts and the policy's wiring."""
from __future__ import annotations

import asyncio
import json
import types

import pytest
import torch

import specter
from specter.cli import main
from specter.moe import ExpertWeights
from specter.offload.calibrate import available_profiles, emulated_host_params, load_profile
from specter.offload.host_experts import HostExperts
from specter.offload.host_lane import HostLane, default_host_threads, make_host_lane, physical_cores
from specter.offload.link import EmulatedLink
from specter.triton_ops import expert_rows

E, H, I = 8, 48, 40


def _store(dtype=torch.bfloat16, seed=0) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    return ExpertWeights((torch.randn(E, 2 * I, H, generator=g) * 0.1).to(dtype),
                         (torch.randn(E, H, I, generator=g) * 0.1).to(dtype))


def _routing(T, k=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # [T, k]
    w = torch.rand(T, k, generator=g)
    return torch.randn(T, H, generator=g), ids, w


def _resident_tokens(path, prompts, n: int) -> list[list[int]]:
    """Plain resident decoding's greedy tokens: what every policy here must give (not degenerate, so that
    comparing with them can fail: full length, several distinct tokens)."""
    ref = specter.load(path, device="cpu", policy="resident")
    try:
        want = [ref.generate(p, max_new_tokens=n).token_ids for p in prompts]
    finally:
        ref.close()
    assert all(len(t) == n for t in want) and len({t for ts in want for t in ts}) > 5, want
    return want


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16])
def test_lane_rows_are_the_devices_bits(threads, T, storage):
    """fp32 compute over the store (converted per expert when it is bf16) gives exactly the rows the
    emulated device computes from an fp32 pool holding the same experts, however the lane splits them."""
    store = _store(storage)
    pool = ExpertWeights(store.w13.float(), store.w2.float())  # what converting copies put in a slot pool
    x, ids, w = _routing(T)
    cold = sorted(set(ids.flatten().tolist()))[::2]
    remap = torch.full((E,), -1, dtype=torch.int32)
    remap[cold] = torch.tensor(cold, dtype=torch.int32)
    lane = HostLane([store], "cpu", threads=threads, dtype=torch.float32)
    try:
        job = lane.submit(0, x, ids, w, cold)
        assert job.wait() >= 0.0 and job.done() and not job.failed()
    finally:
        lane.close()
    want = expert_rows(x, ids, w, pool.w13, pool.w2, remap=remap)
    assert torch.equal(job.rows, want)
    assert torch.count_nonzero(job.rows.abs().sum(-1)) == (remap[ids] >= 0).sum()  # only the cold rows
    assert lane.stats["jobs"] == 1 and lane.stats["experts"] == len(cold)


@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float16, torch.float32])
def test_the_lanes_cuda_branch_orders_its_copies_and_returns_the_inputs_dtype(compute):
    """The lane as it runs beside a GPU, on a CPU: FakeCuda's streams and events log what is ordered
    after what (tests/test_link.py), the CPU playing the device. The inputs are staged after an event
    on the compute stream that the lane's thread waits for before it reads them; it computes over the
    bf16 store in the store's dtype (make_host_lane's choice on CUDA); the rows come back on the lane's
    own stream, in the inputs' dtype (merge_rows would otherwise promote a float16 step's rows to
    float32), and wait() orders the compute stream after their event."""
    from test_link import FakeCuda

    store = _store(torch.bfloat16)
    x, ids, w = _routing(3)
    x, w = x.to(compute), w.to(compute)
    cold = sorted(set(ids.flatten().tolist()))[::2]
    remap = torch.full((E,), -1, dtype=torch.int32)
    remap[cold] = torch.tensor(cold, dtype=torch.int32)
    cuda = FakeCuda(pinned=True)
    lane = HostLane([store], "cpu", threads=2, cuda=cuda)
    try:
        job = lane.submit(0, x, ids, w, cold)
        assert job.wait() >= 0.0 and not job.failed()
    finally:
        lane.close()
    want = expert_rows(x.bfloat16(), ids, w, store.w13, store.w2, remap=remap)
    assert job.rows.dtype == compute and torch.equal(job.rows, want.to(compute))
    log = cuda.log
    inputs = log.index(("record", "compute", job._inputs))
    read = log.index(("sync", "specter-host", job._inputs))  # the lane's thread, before it computes
    back = log.index(("record", "copy", job._event))          # the rows' copy, on the lane's stream
    assert inputs < read < back < log.index(("wait_event", "compute", job._event))


def test_a_job_completes_no_earlier_than_its_charge_and_jobs_queue():
    """Injected costs: each job takes at least its charge after the previous one's completion."""
    store = _store()
    x, ids, w = _routing(1)
    lane = HostLane([store], "cpu", threads=1, dtype=torch.float32, charge=lambda job: 0.03)
    try:
        a = lane.submit(0, x, ids, w, list(range(E)))
        b = lane.submit(0, x, ids, w, list(range(E)))
        b.wait()
        assert a.done() and b.deadline >= a.deadline + 0.03 - 1e-9
        assert a.t_finished - a.t_enqueued >= 0.03 and b.t_finished - a.t_enqueued >= 0.06
    finally:
        lane.close()


def test_errors_reach_the_waiter_and_await_works():
    store = _store()
    x, ids, w = _routing(2)
    lane = HostLane([store], "cpu", threads=1, dtype=torch.float32)
    try:
        bad = lane.submit(0, x[:, :3], ids, w, list(range(E)))  # wrong hidden size
        with pytest.raises(specter.SpecterError):
            bad.wait()
        assert bad.failed()

        async def run():
            job = lane.submit(0, x, ids, w, list(range(E)))
            stalled = await job.landed()
            assert await job is job
            return stalled, job

        stalled, job = asyncio.run(run())
        assert stalled >= 0 and job.rows.shape == (2, 2, H)
    finally:
        lane.close()
    with pytest.raises(RuntimeError, match="closed"):
        lane.submit(0, x, ids, w, list(range(E)))


def test_every_profile_describes_its_host_with_sources():
    for name in available_profiles():
        p = load_profile(name)
        assert p.host and p.host_cores >= 1 and p.host_core_flops > 0 and p.host_latency > 0, name
        assert 0 < p.host_memory_bandwidth <= p.host_memory_theoretical_bandwidth, name
        assert p.pcie_bandwidth < p.host_memory_bandwidth < p.device_memory_bandwidth, name
        assert any("http" in s for s in p.host_sources), name


def test_host_cost_model_is_the_profile_slowed_by_the_links_time_scale():
    p = load_profile("A100-40GB-PCIe4")
    h1, h4 = emulated_host_params(p, 1.0), emulated_host_params(p, 4.0)
    bw = p.host_memory_bandwidth * p.host_gemv_efficiency
    assert 0 < p.host_gemv_efficiency <= 1 and h1.bandwidth == bw and h4.bandwidth == bw / 4
    assert h4.latency == 4 * p.host_latency
    mb = 10 << 20
    one = h1.seconds(weight_bytes=mb, flops=0, act_bytes=0)
    assert one == pytest.approx(p.host_latency + mb / bw)
    assert h4.seconds(weight_bytes=mb, flops=0, act_bytes=0) == pytest.approx(4 * one)
    # past the ridge point the cores bound it: compute-bound time grows with the tokens
    flops = 1000 * mb
    assert h1.seconds(mb, flops, 0) == pytest.approx(p.host_latency + flops / (p.host_cores * p.host_core_flops))


def test_make_host_lane_charges_only_a_profiled_cpu_link():
    store = [_store()]
    plain = EmulatedLink(1e9, 0.0)
    try:
        assert make_host_lane(store, "cpu", plain, threads=1).charge is None  # a test's link: real time
        plain.profile, plain.time_scale = load_profile(None), 50.0
        lane = make_host_lane(store, "cpu", plain, threads=1, dtype=torch.float32)
        x, ids, w = _routing(1)
        job = lane.submit(0, x, ids, w, list(range(E)))
        job.wait()
        p = emulated_host_params(plain.profile, 50.0)
        want = p.seconds(weight_bytes=2 * 3 * H * I * 4, flops=2 * 6 * H * I, act_bytes=(H + 2 * H) * 4)
        assert lane.charge(job) == pytest.approx(want)
        assert job.t_finished - job.t_enqueued >= want
        lane.close()
    finally:
        plain.close()
    assert physical_cores() >= 1 and default_host_threads() == max(1, physical_cores() - 1)


def test_host_policy_copies_nothing_and_decodes_residents_tokens(tiny):
    path, _ = tiny("qwen2_moe", mlp_only_layers=[0])
    prompts = [[1, 5, 9, 33, 2], list(range(10, 40))]
    want = _resident_tokens(path, prompts, 12)
    engine = specter.load(path, device="cpu", policy="host", residency=0.25, host_threads=2)
    try:
        mgr = engine.decoder.experts
        assert isinstance(mgr, HostExperts) and mgr.lane.threads == 2
        outs = [engine.generate(p, max_new_tokens=12) for p in prompts]
        st = mgr.stats()  # the last generation's; what the pipeline's per-rank counters read
        assert st["offloaded_bytes"] == st["h2d_bytes"] + st["host_bytes"] > 0
    finally:
        engine.close()
    assert [o.token_ids for o in outs] == want
    for o in outs:
        s = o.stats
        assert s["h2d_bytes"] == 0 and s["host_experts"] == s["expert_misses"] > 0 and s["expert_hits"] > 0
        assert s["host_bytes"] > 0 and s["host_stall_s"] <= s["stall_s"] + 1e-12


def test_host_threads_is_refused_where_it_would_be_ignored(tiny, capsys):
    path, _ = tiny("mixtral")
    with pytest.raises(specter.ConfigError, match="host_threads"):
        specter.load(path, device="cpu", policy="on-demand", residency=0.5, host_threads=2)
    with pytest.raises(specter.ConfigError, match="host_threads"):
        specter.load(path, device="cpu", policy="host", residency=0.5, host_threads=0)
    assert main(["generate", "--model", str(path), "--prompt-ids", "1,2", "--policy", "spec-lru",
                 "--host-threads", "2"]) == 2
    assert "--host-threads" in capsys.readouterr().err


def test_profile_prints_the_host_lane_beside_the_profiles(monkeypatch, capsys):
    import specter.offload.calibrate as calibrate
    import specter.offload.host_measure as host_measure

    monkeypatch.setattr(calibrate, "measure_expert_throughput", lambda *a, **k: 5e9)
    fake = host_measure.measure(1, tokens=(1, 4), shapes={"Tiny": (64, 32)}, budget_s=0.005)
    assert {r["mode"] for r in fake["lane"]} == {"fp32", "bf16", "bf16->fp32"} and fake["stream_GBps"] > 0
    assert all(r["GBps"] > 0 for r in fake["lane"])
    monkeypatch.setattr(host_measure, "measure", lambda threads: {**fake, "threads": threads})
    assert main(["profile", "--host-threads", "3"]) == 0
    out = capsys.readouterr().out
    for name in available_profiles():
        assert load_profile(name).host in out
    assert "host lane (3 threads)" in out and "Tiny 64x32" in out and "bf16 T=4" in out
    assert main(["profile", "--json", "--no-host"]) == 0
    import json
    got = json.loads(capsys.readouterr().out)
    assert got["host_lane"] is None and all(r["emulated_host_MBps"] > 0 for r in got["profiles"])
    assert got["expert_throughput_Bps"] == 5e9 and not got["pinned"]
    # pinned: the figure every engine's link then takes (profile measured its own and said nothing of it)
    monkeypatch.setenv("SPECTER_EXPERT_THROUGHPUT", "2e9")
    assert main(["profile", "--json", "--no-host"]) == 0
    pinned = json.loads(capsys.readouterr().out)
    assert pinned["pinned"] and pinned["expert_throughput_Bps"] == 2e9
    assert pinned["profiles"][0]["emulated_MBps"] == pytest.approx(got["profiles"][0]["emulated_MBps"] * 2 / 5)
    assert main(["profile", "--no-host"]) == 0 and "pinned by SPECTER_EXPERT_THROUGHPUT: 2.00 GB/s" in \
        capsys.readouterr().out
    monkeypatch.setenv("SPECTER_EXPERT_THROUGHPUT", "abc")
    assert main(["profile", "--no-host"]) == 2 and "must be a number of bytes/s" in capsys.readouterr().err


def test_bench_names_the_host_lanes_wait():
    from specter.bench import format_table, time_split

    r = dict(tpot_s=0.01, ttft_s=0.1, decode_s=2.0, decode_stall_s=1.0, speedup_vs_a=1.0, lossless_vs_a=True,
             host_experts=10, host_bytes=5e6, h2d_bytes=0)
    assert time_split(r) == "host wait 50% | compute 50%"
    assert time_split(dict(r, host_experts=0)) == "copy stall 50% | compute 50%"
    assert time_split(dict(r, h2d_bytes=1)) == "copy+host stall 50% | compute 50%"
    assert "host MB" in format_table({"policies": {"a": r}}) and "     5.0" in format_table({"policies": {"a": r}})


# ------------------------------------------------------------------------- specter: both lanes (item 4)
class _HalfToHost:
    """An injected lane choice: every other missing expert to the host, the rest copied."""

    def __init__(self, mgr, params, planner=None):
        self.calls = 0

    def __call__(self, layer, missing, routed):
        self.calls += 1
        return missing[::2]


class _AllToHost(_HalfToHost):
    """Every missing expert to the host: nothing is copied after warm-up."""

    def __call__(self, layer, missing, routed):
        self.calls += 1
        return list(missing)


@pytest.mark.parametrize("arch,kw", [("deepseek_v2", {}), ("qwen2_moe", {"mlp_only_layers": [0]}), ("mixtral", {})])
def test_specter_greedy_equals_resident_on_both_lanes(tiny, monkeypatch, arch, kw):
    """specter's misses split between copies and the host lane, at fixed K (0 = plain steps on both
    lanes, and drafts of several lengths) and under the governor: resident's tokens every time."""
    import specter.builder as builder
    from specter.speculative.governor import Governor

    path, _ = tiny(arch, **kw)
    prompts = [[1, 5, 9, 33, 2], list(range(10, 40))]
    want = _resident_tokens(path, prompts, 16)
    monkeypatch.setattr(builder, "LaneChoice", _HalfToHost)
    for residency, k_max, fixed in ((0.25, 4, None), (0.5, 8, None), (0.375, 0, None), (0.25, 8, 0), (0.25, 8, 1),
                                    (0.375, 8, 3), (0.25, 8, 7)):
        engine = specter.load(path, device="cpu", policy="specter", residency=residency, k_max=k_max,
                              host_threads=2)
        if fixed is not None:
            engine.decoder.governor = Governor(k_max, fixed=fixed)
        try:
            outs = [engine.generate(p, max_new_tokens=16) for p in prompts]
            assert engine.decoder.experts.host_choice.calls > 0
        finally:
            engine.close()
        assert [o.token_ids for o in outs] == want, (residency, k_max, fixed)
        assert sum(o.stats["host_experts"] for o in outs) > 0 and sum(o.stats["h2d_bytes"] for o in outs) > 0
        # the lane's own counters, as policy host reports them (they were the defaults: None, 0.0)
        assert all(o.stats["host_threads"] == 2 for o in outs)
        assert all((o.stats["host_busy_s"] > 0) == (o.stats["host_experts"] > 0) for o in outs)
        if fixed:
            assert sum(o.stats["drafted_tokens"] for o in outs) > 0


@pytest.mark.parametrize("policy", ["host", "specter"])
def test_the_lanes_cuda_branch_in_the_engine_gives_residents_tokens(tiny, monkeypatch, policy):
    """Every host lane the builder makes takes its CUDA branch on FakeCuda (the CPU plays the device):
    pinned inputs after an event, the rows back on the lane's stream, a stream wait for each job, over
    whole generations (host: every miss; specter: half of them, K fixed at 3, then the governor).
    The CPU computes in the device's dtype, so the tokens are resident's exactly."""
    import specter.builder as builder
    from specter.speculative.governor import Governor
    from test_link import FakeCuda

    path, _ = tiny("qwen3_moe")
    prompts = [[1, 5, 9, 33, 2], list(range(10, 40))]
    want = _resident_tokens(path, prompts, 16)
    fakes, make = [], builder.make_host_lane

    def on_fake_cuda(*args, **kw):
        fakes.append(FakeCuda(pinned=True))
        return make(*args, cuda=fakes[-1], **kw)

    monkeypatch.setattr(builder, "make_host_lane", on_fake_cuda)
    monkeypatch.setattr(builder, "LaneChoice", _HalfToHost)
    kw = {"k_max": 8} if policy == "specter" else {}
    for fixed in ((3, None) if policy == "specter" else (None,)):
        engine = specter.load(path, device="cpu", policy=policy, residency=0.25, host_threads=2, **kw)
        if fixed is not None:
            engine.decoder.governor = Governor(8, fixed=fixed)
        try:
            outs = [engine.generate(p, max_new_tokens=16) for p in prompts]
        finally:
            engine.close()
        assert [o.token_ids for o in outs] == want, (policy, fixed)
        log = fakes[-1].log
        jobs = [e[2] for e in log if e[:2] == ("record", "copy")]  # each job's rows: one copy back
        waited = {id(e[2]) for e in log if e[:2] == ("wait_event", "compute")}
        assert sum(o.stats["host_experts"] for o in outs) > 0 and jobs
        assert all(id(ev) in waited for ev in jobs), "a job's rows were read without a stream wait"


def test_only_host_and_specter_compute_on_the_host(tiny):
    """specter has both lanes on CPU; on-demand and spec-lru stay copy-only baselines; specter on CUDA
    takes the lane only when host_threads is given (builder.uses_host_lane)."""
    from specter.builder import uses_host_lane

    path, _ = tiny("mixtral")
    for policy, lane in (("specter", True), ("spec-lru", False), ("on-demand", False), ("next-layer", False)):
        engine = specter.load(path, device="cpu", policy=policy, residency=0.25)
        try:
            assert (engine.decoder.experts.host_lane is not None) is lane, policy
            assert (engine.decoder.experts.host_choice is not None) is lane, policy
        finally:
            engine.close()
    full = specter.load(path, device="cpu", policy="specter", residency=1.0)  # nothing ever missing: no lane
    try:
        assert full.decoder.experts.host_lane is None and full.decoder.experts.host_choice is None
    finally:
        full.close()
    cuda = torch.device("cuda")
    assert uses_host_lane("host", cuda) and not uses_host_lane("specter", cuda)
    assert uses_host_lane("specter", cuda, host_threads=4) and not uses_host_lane("spec-lru", torch.device("cpu"))
    assert not uses_host_lane("specter", cuda, host_threads=0) and not uses_host_lane("specter", full.device, 0)
    with pytest.raises(specter.SpecterError, match="host_threads"):
        specter.load(path, device="cpu", policy="spec-lru", residency=0.25, host_threads=2)


def test_host_threads_0_is_specter_without_the_lane(tiny, capsys, tmp_path):
    """host_threads=0: specter copies every miss on CPU too (its CUDA default shape), the same greedy
    tokens as on-demand; policy host, which has no other lane, refuses it, and so does a negative count.
    `specter bench --host-threads` sizes only the lane policies' lanes (on-demand beside it loads)."""
    path, _ = tiny("mixtral")
    prompt = [1, 5, 9, 2]
    plain = specter.load(path, device="cpu", policy="on-demand", residency=0.25)
    copy_only = specter.load(path, device="cpu", policy="specter", residency=0.25, host_threads=0, k_max=4)
    try:
        mgr = copy_only.decoder.experts
        assert mgr.host_lane is None and mgr.host_choice is None
        out = copy_only.generate(prompt, max_new_tokens=12, temperature=0.0)
        assert out.token_ids == plain.generate(prompt, max_new_tokens=12, temperature=0.0).token_ids
        assert out.stats["host_experts"] == 0 and out.stats["expert_misses"] > 0 and out.stats["h2d_bytes"] > 0
    finally:
        plain.close()
        copy_only.close()
    for policy, threads in (("host", 0), ("specter", -1)):
        with pytest.raises(specter.ConfigError, match="host_threads"):
            specter.load(path, device="cpu", policy=policy, residency=0.5, host_threads=threads)
    (tmp_path / "prompts.json").write_text(json.dumps([prompt]))
    assert main(["bench", "--model", str(path), "--device", "cpu", "--policies", "on-demand,specter",
                 "--host-threads", "0", "--prompts", str(tmp_path / "prompts.json"), "--max-new-tokens", "3",
                 "--json"]) == 0
    pols = json.loads(capsys.readouterr().out)["policies"]
    assert pols["specter"]["host_experts"] == 0 and pols["specter"]["lossless_vs_on-demand"] is True
    assert main(["generate", "--model", str(path), "--prompt-ids", "1,2", "--policy", "host",
                 "--host-threads", "0"]) == 2
    assert "host_threads >= 1" in capsys.readouterr().err


def test_a_plain_step_on_the_host_lane_is_not_a_resident_step(tiny, monkeypatch):
    """The governor's stricter bar for speculation ("plain steps copy nothing": every expert resident)
    must not apply when plain steps send their misses to the host lane instead of the link."""
    import specter.builder as builder
    from specter.speculative.governor import Governor

    path, _ = tiny("mixtral")
    monkeypatch.setattr(builder, "LaneChoice", _AllToHost)
    engine = specter.load(path, device="cpu", policy="specter", residency=0.25, k_max=4)
    gov = engine.decoder.governor = Governor(4, fixed=0)
    engine.decoder.fallback = None  # no next-layer guesses on K = 0 steps: nothing at all is copied
    gov.lane_arms = types.SimpleNamespace(pick=lambda: False, probing=False, next=10 ** 9, n=0,  # ... and the host
                                          observe=lambda *a: None)  # lane's arm throughout (no copy-only probe)
    seen = []
    real = gov.observe_cycle
    gov.observe_cycle = lambda *a, **k: seen.append(k.get("copied")) or real(*a, **k)
    try:
        out = engine.generate([1, 5, 9, 33, 2], max_new_tokens=12)
        engine.decoder.stats()  # every step's times read (timing.py)
    finally:
        engine.close()
    assert out.stats["h2d_bytes"] == 0 and out.stats["host_experts"] > 0
    assert seen and any(c for c in seen) and not gov.plain_copies_nothing


def _planner(score, reuse=1.0, read_upto=0):
    """What LaneChoice reads of a planner."""
    from types import SimpleNamespace

    from specter.speculative.scores import Scores

    scores = Scores(len(score), len(score[0]))
    scores.decay_all(0.01)  # a scale other than 1: LaneChoice must read values, not raw numbers
    for layer, row in enumerate(score):
        for e, v in enumerate(row):
            scores.set(layer, e, v)
    return SimpleNamespace(scores=scores, use_weight=3.0, decay=0.8, reuse=[reuse], read_upto=read_upto,
                           prompt_tokens=0)


class _Mgr:
    """What LaneChoice reads of a manager: slots, store shapes, pool width, link stats."""

    def __init__(self, n_slots, held, copy_s):
        from types import SimpleNamespace

        self.slots = SimpleNamespace(n_slots=n_slots, slot=[[0 if e in held else -1 for e in range(16)]])
        self.store = [_store(torch.float32)]
        self.pool = self.store
        self.expert_bytes = 3 * H * I * 4
        self.link = SimpleNamespace(copy_seconds=lambda nbytes: copy_s)


def test_lane_choice_lets_both_lanes_finish_together():
    from specter.offload.calibrate import HostParams
    from specter.offload.host_lane import LaneChoice

    eb = 3 * H * I * 4
    # host: 5 ms a job + 1 ms an expert (no flops or activation cost); a copy: 7 ms
    params = HostParams(bandwidth=eb / 1e-3, flops_per_s=0.0, latency=5e-3, pcie_bandwidth=float("inf"))
    choose = LaneChoice(_Mgr(n_slots=8, held=set(), copy_s=7e-3), params)
    assert choose(0, [3], [3]) == [3]                        # one cold expert: 6 ms on the host, 7 by copy
    assert choose(0, [1, 2], [1, 2]) == [2]                  # 7 ms both ways (copy 1, host 1): ties copy
    got = choose(0, list(range(6)), list(range(6)))          # 11 ms all on the host; copy 1, host 5: 10 ms
    assert got == [1, 2, 3, 4, 5]
    ranked = LaneChoice(_Mgr(8, set(), 7e-3), params, planner=_planner([list(range(6))], read_upto=1))  # likeliest copied
    assert ranked(0, list(range(6)), list(range(6))) == [4, 3, 2, 1, 0]
    full = LaneChoice(_Mgr(n_slots=2, held={10, 11}, copy_s=7e-3), params)  # no slot to spare: all hosted
    assert full(0, list(range(6)), list(range(6)) + [10, 11]) == list(range(6))
    fits = LaneChoice(_Mgr(n_slots=4, held={10}, copy_s=7e-3), None)  # no host profile: copy what fits
    assert fits(0, [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 10]) == [4, 5]


def test_lane_choice_copies_only_when_the_exchange_pays():
    """With the planner's scores (3 a use, decayed 0.8 a step), a copy is worth the uses it will serve
    less its victim's: an expert every step has used displaces a cold resident even though hosting it
    is faster this once; a first miss stays on the host when the resident it would evict is used, or
    when the layer's experts rarely recur from one step to the next (uniform routing)."""
    from types import SimpleNamespace

    from specter.offload.calibrate import HostParams
    from specter.offload.host_lane import LaneChoice

    eb = 3 * H * I * 4
    params = HostParams(bandwidth=eb / 1e-3, flops_per_s=0.0, latency=5e-3, pcie_bandwidth=float("inf"))

    def choose(score_3, score_11, free=0, reuse=1.0):  # layer 0: expert 3 missing, 10 resident and used, 11 too
        mgr = _Mgr(n_slots=2, held={10}, copy_s=7e-3)
        mgr.slots.room = lambda layer, using: (free, [e for e in (10, 11) if e not in using])
        scores = [[0.0] * 16]
        scores[0][3], scores[0][10], scores[0][11] = score_3, 15.0, score_11
        return LaneChoice(mgr, params, planner=_planner(scores, reuse=reuse))(0, [3], [3, 10])

    assert LaneChoice(_Mgr(2, {10}, 7e-3), params)(0, [3], [3, 10]) == [3]  # no scores: this call only (6 < 7 ms)
    assert choose(score_3=12.0, score_11=0.0) == []       # used every step, against a cold resident: copied
    assert choose(score_3=3.0, score_11=15.0) == [3]      # one use before, against one used every step: hosted
    assert choose(score_3=3.0, score_11=15.0, free=1) == []  # a free slot displaces nothing: copied
    assert choose(score_3=0.0, score_11=6.0) == [3]       # a first miss, against a resident used twice: hosted
    assert choose(score_3=0.0, score_11=0.0) == []        # ... against a cold one: the use now pays the copy
    assert choose(score_3=0.0, score_11=0.0, reuse=0.05) == [3]  # ... unless this layer's experts rarely recur
    assert choose(score_3=0.3, score_11=0.0, reuse=0.05) == [3]  # a tenth of a use gains 0.8 ms: 6.2 > 6 ms
    mgr = _Mgr(n_slots=2, held={10}, copy_s=7e-3)
    mgr.slots.room = lambda layer, using: (0, [e for e in (10, 11) if e not in using])
    verifying = _planner([[0.0] * 3 + [12.0] + [0.0] * 12], read_upto=3)  # inside a speculative cycle:
    assert LaneChoice(mgr, params, planner=verifying)(0, [3], [3, 10]) == [3]  # this call's time alone


def test_host_policy_in_bf16_on_cpu_is_the_devices_bits(tiny):
    """16-bit rows on the CPU backend are plain linears whose bits do not depend on the row count, and the
    lane computes in the engine's dtype: bf16 host decoding equals bf16 resident decoding exactly here.
    (On CUDA the host's and the GPU's kernels round differently: README, what lossless guarantees.)"""
    path, _ = tiny("mixtral")
    prompts = [[1, 5, 9, 33, 2], [7, 7, 7]]
    ref = specter.load(path, device="cpu", policy="resident", dtype="bfloat16")
    try:
        want = [ref.generate(p, max_new_tokens=12).token_ids for p in prompts]
    finally:
        ref.close()
    engine = specter.load(path, device="cpu", policy="host", residency=0.25, dtype="bfloat16")
    try:
        assert engine.decoder.experts.lane.dtype == torch.bfloat16
        outs = [engine.generate(p, max_new_tokens=12) for p in prompts]
    finally:
        engine.close()
    assert [o.token_ids for o in outs] == want
    assert sum(o.stats["host_experts"] for o in outs) > 0


def test_plan_says_what_each_lane_carries_under_the_host_policy(tiny, capsys):
    import json

    path, _ = tiny("mixtral")
    assert main(["plan", "--model", str(path), "--policy", "host", "--residency", "0.25", "--device", "cpu",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    lanes = got["lanes"]  # the plan is arithmetic: config.json, no engine
    assert lanes["pcie_bytes_per_token"] == 0
    assert lanes["host_bytes_per_token"] == 3 * lanes["device_bytes_per_token"] > 0  # 75% / 25% of the uses
    assert main(["plan", "--model", str(path), "--policy", "host", "--residency", "0.25", "--device", "cpu"]) == 0
    assert "host lane (policy host)" in capsys.readouterr().out
    assert main(["plan", "--model", str(path), "--policy", "on-demand", "--residency", "0.25", "--device", "cpu",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["lanes"] is None


def test_plan_says_how_specter_splits_its_misses_between_the_lanes(tiny, capsys):
    import json

    path, _ = tiny("mixtral")
    argv = ["plan", "--model", str(path), "--residency", "0.25", "--device", "cpu", "--json"]
    assert main(argv + ["--policy", "host"]) == 0
    off = json.loads(capsys.readouterr().out)["lanes"]["host_bytes_per_token"]  # every non-resident use
    assert main(argv + ["--policy", "specter"]) == 0
    lanes = json.loads(capsys.readouterr().out)["lanes"]
    assert abs(lanes["pcie_bytes_per_token"] + lanes["host_bytes_per_token"] - off) <= 2  # the misses, split
    v = lanes["verification"]
    assert v["tokens"] > 1 and v["pcie_bytes_per_token"] + v["host_bytes_per_token"] > 0
    assert lanes["profile"] == "A100-40GB-PCIe4"
    assert main(argv[:-1] + ["--policy", "specter"]) == 0
    assert "two lanes (policy specter" in capsys.readouterr().out
    assert main(argv + ["--policy", "spec-lru"]) == 0
    assert json.loads(capsys.readouterr().out)["lanes"] is None


def test_the_governor_is_charged_the_host_lanes_wait(tiny, monkeypatch):
    """A verification that waits on the host lane reports that wait as its stall (what s(K) is fitted
    on) and in its time: with a lane injected to take 50 ms a job and every miss sent to it, every
    speculative cycle's stall is within its verification time, and the lane's waits are in them."""
    import specter.builder as builder
    from specter.speculative.governor import Governor

    path, _ = tiny("mixtral")
    monkeypatch.setattr(builder, "LaneChoice", _AllToHost)
    engine = specter.load(path, device="cpu", policy="specter", residency=0.25, k_max=4)
    engine.decoder.experts.host_lane.charge = lambda job: 0.05  # each job completes no earlier than 50 ms on
    gov = engine.decoder.governor = Governor(4, fixed=3)
    seen = []
    real = gov.observe_cycle
    gov.observe_cycle = lambda k, m, d, v, s, **kw: seen.append((k, v, s)) or real(k, m, d, v, s, **kw)
    try:
        out = engine.generate([1, 5, 9, 33, 2], max_new_tokens=6)
        engine.decoder.stats()
    finally:
        engine.close()
    assert out.stats["host_stall_s"] > 0
    spec = [(v, s) for k, v, s in seen if k > 0]
    assert spec and all(v >= s >= 0 for v, s in spec) and sum(s for _, s in spec) >= 0.05
