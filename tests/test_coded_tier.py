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
    """Tier hits decode the coded store (the torch decode) instead of copying a decoded copy of it."""
    attach = coded_tier.attach
    monkeypatch.setattr(builder, "attach_tier", lambda mgr, cap, link, rows=None: attach(mgr, cap, link))


@pytest.fixture
def small_verify(monkeypatch):
    """Drafting policies get a tier on the tiny model too: their raw slots sized for one token (the
    plan's rule gives a verification's working set, which leaves this model no room for a tier)."""
    monkeypatch.setattr(plan_mod, "VERIFY_TOKENS", 1)


@pytest.mark.parametrize("policy", ["on-demand", "spec-lru", "specter", "next-layer"])
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


@pytest.mark.parametrize("policy", ["on-demand", "specter"])
def test_tier_decoding_the_coded_store_gives_the_same_tokens(tiny, plain_link, fixed_k, real_decode, small_verify,
                                                             policy):  # noqa: F811
    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    raw = _engine(path, policy, False)
    try:
        want, _ = _generate(raw)
    finally:
        raw.close()
    engine = _engine(path, policy, True)
    try:
        assert engine.decoder.experts.tier.rows is None
        got, outs = _generate(engine)
    finally:
        engine.close()
    assert got == want and sum(o.stats["tier_hits"] for o in outs) > 0


def test_no_tier_where_nothing_would_fill_it(tiny, plain_link):  # noqa: F811
    """The host policy computes every miss on the host lane: the whole budget stays raw slots."""
    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    engine = _engine(path, "host", True)
    try:
        assert engine.plan.tier_bytes == 0 and engine.plan.pool_slots == 12
    finally:
        engine.close()


def test_a_big_store_decodes_on_each_hit_instead_of_a_decoded_copy(tiny, plain_link, monkeypatch):  # noqa: F811
    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    for limit, decoded in ((1, False), (1 << 30, True)):
        monkeypatch.setattr(coded_tier, "ROWS_MAX_BYTES", limit)
        engine = _engine(path, "on-demand", True)
        try:
            assert (engine.decoder.experts.tier.rows is not None) == decoded
            assert (engine.shared.raw is not None) == decoded  # no decoded copy of the store made
        finally:
            engine.close()


def test_tier_hits_move_no_pcie_bytes(tiny, plain_link):  # noqa: F811
    """A tier hit is charged to the decode link and counted as no H2D byte; every other miss crosses the link."""
    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    engine = _engine(path, "on-demand", True)
    try:
        mgr, link, carried = engine.decoder.experts, plain_link[0], []  # experts each transfer carried
        real = link.copy
        link.copy = lambda dst, src, **kw: carried.append(len(dst) // 2) or real(dst, src, **kw)
        link.reset_stats()
        out = engine.generate(PROMPTS[1], max_new_tokens=NEW, temperature=0.0)
        mgr.link.synchronize()
        st = out.stats
        assert st["h2d_bytes"] == link.stats["bytes"] > 0 and link.stats["transfers"] == len(carried)
        assert st["expert_misses"] == st["tier_hits"] + sum(carried)
        assert len(carried) < sum(carried)  # a call's misses crossed together (coalesced)
        assert mgr.tier.link.stats["transfers"] >= st["tier_hits"] > 0
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
        t = tier.copy(0, 2, [d13, d2])
        t.wait()
        assert torch.equal(d13, store[0].w13.decode()[2].float()) and torch.equal(d2, store[0].w2.decode()[2].float())
        assert tier.stats["tier_hits"] == 1 and tier.copy(0, 1, [d13, d2]) is None  # not a member: no decode
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
    # a drafting policy's raw slots hold a verification's working set (top-2 x 5 tokens): at 16 slots
    # the tier would hold 6 / 0.7 < 16, so none; at 48 slots 10 raw + 54 coded
    drafting = make_plan(spec, total, torch.float32, expert_memory=16 * slot, draft=True, device="cpu", coded_tier=0.7)
    assert drafting.tier_bytes == 0 and drafting.pool_slots == 16
    big = make_plan(spec, total, torch.float32, expert_memory=48 * slot, draft=True, device="cpu", coded_tier=0.7)
    assert big.pool_slots == 10 and big.tier_bytes == 38 * slot and big.tier_experts == 54
    assert tier_split(48, 2, 16, 4, 0.7, verify=5) == 10 and tier_split(16, 2, 16, 4, 0.7, verify=5) == 16
    every = make_plan(spec, total, torch.float32, residency=1.0, draft=False, device="cpu", coded_tier=0.7)
    assert every.tier_bytes == 0 and every.pool_slots == 64


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
