"""The compressed device tier (issue 24 item 3, offload/coded_tier.py): experts kept coded on the device,
a miss among them decoded into a slot on the decode link instead of copied over PCIe; the same tokens."""
from __future__ import annotations

import pytest
import torch

import specter
from specter import builder
from specter.loader import open_checkpoint
from specter import default_model_path
from specter.offload import coded_tier
from specter.offload.coded import CodedLayer, encode_store
from specter.offload.coded_tier import CodedTier, DecodeLink, make_decode_link
from specter.offload.link import EmulatedLink
from specter.offload import plan as plan_mod
from specter.offload.plan import make_plan, tier_split
from specter.moe import ExpertWeights
from specter.triton_ops import lossless
from specter.triton_ops.lossless import encode

from test_compressed import PROMPTS, plain_link  # noqa: F401  (the fixture)
from test_link import VirtualClock

NEW = 16


def _engine(path, policy, compress, **kw):
    # 12 of 24 slots: 2 raw and ~14 coded with the tier (at 0.25 the tier would hold no more than the slots)
    return specter.load(path, device="cpu", policy=policy, residency=0.5, compress_experts=compress, **kw)


def _generate(engine):
    outs = [engine.generate(p, max_new_tokens=NEW, temperature=0.0) for p in PROMPTS]
    return [o.token_ids for o in outs], outs


@pytest.fixture
def real_decode(monkeypatch):
    """Tier hits (and coded copies) decode the coded store (the torch decode) instead of writing raw rows."""
    monkeypatch.setattr(builder, "emulation_rows", lambda shared: None)


@pytest.fixture
def small_verify(monkeypatch):
    """Drafting policies get a tier on the tiny model too: their raw slots sized for one token (the
    plan's rule gives a verification's working set, which leaves this model no room for a tier)."""
    monkeypatch.setattr(plan_mod, "VERIFY_TOKENS", 1)


@pytest.mark.parametrize("policy", ["on-demand", "spec-lru", "specter"])
def test_tier_gives_the_resident_greedy_tokens(tiny, plain_link, fixed_k, small_verify, policy):  # noqa: F811
    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    resident = specter.load(path, device="cpu", policy="resident")
    try:
        want, _ = _generate(resident)
    finally:
        resident.close()
    engine = _engine(path, policy, True)
    try:
        plan, mgr = engine.plan, engine.decoder.experts
        assert plan.tier_bytes > 0 and mgr.tier is not None and plan.pool_slots == plan.top_k
        got, outs = _generate(engine)
        hits = sum(o.stats["tier_hits"] for o in outs)
        mgr.tier.check()
        mgr.slots.check()
    finally:
        engine.close()
    assert got == want and len({t for ts in want for t in ts}) > 5
    assert hits > 0, policy  # the tier served misses, so the tokens above went through it


def test_next_layer_compressed_still_prefetches(tiny, plain_link):  # noqa: F811
    """With a tier, the split left next-layer a layer's top-k raw slots and so no room to copy a guess into:
    it issued no prefetch and ran as on-demand. No tier for it: its guesses are copied, coded, as raw."""
    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    issued = {}
    for compress in (False, True):
        engine = _engine(path, "next-layer", compress)
        try:
            assert engine.decoder.experts.tier is None
            _, outs = _generate(engine)
            issued[compress] = sum(o.stats["prefetch_issued"] for o in outs)
        finally:
            engine.close()
    assert issued[True] > 0 and issued[False] > 0


def test_a_load_fills_the_tier_as_it_fills_the_raw_slots(tiny, plain_link):  # noqa: F811
    """The raw slots are warmed at load (manager.warm, untimed on an emulated link); the tier started
    held only the raw slots' experts (their copies leave them there), so a first generation copied over
    PCIe what a raw pool already held: the QA pass saw 3.9x raw's bytes at residency 0.8. The tier now
    fills at load too, with the experts after the raw slots'."""
    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    firsts = {}
    for compress in (False, True):
        engine = _engine(path, "on-demand", compress)
        try:
            mgr = engine.decoder.experts
            if compress:
                tier, slots = mgr.tier, mgr.slots
                tier.check()
                assert tier.members > 0 and not mgr.filling
                assert tier.capacity - tier.used < max(map(max, tier.cost)) or tier.members + slots.used_slots \
                    == slots.n_layers * slots.n_experts  # as many as fit (or every expert is held)
                assert tier.members > slots.used_slots  # (a raw slot's copy leaves it in the tier too)
            firsts[compress] = engine.generate(PROMPTS[1], max_new_tokens=NEW, temperature=0.0).stats
        finally:
            engine.close()
    assert firsts[True]["tier_hits"] > 0
    assert firsts[True]["h2d_bytes"] < firsts[False]["h2d_bytes"]


@pytest.mark.parametrize("policy", ["on-demand", "specter"])
def test_tier_decoding_the_coded_store_gives_the_same_tokens(tiny, plain_link, fixed_k, real_decode, small_verify,
                                                             policy, monkeypatch):  # noqa: F811
    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    raw = _engine(path, policy, False)
    try:
        want, _ = _generate(raw)
    finally:
        raw.close()
    engine = _engine(path, policy, True)
    try:
        assert all(layer.w13.rows is None for layer in engine.decoder.experts.tier.store)
        decodes, real = [], lossless.decode_torch
        monkeypatch.setattr(lossless, "decode_torch", lambda *a: decodes.append(1) or real(*a))
        got, outs = _generate(engine)
    finally:
        engine.close()
    assert got == want and sum(o.stats["tier_hits"] for o in outs) > 0 and decodes


def test_no_tier_where_nothing_would_fill_it(tiny, plain_link):  # noqa: F811
    """The host policy computes every miss on the host lane: the whole budget stays raw slots."""
    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    engine = _engine(path, "host", True)
    try:
        assert engine.plan.tier_bytes == 0 and engine.plan.pool_slots == 12
    finally:
        engine.close()


def test_a_big_stores_hits_read_the_checkpoint_instead_of_a_decoded_copy(tiny, plain_link, monkeypatch):  # noqa: F811
    from specter.loader import ExpertReads

    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    tokens = []
    for limit, decoded in ((1, False), (1 << 30, True)):
        monkeypatch.setattr(coded_tier, "ROWS_MAX_BYTES", limit)
        engine = _engine(path, "on-demand", True)
        try:
            rows = engine.decoder.experts.tier.store[0].w13.rows
            assert isinstance(rows, torch.Tensor if decoded else ExpertReads)
            assert (engine.shared.raw is not None) == decoded  # no decoded copy of the store made
            out = engine.generate(PROMPTS[1], max_new_tokens=NEW, temperature=0.0)
            assert out.stats["tier_hits"] > 0
            tokens.append(out.token_ids)
        finally:
            engine.close()
    assert tokens[0] == tokens[1]


def test_tier_hits_move_no_pcie_bytes(tiny, plain_link):  # noqa: F811
    """A tier hit is charged to the decode link and counted as no H2D byte; every other miss crosses the link."""
    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    engine = _engine(path, "on-demand", True)
    try:
        mgr, link, carried, decoded = engine.decoder.experts, plain_link[0], [], []  # experts each transfer carried
        real, real_decode = link.copy, mgr.tier.link.copy
        link.copy = lambda dst, src, **kw: carried.append(len(dst) // 2) or real(dst, src, **kw)
        mgr.tier.link.copy = lambda dst, src, **kw: decoded.append(len(dst) // 2) or real_decode(dst, src, **kw)
        link.reset_stats()
        out = engine.generate(PROMPTS[1], max_new_tokens=NEW, temperature=0.0)
        mgr.link.synchronize()
        st = out.stats
        assert st["h2d_bytes"] == link.stats["bytes"] > 0 and link.stats["transfers"] == len(carried)
        assert st["expert_misses"] == st["tier_hits"] + sum(carried)
        assert len(carried) < sum(carried)  # a call's misses crossed together (coalesced)
        assert mgr.tier.link.stats["transfers"] == len(decoded) and sum(decoded) == st["tier_hits"] > 0
        assert max(decoded) > 1  # a call's hits decode together (on CUDA: one launch)
    finally:
        engine.close()


def _coded_store(L=2, E=4):
    torch.manual_seed(0)
    return encode_store([ExpertWeights((torch.randn(E, 16, 32) * 0.1).bfloat16(), (torch.randn(E, 32, 8) * 0.1).bfloat16())
                         for _ in range(L)])


def test_tier_fills_hits_and_evicts_the_coldest():
    store = _coded_store()
    with EmulatedLink(1e12, clock=VirtualClock()) as link:
        probe = CodedTier(store, 10**9, link)
        cap = sorted(c for row in probe.cost for c in row)[-1] * 3  # room for any three members
        tier = CodedTier(store, cap, link)
        assert not tier.has(0, 1)
        for key in ((0, 1), (0, 2), (1, 0)):
            assert tier.admit(*key)
        tier.check()
        assert tier.stats["tier_fills"] == 3 and tier.members == 3
        tier.touch(0, [2])          # layer 0 ran using expert 2; then layer 1 ran using expert 0
        tier.touch(1, [0])
        # next use: (0, 1) unused since layer 0's call -> farthest; (0, 2) next layer-0 call; (1, 0) later
        assert tier.victim() == (0, 1)
        tier.admit(1, 3)            # full: evicts (0, 1)
        assert not tier.has(0, 1) and tier.has(0, 2) and tier.has(1, 0) and tier.has(1, 3)
        assert tier.stats["tier_evictions"] == 1
        tier.check()
        # a hit: the decode of the member into a slot, the bits of the expert
        d13, d2 = torch.zeros(16, 32), torch.zeros(32, 8)
        t = tier.copy(0, [2], [d13, d2])
        t.wait()
        assert torch.equal(d13, store[0].w13.decode()[2].float()) and torch.equal(d2, store[0].w2.decode()[2].float())
        assert tier.stats["tier_hits"] == 1
        with pytest.raises(KeyError, match="not held"):
            tier.copy(0, [1], [d13, d2])
        # two members of a layer: one transfer, each slot its expert's bits
        s13, s2 = torch.zeros(16, 32), torch.zeros(32, 8)
        tier.copy(1, [3, 0], [d13, d2, s13, s2]).wait()
        for (a, b), e in (((d13, d2), 3), ((s13, s2), 0)):
            assert torch.equal(a, store[1].w13.decode()[e].float()) and torch.equal(b, store[1].w2.decode()[e].float())
        assert tier.stats["tier_hits"] == 3 and link.stats["transfers"] == 2
        # a copy that crossed the link fills; a tier hit landing does not fill again
        tier.landed(0, 1, t)
        assert not tier.has(0, 1)
        tier.landed(0, 1, object())
        assert tier.has(0, 1)
        tier.check()
        big = CodedTier(store, cap // 6, link)  # smaller than one member: nothing is kept
        assert not big.admit(0, 0) and big.members == 0


def test_decode_link_charges_the_profiles_device_bandwidth():
    """On a virtual clock a tier hit takes the launch + (coded read + bf16 written) x width at the
    link's decode_bandwidth (the profile's device memory bandwidth, scaled): no PCIe latency or bandwidth."""
    torch.manual_seed(0)
    w = (torch.randn(2, 64, 96) * 0.05).bfloat16()
    coded = CodedLayer(encode(w), encode(w[:, :32, :].contiguous()))
    pcie = EmulatedLink(50e6, 1e-3, clock=VirtualClock(), decode_bandwidth=400e6)
    pcie.time_scale = 10.0
    clock = VirtualClock()
    dec = make_decode_link(pcie, clock=clock)
    try:
        assert isinstance(dec, DecodeLink) and dec.bandwidth == 400e6
        assert dec.latency == pytest.approx(coded_tier.DECODE_LAUNCH_S * 10)
        d13, d2 = torch.zeros(64, 96), torch.zeros(32, 96)
        srcs = [coded.w13[1], coded.w2[1]]
        t = dec.copy([d13, d2], srcs)
        t.wait()
        want = dec.latency + sum(s.nbytes + s.raw_nbytes for s in srcs) * 2 / 400e6
        assert t.seconds == pytest.approx(want, rel=1e-12) and clock.now() == pytest.approx(want, rel=1e-9)
        assert t.seconds < pcie.seconds([d13, d2], srcs) / 5  # far cheaper than its copy over the link
        assert torch.equal(d13, w[1].float()) and torch.equal(d2, w[1, :32].float())
    finally:
        dec.close()
        pcie.close()


def test_plan_splits_the_budget_between_raw_slots_and_the_tier():
    ckpt = open_checkpoint(default_model_path())  # the bundled model: 4 MoE layers x 16 experts, top-2
    spec, total = ckpt.spec, ckpt.numel()
    assert (spec.n_moe_layers, spec.n_experts, spec.top_k) == (4, 16, 2)
    numel = spec.expert_numel()
    slot = numel * 4  # fp32
    raw = make_plan(spec, total, torch.float32, expert_memory=16 * slot, draft=False, device="cpu")
    tiered = make_plan(spec, total, torch.float32, expert_memory=16 * slot, draft=False, device="cpu", coded_tier=0.7)
    assert raw.pool_slots == 16 and raw.tier_bytes == 0
    assert tiered.pool_slots == spec.top_k and tiered.tier_bytes == 14 * slot
    assert tiered.tier_experts == 20 and tiered.coded_ratio == 0.7
    assert tiered.total_bytes == raw.total_bytes  # the same budget
    d = tiered.as_dict()
    assert d["tier_bytes"] == 14 * slot and d["tier_experts"] == 20
    assert "coded tier" in tiered.table() and "coded tier" not in raw.table()
    # no tier where it would hold no more experts than the slots it takes, or everything fits raw
    assert tier_split(3, 2, 16, 4, 0.7) == 3 and tier_split(64, 2, 16, 4, 0.7) == 64
    assert tier_split(16, 2, 16, 4, 0.7) == 2 and tier_split(16, 2, 16, 4, 0.9) == 16
    assert tier_split(4, 2, 16, 4, 0.7) == 4  # 2 raw + 2 / 0.7 = 2.86 coded: not more than 4
    # whole experts: 9 slots at 11/16 hold 13.09 coded experts, 13 whole, no more than 13 raw slots (a QA
    # pass measured such a tier 10% slower than the raw slots); 14 whole at 15 slots are more
    assert tier_split(13, 4, 8, 3, 11 / 16) == 13 and tier_split(15, 4, 8, 3, 11 / 16) == 4
    # a drafting policy's raw slots hold a verification's working set (top-2 x 5 tokens): at 16 slots
    # the tier would hold 6 / 0.7 < 16, so none; at 48 slots 10 raw + 54 coded
    drafting = make_plan(spec, total, torch.float32, expert_memory=16 * slot, draft=True, device="cpu", coded_tier=0.7)
    assert drafting.tier_bytes == 0 and drafting.pool_slots == 16
    big = make_plan(spec, total, torch.float32, expert_memory=48 * slot, draft=True, device="cpu", coded_tier=0.7)
    assert big.pool_slots == 10 and big.tier_bytes == 38 * slot and big.tier_experts == 54
    assert tier_split(48, 2, 16, 4, 0.7, verify=5) == 10 and tier_split(16, 2, 16, 4, 0.7, verify=5) == 16
    every = make_plan(spec, total, torch.float32, residency=1.0, draft=False, device="cpu", coded_tier=0.7)
    assert every.tier_bytes == 0 and every.pool_slots == 64


def test_the_engine_splits_its_tier_at_the_stores_measured_ratio(capsys, tiny, plain_link):  # noqa: F811
    """The engine split its budget at PLAN_RATIO (11/16) before the store was coded, `plan` at the measured
    ratio (0.71 on this top-4 model): at 16 slots `plan` said 16 raw slots and no tier, the engine built
    4 raw slots and a tier of 16 coded experts (no more on the device, a decode each hit). Now it splits
    at the measured ratio after the load: the same plan as `specter plan`, and a tier only where it holds
    more experts than the slots it replaces."""
    import json

    from specter.cli import main

    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16, num_experts_per_tok=4)
    spec = open_checkpoint(path).spec
    slot = spec.expert_numel() * 4  # the fp32 slots of this small CPU pool
    for n in (13, 16, 18, 20):
        flags = ["--model", str(path), "--device", "cpu", "--policy", "on-demand", "--expert-memory", str(n * slot),
                 "--compress-experts"]
        assert main(["plan", *flags, "--json"]) == 0
        said = json.loads(capsys.readouterr().out)
        engine = specter.load(path, device="cpu", policy="on-demand", expert_memory=n * slot, compress_experts=True)
        try:
            built, tier = engine.plan.as_dict(), engine.decoder.experts.tier
        finally:
            engine.close()
        keys = ("pool_slots", "tier_bytes", "tier_experts", "coded_ratio")
        assert {k: built[k] for k in keys} == {k: said[k] for k in keys}, n
        if built["tier_bytes"]:
            assert built["tier_experts"] > n and tier is not None
        else:
            assert built["pool_slots"] == n and tier is None
    assert said["tier_bytes"] > 0  # (20 slots: a tier)


def test_plan_cli_shows_both_tiers(capsys, tiny):
    import json

    from specter.cli import main

    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    rc = main(["plan", "--model", str(path), "--device", "cpu", "--residency", "0.5", "--policy", "on-demand",
               "--compress-experts", "--json"])
    out, err = capsys.readouterr()
    d = json.loads(out)
    assert rc == 0 and d["tier_bytes"] > 0 and d["tier_experts"] > d["pool_slots"] > 0, err
    assert 0.6 < d["coded_ratio"] < 0.75  # measured from the weights
    rc = main(["plan", "--model", str(path), "--device", "cpu", "--residency", "0.5", "--policy", "on-demand",
               "--compress-experts"])
    out, _ = capsys.readouterr()
    assert rc == 0 and "coded tier" in out and "slot pool" in out


# ---------------------------------------------------------------- the tier on CUDA, on fakes (test_link.FakeCuda)


def torch_decode(monkeypatch, calls: list, batches: list | None = None) -> None:
    """lossless.decode_staged_pair and decode_staged_pairs without a GPU: each checks the staged bytes it
    is handed are exactly stage_pair's for expert e (what the kernels decode, bit for bit:
    lossless_interpreted.py), then writes the expert with the torch decode; `batches`: each batch's size."""
    from specter.triton_ops import lossless

    def decode(pair, e, staged, out_a, out_b):
        assert torch.equal(staged, lossless.stage_pair(pair, e, staged.device)), f"not expert {e}'s staged bytes"
        lossless.decode_torch(pair.a, e, out_a)
        lossless.decode_torch(pair.b, e, out_b)
        calls.append(e)

    def decode_batch(pair, jobs):
        if batches is not None:
            batches.append(len(jobs))
        for job in jobs:
            decode(pair, *job)

    monkeypatch.setattr(lossless, "decode_staged_pair", decode)
    monkeypatch.setattr(lossless, "decode_staged_pairs", decode_batch)


def cuda_tier_scenario(decoded: list) -> None:
    """A CUDA tier's life on a FakeCuda (the CPU as the device; `decoded`: the experts the pair decode
    ran for): copies over the link fill it with the very buffers they staged, a hit decodes the kept
    buffer into the slot on the decode link's own stream, ordered after the slot's last reader and the
    fill's copy, and moves no PCIe byte; eviction drops the buffer; every slot holds its expert's bits."""
    from specter.offload.cuda_link import CudaLink
    from specter.offload.manager import OffloadedExperts
    from test_link import FakeCuda

    L, E, H, I = 2, 4, 32, 8
    g = torch.Generator().manual_seed(3)
    raw = [ExpertWeights((torch.randn(E, 2 * I, H, generator=g) * 0.1).bfloat16(),
                         (torch.randn(E, H, I, generator=g) * 0.1).bfloat16()) for _ in range(L)]
    store = encode_store([ExpertWeights(w.w13.clone(), w.w2.clone()) for w in raw], cuda=True)
    cuda, dcuda = FakeCuda(pinned=True), FakeCuda(pinned=True)
    with CudaLink("cpu", bandwidth=1e9, cuda=cuda) as link, \
            CudaLink("cpu", bandwidth=1e12, cuda=dcuda, name="decode") as dec:
        mgr = OffloadedExperts(store, None, torch.device("cpu"), link, dtype=torch.bfloat16, pool=2)
        cost = store[0].w13.pair.staged_nbytes(0)
        tier = coded_tier.attach(mgr, 3 * (cost + coded_tier.ALLOC_ROUND), link, decode_link=dec)
        assert tier.on_device and all(c % coded_tier.ALLOC_ROUND == 0 and c >= cost for row in tier.cost for c in row)

        def run(layer, experts):
            x = torch.randn(1, H, generator=g).bfloat16()
            ids, w = torch.tensor([experts]), torch.full((1, len(experts)), 1.0 / len(experts))
            mgr(layer, x, ids, w.bfloat16())
            for e in experts:
                slot = mgr.slots.slot_of(layer, e)
                assert torch.equal(mgr.pool[layer].w13[slot], raw[layer].w13[e]), (layer, e)
                assert torch.equal(mgr.pool[layer].w2[slot], raw[layer].w2[e]), (layer, e)

        run(0, [0, 1])                       # two copies over the link: both staged, both kept
        assert tier.has(0, 0) and tier.has(0, 1) and decoded == [0, 1]
        buf, filled = tier._held[(0, 0)]
        assert buf.numel() == cost and filled.on in ("copy", "urgent") and filled.cuda is cuda
        run(0, [2, 3])                       # evicts 0 and 1 from the two slots; fills (0, 2) over (0, 0)
        assert tier.members == 3 and not tier.has(0, 0) and tier.has(0, 2)
        tier.check()
        readers = {mgr.last_read[mgr.slots.slot_of(0, e)] for e in (2, 3)}  # expert 1 lands in one of them
        filled = tier._held[(0, 1)][1]
        mark, h2d = len(dcuda.log), mgr.stats()["h2d_bytes"]
        run(0, [1])                          # a hit: decoded from the kept buffer, no PCIe byte
        assert mgr.stats()["h2d_bytes"] == h2d and mgr.stats()["tier_hits"] == 1 and decoded[-1] == 1
        waits = dcuda.copy_waits(mark)
        assert len(waits) == 2 and waits[1] == ("wait_event", "urgent", filled), waits  # the fill's copy
        assert waits[0][2] in readers, waits  # and the slot's last reader
        run(1, [0])                          # a fourth member: the coldest, (0, 3) or (0, 2), goes
        assert tier.members == 3 and tier.has(1, 0)
        tier.check()
        assert sorted(tier._held) == sorted((m, e) for m in range(L) for e in range(E) if tier.has(m, e))
        link.synchronize()
        dec.synchronize()


def test_a_cuda_tier_keeps_the_staged_bytes_and_orders_each_hit(monkeypatch):
    decoded, batches = [], []
    torch_decode(monkeypatch, decoded, batches)
    cuda_tier_scenario(decoded)
    assert batches[0] == 2  # the first call's two copies over the link: one launch


def test_a_copy_that_staged_nothing_does_not_fill_a_cuda_tier():
    """An in-place copy (or one into slots that are not bf16) leaves no staged bytes: the tier stays empty."""
    from specter.offload.cuda_link import CudaLink
    from test_link import FakeCuda

    store = _coded_store()
    with CudaLink("cpu", bandwidth=1e9, cuda=FakeCuda(pinned=True)) as dec, \
            pytest.raises(ValueError, match="laid out for CUDA"):
        CodedTier(store, 10**9, dec)
    store = encode_store([ExpertWeights(layer.w13.decode(), layer.w2.decode()) for layer in store], cuda=True)
    with CudaLink("cpu", bandwidth=1e9, cuda=FakeCuda(pinned=True)) as dec:
        tier = CodedTier(store, 10**9, dec)
        t = type("T", (), {"_event": None})()
        tier.sources(0, 1)
        tier.landed(0, 1, t)                 # its source never staged (staged None)
        assert not tier.has(0, 1) and tier.members == 0
        src = tier.sources(0, 2)
        src[0].staged = torch.zeros(store[0].w13.pair.staged_nbytes(2), dtype=torch.uint8)
        tier.landed(0, 2, t)
        assert tier.has(0, 2) and tier._landing == {}  # both copies' notes taken
        tier.check()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["on-demand", "specter"])
def test_cuda_tier_gives_the_raw_stores_greedy_tokens(tiny, fixed_k, small_verify, monkeypatch, policy):
    """On CUDA (SPECTER_CODED_TIER=1) the tier keeps what coded copies staged and decodes hits from it:
    the raw store's greedy tokens at the same budget, hits served, the tier's invariants held."""
    monkeypatch.setenv("SPECTER_CODED_TIER", "1")
    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    got = {}
    for compress in (False, True):
        engine = specter.load(path, device="cuda", policy=policy, residency=0.5, compress_experts=compress)
        try:
            mgr = engine.decoder.experts
            assert (engine.plan.tier_bytes > 0 and mgr.tier is not None and mgr.tier.on_device) == compress
            ids, outs = _generate(engine)
            if compress:
                torch.cuda.synchronize()
                mgr.tier.check()
                mgr.slots.check()
        finally:
            engine.close()
        got[compress] = ids, sum(o.stats["tier_hits"] for o in outs) if compress else 0
    assert got[True][0] == got[False][0] and len({t for ts in got[False][0] for t in ts}) > 5, policy
    assert got[True][1] > 0, policy


def test_where_a_tier_is_wanted(monkeypatch):
    """CPU: by default (the emulated device charges a hit from the profile); CUDA: opt-in, bf16 slots,
    staged copies; never for the host policy, nor next-layer's and the oracle's prefetches into raw slots;
    SPECTER_CODED_TIER=0: nowhere."""
    from specter.policy import get

    want = coded_tier.tier_wanted
    od, host, bf16 = get("on-demand"), get("host"), torch.bfloat16
    monkeypatch.delenv("SPECTER_CODED_TIER", raising=False)
    monkeypatch.delenv("SPECTER_CODED_IN_PLACE", raising=False)
    assert want(od, "cpu", torch.float32) and not want(od, "cuda", bf16) and not want(host, "cpu", torch.float32)
    assert not any(want(get(p), "cpu", torch.float32, opt="1") for p in ("next-layer", "oracle"))
    assert want(od, "cuda", bf16, opt="1") and not want(od, "cpu", torch.float32, opt="0")  # asked, not the env
    monkeypatch.setenv("SPECTER_CODED_TIER", "1")
    assert want(od, "cuda", bf16) and not want(od, "cuda", torch.float16) and not want(host, "cuda", bf16)
    monkeypatch.setenv("SPECTER_CODED_IN_PLACE", "1")
    assert not want(od, "cuda", bf16)
    monkeypatch.setenv("SPECTER_CODED_TIER", "0")
    assert not want(od, "cpu", torch.float32)


def test_a_cuda_tier_stays_exact_over_random_calls_and_prefetches(monkeypatch):
    decoded, batches = [], []
    torch_decode(monkeypatch, decoded, batches)
    cuda_tier_random(decoded, batches)


def cuda_tier_random(decoded: list, batches: list) -> None:
    """FakeCuda (`decoded`: each expert decoded, `batches`: each batched decode's size): 60 layer calls of
    random routing with prefetches between them (a three-slot pool, a tier of about eight members):
    after each call every expert it used holds its bits in its slot, every hit decoded the bytes its
    copy staged, a call's two hits (and a coalesced copy's experts) decoded in one batch, and the tier's
    invariants hold."""
    from specter.offload.cuda_link import CudaLink
    from specter.offload.manager import OffloadedExperts
    from test_link import FakeCuda

    L, E, H, I = 3, 6, 32, 8
    g = torch.Generator().manual_seed(11)
    raw = [ExpertWeights((torch.randn(E, 2 * I, H, generator=g) * 0.1).bfloat16(),
                         (torch.randn(E, H, I, generator=g) * 0.1).bfloat16()) for _ in range(L)]
    store = encode_store([ExpertWeights(w.w13.clone(), w.w2.clone()) for w in raw], cuda=True)
    with CudaLink("cpu", bandwidth=1e9, cuda=FakeCuda(pinned=True)) as link, \
            CudaLink("cpu", bandwidth=1e12, cuda=FakeCuda(pinned=True), name="decode") as dec:
        mgr = OffloadedExperts(store, None, torch.device("cpu"), link, dtype=torch.bfloat16, pool=3)
        tier = coded_tier.attach(mgr, 8 * max(map(max, coded_tier.CodedTier(store, 1, dec).cost)), link,
                                 decode_link=dec)
        for i in range(60):
            layer = i % L
            experts = torch.randperm(E, generator=g)[:2].tolist()
            x = torch.randn(1, H, generator=g).bfloat16()
            mgr(layer, x, torch.tensor([experts]), torch.full((1, 2), 0.5).bfloat16())
            for e in experts:
                slot = mgr.slots.slot_of(layer, e)
                assert torch.equal(mgr.pool[layer].w13[slot], raw[layer].w13[e]), (i, layer, e)
                assert torch.equal(mgr.pool[layer].w2[slot], raw[layer].w2[e]), (i, layer, e)
            if i % 3 == 0:  # a guess for the next layer, not urgent (the metered lane)
                mgr.prefetch((layer + 1) % L, torch.randperm(E, generator=g)[:1].tolist(), protect=set())
            link.synchronize()
            dec.synchronize()
            mgr.poll()
            tier.check()
        mgr.slots.check()
        st = mgr.stats()
        assert st["tier_hits"] > 5 and st["tier_evictions"] > 5 and len(decoded) > st["tier_hits"], st
        # a call's hits: one transfer on the decode link, one batch (copies over the link batch too)
        assert batches.count(2) > 0 and dec.stats["transfers"] < st["tier_hits"], (batches, st)


def test_plan_on_cuda_says_what_the_opt_in_tier_would_hold(capsys, tiny, monkeypatch):
    """On CUDA the tier is opt-in: `plan --compress-experts` keeps the budget raw and says what
    SPECTER_CODED_TIER=1 would hold; with it set, the plan splits the budget as the engine would."""
    import json

    from specter.cli import main

    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    argv = ["plan", "--model", str(path), "--device", "cuda", "--residency", "0.5", "--policy", "on-demand",
            "--compress-experts"]
    monkeypatch.delenv("SPECTER_CODED_TIER", raising=False)
    assert main(argv) == 0
    line = [t for t in capsys.readouterr().out.splitlines() if t.startswith("coded device tier")]
    monkeypatch.setenv("SPECTER_CODED_TIER", "1")
    assert main(argv + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["tier_bytes"] > 0 and len(line) == 1
    assert f"~{d['tier_experts']} experts coded beside {d['pool_slots']} raw slots" in line[0], line


# ---------------------------------------------------------------- prefetches that land in the tier alone


def test_a_fill_lands_in_the_tier_and_the_need_decodes_it():
    """OffloadedExperts.fill (the drafting planner's prefetch with no slot to land in): the coded bytes
    cross the link (counted), no slot is taken, the experts join the tier when they land; the call that
    needs them decodes them from the tier (no more PCIe bytes) and counts the prefetches used. Residents,
    members and fills in flight are not fetched again."""
    from specter.offload.manager import OffloadedExperts

    store = _coded_store(L=2, E=4)
    raw = [(layer.w13.decode().float(), layer.w2.decode().float()) for layer in store]
    with EmulatedLink(1e12, clock=VirtualClock()) as link:
        mgr = OffloadedExperts(store, None, torch.device("cpu"), link, dtype=torch.float32, pool=2)
        tier = coded_tier.attach(mgr, 10**9, link, decode_link=DecodeLink(1e12, clock=VirtualClock()))
        x = torch.randn(1, 32)

        def run(layer, experts):
            mgr(layer, x, torch.tensor([experts]), torch.full((1, len(experts)), 0.5))
            for e in experts:
                slot = mgr.slots.slot_of(layer, e)
                assert torch.equal(mgr.pool[layer].w13[slot], raw[layer][0][e]), (layer, e)
                assert torch.equal(mgr.pool[layer].w2[slot], raw[layer][1][e]), (layer, e)

        run(0, [0, 1])
        h2d, issued = mgr.stats()["h2d_bytes"], mgr.stats()["prefetch_issued"]
        assert mgr.fill(1, [2, 3]) == 2 and sorted(mgr.filling) == [(1, 2), (1, 3)]
        assert not mgr.is_resident(1, 2) and not mgr.is_resident(1, 3)  # no slot taken
        coded = sum(store[1].w13[e].nbytes + store[1].w2[e].nbytes for e in (2, 3))
        assert mgr.stats()["h2d_bytes"] == h2d + coded and mgr.stats()["prefetch_issued"] == issued + 2
        assert mgr.fill(1, [2, 3]) == 0 and mgr.fill(0, [0, 1]) == 0  # in flight; resident
        link.synchronize()
        mgr.poll()
        assert not mgr.filling and tier.has(1, 2) and tier.has(1, 3)
        assert mgr.fill(1, [2]) == 0  # a member
        hits = mgr.stats()["tier_hits"]
        run(1, [2, 3])
        st = mgr.stats()
        assert st["h2d_bytes"] == h2d + coded and st["tier_hits"] == hits + 2 and st["prefetch_used"] >= 2
        tier.check()
        mgr.close()


def test_the_stall_on_the_tiers_decodes_is_counted(monkeypatch):
    """CUDA times a wait on its stream by events and reports it from the link it waited on
    (drain_stall_s): a tier hit waits on the decode link, whose waits stats() never read."""
    from specter.offload.manager import OffloadedExperts

    with EmulatedLink(1e12, clock=VirtualClock()) as link:
        mgr = OffloadedExperts(_coded_store(L=2, E=4), None, torch.device("cpu"), link, dtype=torch.float32, pool=2)
        tier = coded_tier.attach(mgr, 10**9, link, decode_link=DecodeLink(1e12, clock=VirtualClock()))
        waited = [0.25, 0.5]  # the waits' seconds, as CudaLink.drain_stall_s hands them over once
        monkeypatch.setattr(link, "drain_stall_s", lambda: 0.125)
        monkeypatch.setattr(tier.link, "drain_stall_s", lambda: waited.pop(0) if waited else 0.0)
        mgr.reset_stats()  # before now: no one's
        assert mgr.stats()["stall_s"] == 0.125 + 0.5
        mgr.close()


def test_a_fill_on_cuda_stages_the_bytes_and_decodes_only_at_need(monkeypatch):
    """FakeCuda (held prefetches, window 0): a fill stages its expert's bytes on the device and launches
    no decode; the tier keeps that buffer when it lands; a fill still held when the cycle ends is
    withdrawn (its bytes uncounted, nothing kept); the need decodes the kept bytes into the slot."""
    from specter.offload.cuda_link import CudaLink
    from specter.offload.manager import OffloadedExperts
    from test_link import FakeCuda

    decoded = []
    torch_decode(monkeypatch, decoded)
    L, E, H, I = 3, 4, 32, 8
    g = torch.Generator().manual_seed(5)
    raw = [ExpertWeights((torch.randn(E, 2 * I, H, generator=g) * 0.1).bfloat16(),
                         (torch.randn(E, H, I, generator=g) * 0.1).bfloat16()) for _ in range(L)]
    store = encode_store([ExpertWeights(w.w13.clone(), w.w2.clone()) for w in raw], cuda=True)
    cuda = FakeCuda(pinned=True, gated=True)
    with CudaLink("cpu", bandwidth=1e9, latency=0.0, cuda=cuda, window_bytes=0) as link, \
            CudaLink("cpu", bandwidth=1e12, cuda=FakeCuda(pinned=True), name="decode") as dec:
        mgr = OffloadedExperts(store, None, torch.device("cpu"), link, dtype=torch.bfloat16, pool=2)
        tier = coded_tier.attach(mgr, 10**6, link, decode_link=dec)
        h2d = mgr.stats()["h2d_bytes"]
        assert [mgr.fill(layer, [1]) for layer in range(L)] == [1, 1, 1]
        assert not decoded  # staged, not decoded
        assert mgr.cancel_prefetches() == 1 and sorted(mgr.filling) == [(0, 1), (1, 1)]  # two on the stream
        assert mgr.stats()["h2d_bytes"] == h2d + sum(store[m].w13[1].nbytes + store[m].w2[1].nbytes for m in (0, 1))
        cuda.land(2)
        link.synchronize()
        mgr.poll()
        assert tier.has(0, 1) and tier.has(1, 1) and not tier.has(2, 1) and not mgr.filling
        tier.check()  # each member's kept buffer is its staged bytes
        assert not decoded
        x = torch.randn(1, H, generator=g).bfloat16()
        mgr(1, x, torch.tensor([[1]]), torch.ones(1, 1).bfloat16())
        assert decoded == [1] and mgr.stats()["tier_hits"] == 1
        slot = mgr.slots.slot_of(1, 1)
        assert torch.equal(mgr.pool[1].w13[slot], raw[1].w13[1]) and torch.equal(mgr.pool[1].w2[slot], raw[1].w2[1])
        cuda.land(10)
        link.synchronize()
        dec.synchronize()


def test_the_planner_fills_the_tier_with_what_gets_no_slot():
    """PrefetchPlanner (specter's draft-time fetches) over a coded store with a tier: the predicted experts
    a layer's slots cannot take go to the tier alone (fills), the others into slots as before; beside a
    host lane (host_choice set) nothing is filled."""
    from specter.offload.manager import OffloadedExperts
    from specter.speculative.draft import Lookahead, PrefetchPlanner

    for lane in (False, True):
        store = _coded_store(L=2, E=8)
        with EmulatedLink(20e6, latency=5e-3) as link:
            mgr = OffloadedExperts(store, 3, torch.device("cpu"), link, dtype=torch.float32)
            coded_tier.attach(mgr, 10**9, link, decode_link=DecodeLink(1e12, clock=VirtualClock()))
            mgr.prefetch_batch = 1
            mgr.host_choice = (lambda layer, missing, routed: []) if lane else None
            la = Lookahead(4, 2, 2, "cpu")
            for r, ids in enumerate([(4, 5), (4, 6), (4, 7), (5, 6)]):  # layer 0: 4 x3, 5 x2, 6 x2, 7 x1
                for layer in range(2):
                    la.ids[r, layer] = torch.tensor(ids)
                    la.weights[r, layer] = torch.tensor([0.6, 0.4])
            planner = PrefetchPlanner(mgr, la)
            planner.begin_cycle()
            issued = planner.plan(4)
            slotted = {(m, e) for (m, e) in mgr.inflight}
            assert slotted == {(m, e) for m in range(2) for e in (4, 5, 6)}, slotted  # the three most demanded
            want = set() if lane else {(0, 7), (1, 7)}
            assert set(mgr.filling) == want and issued == 6 + len(want), (lane, mgr.filling, issued)
            link.synchronize()
            mgr.poll()
            assert all(mgr.tier.has(*key) for key in want) and not mgr.filling
            mgr.close()
