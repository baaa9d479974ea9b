"""compress_experts (issue 24): a losslessly coded host store gives the very tokens of the raw one, the
link moves (and the emulated link charges) the coded bytes, and a non-bf16 checkpoint is refused."""
from __future__ import annotations

import json
import os
import shutil
import time
import weakref

import pytest
import torch

import specter
from specter import builder
from specter.errors import ConfigError, SpecterWarning
from specter.offload.coded import CodedLayer, DecodedStore, encode_store, store_nbytes
from specter.offload.link import EmulatedLink
from specter.moe import ExpertWeights
from specter.speculative.draft_cache import draft_int4
from specter.triton_ops.lossless import encode, layer_major_nbytes

from test_link import VirtualClock

PROMPTS = [[1, 5, 9, 33, 2], list(range(10, 40)), [100, 3, 64, 12, 90, 45, 8]]
NEW = 20


@pytest.fixture
def plain_link(monkeypatch):
    """Engines built in this test get a fixed EmulatedLink (no calibration, no decode charge)."""
    made = []

    def make_link(device, profile=None, **kw):
        made.append(EmulatedLink(200e6, 1e-4, name="test"))
        return made[-1]

    monkeypatch.setattr(builder, "make_link", make_link)
    yield made
    for link in made:
        link.close()


def _run(path, policy, compress, residency):
    engine = specter.load(path, device="cpu", policy=policy, residency=residency, compress_experts=compress)
    try:
        assert engine.dtype == torch.float32
        assert isinstance(engine.shared.store[0], CodedLayer) == compress
        outs = [engine.generate(p, max_new_tokens=NEW, temperature=0.0) for p in PROMPTS]
    finally:
        engine.close()
    return [o.token_ids for o in outs], sum(o.stats["h2d_bytes"] for o in outs), sum(o.stats["expert_misses"] for o in outs)


@pytest.mark.parametrize("policy", ["on-demand", "specter", "next-layer", "host", "spec-lru", "oracle"])
def test_compressed_store_decodes_the_same_greedy_tokens(tiny, plain_link, fixed_k, policy):
    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    for residency in (0.25, 0.5):
        raw, raw_bytes, misses = _run(path, policy, False, residency)
        coded, coded_bytes, _ = _run(path, policy, True, residency)
        assert coded == raw, f"{policy} at {residency}"
        assert len({t for ts in raw for t in ts}) > 5  # a reference that can fail
        if policy != "host":  # the host policy computes misses on the host lane: nothing copied
            assert misses > 0 and 0 < coded_bytes < raw_bytes, (policy, residency, coded_bytes, raw_bytes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("in_place", [False, True], ids=["staged", "in-place"])
def test_compressed_store_on_cuda_decodes_the_same_greedy_tokens(tiny, monkeypatch, in_place):
    """On CUDA a coded copy is the pair path (one launch an expert: staged, or with
    SPECTER_CODED_IN_PLACE=1 read in place from the locked arena): on-demand and specter at 1/4
    residency give the raw store's greedy tokens, and the coded copies moved fewer bytes."""
    from specter.offload import coded as coded_mod

    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    if in_place:
        monkeypatch.setenv("SPECTER_CODED_IN_PLACE", "1")
    for policy in ("on-demand", "specter"):
        got = {}
        for compress in (False, True):
            engine = specter.load(path, device="cuda", policy=policy, residency=0.25, compress_experts=compress)
            try:
                if compress:
                    pairs = [layer.w13.pair for layer in engine.shared.store]
                    assert all(p is not None and p.in_place == (in_place and coded_mod.is_locked(p.words))
                               for p in pairs), policy
                outs = [engine.generate(p, max_new_tokens=NEW, temperature=0.0) for p in PROMPTS]
            finally:
                engine.close()
            got[compress] = [o.token_ids for o in outs], sum(o.stats["h2d_bytes"] for o in outs)
        assert got[True][0] == got[False][0], policy
        assert 0 < got[True][1] < got[False][1], (policy, got[True][1], got[False][1])


def test_coded_store_is_smaller_and_decodes_to_its_bits(tiny):
    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    engine = specter.load(path, device="cpu", policy="resident")
    try:
        raw = [ExpertWeights(ew.w13.clone(), ew.w2.clone()) for ew in engine.shared.store]
    finally:
        engine.close()
    raw_bytes = store_nbytes(raw)
    coded = encode_store([ExpertWeights(ew.w13.clone(), ew.w2.clone()) for ew in raw])
    assert store_nbytes(coded) < raw_bytes
    for c, r in zip(DecodedStore(coded), raw):
        assert torch.equal(c.w13.view(torch.int16), r.w13.view(torch.int16))
        assert torch.equal(c.w2.view(torch.int16), r.w2.view(torch.int16))
        assert c.expert_nbytes() == r.expert_nbytes() and c.n_experts == r.n_experts
    # the draft quantised from the decoded store is the draft of the raw store
    (a13, a2), = [next(iter(draft_int4(raw[:1], [], "cpu", cache="off")))]
    (b13, b2), = [next(iter(draft_int4(DecodedStore(coded[:1]), [], "cpu", cache="off")))]
    for a, b in ((a13, b13), (a2, b2)):
        assert all(torch.equal(x, y) for x, y in zip(a.tensors().values(), b.tensors().values()))


def test_emulated_link_charges_coded_bytes_and_decode(tiny):
    """On a virtual clock: a coded copy takes latency + its coded bytes (at the width written) over the
    bandwidth + the decode's bytes (coded read, bf16 written, same width) at decode_bandwidth."""
    torch.manual_seed(0)
    w = (torch.randn(3, 64, 96) * 0.05).bfloat16()
    coded = CodedLayer(encode(w), encode(w[:, :32, :].contiguous()))
    bw, lat, dec = 50e6, 1e-4, 400e6
    clock = VirtualClock()
    with EmulatedLink(bw, lat, clock=clock, decode_bandwidth=dec) as link:
        expected, nbytes = 0.0, 0
        for e, dtype in ((0, torch.bfloat16), (1, torch.float32), (2, torch.float32)):
            d13, d2 = torch.zeros(64, 96, dtype=dtype), torch.zeros(32, 96, dtype=dtype)
            srcs = [coded.w13[e], coded.w2[e]]
            t = link.copy([d13, d2], srcs)
            t.wait()
            width = dtype.itemsize / 2
            want = lat + sum(s.nbytes for s in srcs) * width / bw + sum(s.nbytes + s.raw_nbytes for s in srcs) * width / dec
            assert t.seconds == pytest.approx(want, rel=1e-12)
            assert t.nbytes == sum(s.nbytes for s in srcs) < sum(s.raw_nbytes for s in srcs)
            expected += want
            nbytes += t.nbytes
            assert torch.equal(d13, w[e].to(dtype)) and torch.equal(d2, w[e, :32].to(dtype))  # decoded as it landed
        link.synchronize()
        assert clock.now() == pytest.approx(expected, rel=1e-9)
        assert link.stats["bytes"] == nbytes
    # a raw copy is charged its written bytes, as before
    with EmulatedLink(bw, lat, clock=VirtualClock(), decode_bandwidth=dec) as link:
        src, dst = w[0], torch.zeros(64, 96)
        assert link.copy(dst, src).seconds == pytest.approx(lat + dst.nbytes / bw, rel=1e-12)


def test_compressed_manager_counts_the_links_bytes(tiny, plain_link):
    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    engine = specter.load(path, device="cpu", policy="on-demand", residency=0.25, compress_experts=True)
    try:
        plain_link[0].reset_stats()
        out = engine.generate(PROMPTS[1], max_new_tokens=NEW, temperature=0.0)
        engine.decoder.experts.link.synchronize()
        assert out.stats["h2d_bytes"] == plain_link[0].stats["bytes"] > 0
    finally:
        engine.close()


def test_compress_experts_refuses_non_bf16_checkpoints(tiny):
    path, _ = tiny("qwen3_moe")  # fp32
    with pytest.raises(ConfigError, match="bf16"):
        specter.load(path, device="cpu", policy="on-demand", residency=0.5, compress_experts=True)
    bf16, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="compress_experts must be"):
        specter.load(bf16, device="cpu", policy="on-demand", residency=0.5, compress_experts="yes")


def test_compress_experts_where_every_expert_has_a_slot_is_warned_about(tiny, monkeypatch):
    """On CPU with no budget (or residency 1) every expert has a slot: nothing is copied, so coding the
    store only costs its encoding (a QA pass: accepted silently). The load says so, before it codes."""
    bf16, _ = tiny("qwen3_moe", dtype=torch.bfloat16)

    def loaded(*_, **__):
        raise AssertionError("warned after the load")

    monkeypatch.setattr(builder, "load_shared", loaded)
    for budget in ({}, dict(residency=1.0)):
        with pytest.warns(SpecterWarning, match="every expert has a slot in this budget, so on-demand copies"), \
                pytest.raises(AssertionError, match="after the load"):
            specter.load(bf16, device="cpu", policy="on-demand", compress_experts=True, **budget)


def test_cli_passes_compress_experts():
    from specter.cli import build_parser, engine_options

    for argv in (["generate", "x"], ["bench"], ["serve"]):
        args = build_parser().parse_args(argv + ["--compress-experts"])
        assert engine_options(args)["compress_experts"] is True
        assert "compress_experts" not in engine_options(build_parser().parse_args(argv))
    assert build_parser().parse_args(["plan", "--compress-experts"]).compress_experts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_link_decodes_coded_copies_into_the_slot(dtype):
    from specter.offload.cuda_link import CudaLink

    torch.manual_seed(0)
    w = (torch.randn(4, 128, 96) * 0.05).bfloat16()
    coded = encode_store([ExpertWeights(w.clone(), w[:, :64].contiguous())], pin=True)[0]
    link = CudaLink("cuda")
    try:
        for e in range(4):
            d13 = torch.zeros(128, 96, dtype=dtype, device="cuda")
            d2 = torch.zeros(64, 96, dtype=dtype, device="cuda")
            t = link.copy([d13, d2], [coded.w13[e], coded.w2[e]], after=None)
            t.wait()
            assert t.nbytes == coded.w13[e].nbytes + coded.w2[e].nbytes
            assert torch.equal(d13.cpu(), w[e].to(dtype)) and torch.equal(d2.cpu(), w[e, :64].to(dtype))
    finally:
        link.close()


def test_coded_store_cache_miss_hit_corrupt_stale(tiny, tmp_path, monkeypatch):
    """Coded once per checkpoint: a miss reads, codes and writes every layer, one at a time; a hit codes
    nothing and reads no expert from the checkpoint; a corrupt or truncated layer file, or one of another
    key, is read and coded anew, alone."""
    from specter import loader
    from specter.offload import coded as coded_mod
    from specter.speculative import draft_cache

    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    encodes, reads, alive = [], [], []
    real_encode, real_load, real_read = coded_mod.encode, builder.load_checkpoint, loader.StoredExperts.__getitem__
    monkeypatch.setattr(coded_mod, "encode", lambda w, *a, **k: encodes.append(1) or real_encode(w, *a, **k))
    monkeypatch.setattr(builder, "load_checkpoint", lambda *a, **k: assert_no_arena(k) or real_load(*a, **k))

    def assert_no_arena(kw):  # the raw store is never loaded whole beside the coded one
        assert kw.get("experts", True) is False

    def read(self, i):  # a raw layer read from the checkpoint; alive: how many such layers exist at once
        layer = real_read(self, i)
        alive.append(1)
        weakref.finalize(layer.w13, alive.pop)
        reads.append(i)
        assert len(alive) == 1, "a raw layer was kept while the next was read"
        return layer

    monkeypatch.setattr(loader.StoredExperts, "__getitem__", read)

    def load():
        encodes.clear()
        reads.clear()
        shared = builder.load_shared(path, torch.device("cpu"), draft_cache=str(tmp_path), compress_experts=True)
        return shared.store

    first = load()
    L = len(first)
    assert len(encodes) == 2 * L and reads == list(range(L)) and not alive  # miss: each layer read, coded, freed
    entry = next(tmp_path.glob("coded-*"))
    assert sorted(p.name for p in entry.iterdir()) == [f"layer-{i}.safetensors" for i in range(L)] + ["source.json"]

    def same(a, b):
        return all(torch.equal(x, y) for m in ("w13", "w2")
                   for x, y in zip(getattr(a, m).packed.tensors(), getattr(b, m).packed.tensors()))

    again = load()
    assert encodes == [] and reads == []  # hit: nothing coded, no expert read
    assert all(same(a, b) for a, b in zip(first, again))

    f = entry / "layer-1.safetensors"  # corrupt: one flipped byte in the last tensor's data
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0xFF
    f.write_bytes(bytes(raw))
    (entry / "layer-0.safetensors").write_bytes(b"\0" * 10)  # truncated
    rebuilt = load()
    assert len(encodes) == 4 and reads == [0, 1]  # the two bad layers read and coded anew, the rest from the cache
    assert all(same(a, b) for a, b in zip(first, rebuilt))
    load()
    assert encodes == [] and reads == []

    # the shapes in the metadata (outside the tensors' CRCs) edited to another of as many elements
    f = entry / "layer-1.safetensors"
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    shapes = json.loads(header["__metadata__"]["shapes"])
    E, N, K = shapes["w13"]
    header["__metadata__"]["shapes"] = json.dumps({**shapes, "w13": [E, N // 2, K * 2]})
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    f.write_bytes(len(blob).to_bytes(8, "little") + blob + raw[8 + n:])
    rebuilt = load()
    assert len(encodes) == 2 and reads == [1]  # not trusted: read and coded anew
    assert all(same(a, b) and a.w13.shape == b.w13.shape for a, b in zip(first, rebuilt))

    # stale: a layer file of another key (another checkpoint) under this one's name is not trusted
    monkeypatch.setattr(coded_mod, "cache_key", lambda files: "another-key")
    monkeypatch.setattr(draft_cache, "entry_source", lambda *a, **k: {"kind": "another checkpoint"})
    load()
    shutil.copy(tmp_path / "coded-another-key" / "layer-0.safetensors", entry / "layer-0.safetensors")
    monkeypatch.undo()
    monkeypatch.setattr(coded_mod, "encode", lambda w, *a, **k: encodes.append(1) or real_encode(w, *a, **k))
    load()
    assert len(encodes) == 2
    # the key follows the coding's settings
    key = coded_mod.cache_key([path / "model.safetensors"])
    monkeypatch.setattr(coded_mod.lossless, "WIDTHS", (3, 4))
    assert coded_mod.cache_key([path / "model.safetensors"]) != key


def test_the_coded_cache_misses_an_edit_that_puts_the_time_back(tiny, tmp_path):
    """An in-place edit of a shard that keeps its size and puts its modification time back (os.utime, touch
    -r) kept the coded key where the fingerprint's samples missed the edited bytes, and a pipeline rank
    or a GPU then decoded the old weights: another model's output. Setting the time moves the shard's
    ctime, which the key reads."""
    from specter.offload import coded as coded_mod

    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    work = tmp_path / "m"
    shutil.copytree(path, work)
    shard = work / "model.safetensors"
    key = coded_mod.cache_key([shard])
    assert coded_mod.cache_key([shard]) == key  # (a hit stays a hit)
    st = shard.stat()
    time.sleep(0.01)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # the bytes as they were, the time put back
    assert shard.stat().st_mtime_ns == st.st_mtime_ns
    assert coded_mod.cache_key([shard]) != key


def test_raw_readers_of_a_coded_store_read_the_checkpoint_not_decode_it(tiny, tmp_path, monkeypatch):
    """The host lane's raw copy, the draft's quantisation and resident rows read the checkpoint's bits
    (loader.StoredExperts), several times faster than decoding on the CPU: equal to the decoded store,
    and no decode runs (it used to decode every layer twice, and layer 0 once more for a shape)."""
    from specter.offload import coded as coded_mod

    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    shared = builder.load_shared(path, torch.device("cpu"), draft_cache=str(tmp_path), compress_experts=True)
    decoded = [layer.decoded() for layer in shared.store]
    monkeypatch.setattr(coded_mod.CodedTensor, "decode", lambda *a, **k: pytest.fail("decoded"))
    first = list(shared.decoded_store())  # nothing kept yet: read a layer at a time
    rows = shared.host_rows()
    assert shared.decoded_store() is rows  # once kept, the readers share it
    for got in (first, rows, shared.resident_experts()):
        assert all(torch.equal(a.w13, b.w13.to(a.w13.dtype)) and torch.equal(a.w2, b.w2.to(a.w2.dtype))
                   for a, b in zip(got, decoded))
    engine = specter.load(path, device="cpu", policy="specter", residency=0.5, compress_experts=True,
                          draft_cache=str(tmp_path))
    engine.generate([1, 2, 3], max_new_tokens=4)  # the draft quantised, no decode outside the link's copies
    engine.close()


@pytest.mark.parametrize("policy, limit", [("specter", 1 << 30), ("host", 0), ("spec-lru", 0), ("on-demand", 0)])
def test_a_first_coded_load_reads_each_expert_once(tiny, tmp_path, plain_link, fixed_k, monkeypatch, policy, limit):
    """A cold coded load read a big model's experts twice (tens of GB): to code them, then again for the raw
    copy a host lane (or, on CPU, coded copies up to ROWS_MAX_BYTES) keeps, or to quantise the draft. The raw
    copy is now read first and coded from, and the draft quantised from the coding's read into its cache;
    a warm load reads no layer but the raw copy's. The same tokens as the raw store's."""
    from specter.loader import StoredExperts
    from specter.offload import coded_tier

    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    want, _, _ = _run(path, policy, False, 0.25)
    monkeypatch.setattr(coded_tier, "ROWS_MAX_BYTES", limit)
    reads, real = [], StoredExperts.__getitem__
    monkeypatch.setattr(StoredExperts, "__getitem__", lambda self, i: reads.append(i) or real(self, i))
    for cold in (True, False):
        reads.clear()
        engine = specter.load(path, device="cpu", policy=policy, residency=0.25, compress_experts=True,
                              draft_cache=str(tmp_path))
        try:
            n, keeps = engine.shared.ckpt.spec.n_moe_layers, engine.shared.raw is not None
            assert keeps == (policy in ("specter", "host") or limit > 0)  # (a host lane, or under the limit)
            assert sorted(reads) == (list(range(n)) if cold or keeps else []), (policy, cold)
            assert [engine.generate(p, max_new_tokens=NEW, temperature=0.0).token_ids for p in PROMPTS] == want
        finally:
            engine.close()


def test_a_config_that_does_not_match_the_experts_is_refused_on_a_cache_hit(tiny, tmp_path):
    """A whole-cache hit reads no expert; the headers' shapes are still checked against config.json (it ran
    before, on the cached shapes, copying experts the config did not describe)."""
    import json

    from specter.errors import CheckpointError

    path = tmp_path / "model"  # a copy: the session's checkpoint is shared
    shutil.copytree(tiny("qwen3_moe", dtype=torch.bfloat16)[0], path)
    builder.load_shared(path, torch.device("cpu"), draft_cache=str(tmp_path), compress_experts=True)  # cached
    cfg = json.loads((path / "config.json").read_text())
    cfg["moe_intermediate_size"] //= 2
    (path / "config.json").write_text(json.dumps(cfg))
    for cache in (str(tmp_path), "off"):
        with pytest.raises(CheckpointError, match="does not match the config's"):
            builder.load_shared(path, torch.device("cpu"), draft_cache=cache, compress_experts=True)


def test_coded_store_cache_off(tiny, tmp_path, monkeypatch):
    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    monkeypatch.setenv("SPECTER_DRAFT_CACHE", "off")
    shared = builder.load_shared(path, torch.device("cpu"), compress_experts=True)
    assert isinstance(shared.store[0], CodedLayer)


@pytest.mark.parametrize("policy", ["on-demand", "specter"])
def test_compressed_store_samples_the_same_tokens(tiny, plain_link, fixed_k, policy):
    """Sampling: the decoded weights are the raw ones bit for bit, so the same policy and seed draw the
    very same tokens (the distribution is unchanged because the numbers are)."""
    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    outs = []
    for compress in (False, True):
        engine = specter.load(path, device="cpu", policy=policy, residency=0.25, compress_experts=compress)
        try:
            outs.append([engine.generate(p, max_new_tokens=NEW, temperature=1.0, top_p=0.95, seed=7).token_ids
                         for p in PROMPTS])
        finally:
            engine.close()
    assert outs[0] == outs[1] and len({t for ts in outs[0] for t in ts}) > 5


def test_bench_and_plan_cli_with_compress_experts(capsys, tiny, tmp_path, plain_link):
    import json

    from specter.cli import main

    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS[:2]))
    per_token = {}
    for flag in ([], ["--compress-experts"]):
        rc = main(["bench", "--model", str(path), "--device", "cpu", "--policies", "on-demand", "--residency", "0.25",
                   "--prompts", str(prompts), "--max-new-tokens", "8", "--json"] + flag)
        out, err = capsys.readouterr()
        assert rc == 0, err
        r = json.loads(out)["policies"]["on-demand"]
        per_token[bool(flag)] = r["h2d_bytes_per_token"]
        assert r["h2d_bytes_per_token"] == pytest.approx(r["h2d_bytes"] / r["new_tokens"])
    assert 0 < per_token[True] < per_token[False]
    rc = main(["bench", "--model", str(path), "--device", "cpu", "--policies", "on-demand", "--residency", "0.25",
               "--prompts", str(prompts), "--max-new-tokens", "4", "--compress-experts"])
    out, err = capsys.readouterr()
    assert rc == 0 and "H2D KB/tok" in out, err

    rc = main(["plan", "--model", str(path), "--device", "cpu", "--residency", "0.25", "--compress-experts", "--json"])
    out, err = capsys.readouterr()
    host = json.loads(out)["host"]
    assert rc == 0 and 0 < host["store_bytes"] < host["raw_store_bytes"]
    assert host["raw_rows_bytes"] == host["raw_store_bytes"]  # specter's host lane (CPU) reads a raw copy beside it
    engine = specter.load(path, device="cpu", residency=0.25, compress_experts=True)  # what the plan counts
    assert sum(e.w13.nbytes + e.w2.nbytes for e in engine.shared.raw) == host["raw_rows_bytes"]
    engine.close()
    # a device budget: the same raw copy, and the emulated device (it said 0 for both)
    rc = main(["plan", "--model", str(path), "--device", "cpu", "--device-memory", "64MiB", "--compress-experts",
               "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    by_memory = json.loads(out)["host"]
    assert by_memory["raw_rows_bytes"] == host["raw_rows_bytes"] and by_memory["device_bytes"] > 0, by_memory
    rc = main(["plan", "--model", str(path), "--device", "cpu", "--residency", "0.25", "--compress-experts"])
    out, _ = capsys.readouterr()
    assert rc == 0 and "losslessly coded" in out
    fp32, _ = tiny("qwen3_moe")
    rc = main(["plan", "--model", str(fp32), "--device", "cpu", "--residency", "0.25", "--compress-experts"])
    _, err = capsys.readouterr()
    assert rc == 2 and "bf16" in err and "Traceback" not in err


def test_host_lane_bytes_are_the_raw_experts_it_reads(tiny, plain_link):
    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    engine = specter.load(path, device="cpu", policy="host", residency=0.25, compress_experts=True)
    try:
        out = engine.generate(PROMPTS[1], max_new_tokens=8, temperature=0.0)
        raw = engine.shared.store[0].raw_expert_nbytes()
        assert out.stats["host_experts"] > 0 and out.stats["host_bytes"] == out.stats["host_experts"] * raw
    finally:
        engine.close()


def test_coded_copies_write_raw_rows_or_decode(tiny, plain_link, monkeypatch):
    """CPU: coded copies write their slot from raw rows (offload/coded.py, emulate_from): a decoded copy
    of the store up to ROWS_MAX_BYTES, else each expert read from the checkpoint as its copy runs
    (loader.ExpertReads: no copy kept); without either they decode on the link. The same tokens each way."""
    from specter.loader import ExpertReads, StoredExperts
    from specter.offload import coded_tier

    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    raw, _, _ = _run(path, "on-demand", False, 0.25)
    for limit, reads, rows in ((1 << 30, True, torch.Tensor), (0, True, ExpertReads), (0, False, type(None))):
        monkeypatch.setattr(coded_tier, "ROWS_MAX_BYTES", limit)
        if not reads:  # as where an expert tensor is stored in another dtype than the store's
            monkeypatch.setattr(StoredExperts, "expert_reads", lambda self: None)
        engine = specter.load(path, device="cpu", policy="on-demand", residency=0.25, compress_experts=True)
        try:
            assert all(isinstance(layer.w13.rows, rows) and isinstance(layer.w2.rows, rows)
                       for layer in engine.shared.store)
            assert (engine.shared.raw is not None) == (rows is torch.Tensor)  # kept only under the limit
            outs = [engine.generate(p, max_new_tokens=NEW, temperature=0.0) for p in PROMPTS]
            tokens = [o.token_ids for o in outs]
            assert sum(o.stats["h2d_bytes"] for o in outs) > 0  # coded copies crossed the link
        finally:
            engine.close()
        assert tokens == raw, (limit, rows)


def test_a_checkpoint_changed_in_place_after_the_load_changes_no_token(tiny, tmp_path, plain_link, monkeypatch):
    """Coded copies past ROWS_MAX_BYTES read each expert from the checkpoint as they run (ExpertReads). A
    file written in place since the load (same inode: cp onto it, dd, r+b) must not change the weights
    computed with: the reads notice (size, mtime, ctime), warn once, and the copies decode the store."""
    from specter.offload import coded_tier

    path = tmp_path / "m"
    shutil.copytree(tiny("qwen3_moe", dtype=torch.bfloat16)[0], path)
    monkeypatch.setattr(coded_tier, "ROWS_MAX_BYTES", 0)
    engine = specter.load(path, device="cpu", policy="on-demand", residency=0.25, compress_experts=True,
                          draft_cache="off")
    try:
        want = [engine.generate(p, max_new_tokens=NEW, temperature=0.0).token_ids for p in PROMPTS]
        f = path / "model.safetensors"
        raw = f.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        with open(f, "r+b") as fh:  # every routed expert's weights negated, in place
            for name, t in header.items():
                if ".experts." in name:
                    begin, end = (8 + n + o for o in t["data_offsets"])
                    w = torch.frombuffer(bytearray(raw[begin:end]), dtype=torch.int16) ^ -0x8000
                    fh.seek(begin)
                    fh.write(w.numpy().tobytes())
        with pytest.warns(UserWarning, match="changed on disk after the load"):
            got = [engine.generate(p, max_new_tokens=NEW, temperature=0.0) for p in PROMPTS]
        assert [o.token_ids for o in got] == want and sum(o.stats["expert_misses"] for o in got) > 0
        with open(f, "r+b") as fh:  # truncated too: still the loaded weights, no error
            fh.truncate(n + 64)
        assert [engine.generate(p, max_new_tokens=NEW, temperature=0.0).token_ids for p in PROMPTS] == want
    finally:
        engine.close()


def _fused(src, dst):
    """dst: the checkpoint at `src` saved with transformers-v5's in-memory expert layout (one
    gate_up_proj [E, 2I, H] and down_proj [E, H, I] a layer) instead of published per-expert names."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors*"):
        f.unlink()
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16)
    state = {k: v.contiguous().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"
             or not model.config.tie_word_embeddings}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_expert_reads_are_the_stored_experts_of_either_layout(tiny, tmp_path):
    """loader.ExpertReads: expert e's rows as StoredExperts reads its layer, for published per-expert
    tensors and for a fused layer (an offset into one tensor); from several threads at once."""
    from concurrent.futures import ThreadPoolExecutor

    from specter.loader import StoredExperts, open_checkpoint

    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    per_expert = StoredExperts(open_checkpoint(path))
    for ckpt_path in (path, _fused(path, tmp_path / "fused")):
        stored = StoredExperts(open_checkpoint(ckpt_path))
        assert len(stored.names[0]) == (2 if ckpt_path != path else 3 * 8)
        reads = stored.expert_reads()
        assert len(reads) == len(stored) > 1
        for i, layer in enumerate(stored):
            assert torch.equal(layer.w13.view(torch.int16), per_expert[i].w13.view(torch.int16))  # same bits
            for want, got in ((layer.w13, reads[i].w13), (layer.w2, reads[i].w2)):
                with ThreadPoolExecutor(4) as pool:
                    rows = list(pool.map(got.__getitem__, range(len(got))))
                assert len(got) == want.shape[0] and all(r.dtype == torch.bfloat16 for r in rows)
                assert torch.equal(torch.stack(rows).view(torch.int16), want.view(torch.int16))


def test_a_fused_checkpoint_generates_the_per_expert_ones_tokens(tiny, tmp_path, plain_link):
    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    fused = _fused(path, tmp_path / "fused")
    for compress in (False, True):
        assert _run(fused, "on-demand", compress, 0.25)[0] == _run(path, "on-demand", compress, 0.25)[0]


def test_a_coded_expert_from_rows_writes_its_decoded_bits():
    from specter.offload.coded import emulate_from

    torch.manual_seed(1)
    w13, w2 = (torch.randn(4, 48, 32) * 0.03).bfloat16(), (torch.randn(4, 32, 24) * 0.03).bfloat16()
    store = [CodedLayer(encode(w13), encode(w2))]
    rows = [store[0].decoded()]
    emulate_from(store, rows)
    for e in range(4):
        src = store[0].w13[e]
        assert src.rows is rows[0].w13 and src.nbytes < src.raw_nbytes  # still charged as coded
        out = torch.zeros(48, 32, dtype=torch.float32)
        src.decode_into(out)
        assert torch.equal(out, w13[e].float())
    emulate_from(store, None)
    assert store[0].w13[0].rows is None
    out = torch.zeros(32, 24, dtype=torch.bfloat16)
    assert torch.equal(store[0].w2[3].decode_into(out).view(torch.int16), w2[3].view(torch.int16))


def test_wide_experts_model_is_the_bundled_function(tmp_path):
    """bench/wide_experts.py (issue 24's realistic-size check): the widened model gives the bundled
    model's greedy tokens, and its experts code at the bundled experts' ratio."""
    import importlib.util
    from pathlib import Path

    from specter import default_model_path
    from specter.offload.coded import coded_store_bytes

    script = Path(__file__).resolve().parents[1] / "bench" / "wide_experts.py"
    spec = importlib.util.spec_from_file_location("wide_experts", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.widen(default_model_path(), tmp_path, 4)
    prompts = ["The quick brown fox", "Once upon a time"]
    tokens = []
    for path in (default_model_path(), tmp_path):
        engine = specter.load(path, device="cpu", policy="resident")
        try:
            tokens.append([engine.generate(p, max_new_tokens=12, temperature=0.0).token_ids for p in prompts])
        finally:
            engine.close()
    assert tokens[0] == tokens[1] and len({t for ts in tokens[0] for t in ts}) > 3
    from specter.loader import open_checkpoint

    assert open_checkpoint(tmp_path).spec.expert_inter == 4 * open_checkpoint(default_model_path()).spec.expert_inter
    (c0, r0), (c1, r1) = coded_store_bytes(default_model_path()), coded_store_bytes(tmp_path)
    assert r1 == 4 * r0 and abs(c1 / r1 - c0 / r0) < 0.005, (c0 / r0, c1 / r1)
    with pytest.raises(SystemExit):
        mod.widen(default_model_path(), tmp_path / "x", 3)  # not a power of two


@pytest.mark.parametrize("policy", ["specter", "spec-lru"])
def test_pinned_choices_decide_alike_and_the_coded_store_charges_less(tiny, plain_link, monkeypatch, capsys,
                                                                      tmp_path, policy):
    """bench/coded_specter.py --k (issue 24): with K, the plain arms and the copy's seconds pinned, a
    drafting policy runs the same cycles, copies the same experts and hosts the same ones on the coded
    store as on the raw one, with the same tokens, and the link charges the coded engine less: only the
    governor's timed choice can set the two apart (docs/RESULTS.md, 2026-12-02)."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "coded_specter.py"
    spec = importlib.util.spec_from_file_location("coded_specter", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS[1:]))
    monkeypatch.setattr(sys, "argv", ["coded_specter.py", "--model", str(path), "--policy", policy, "--k", "3",
                                      "--residency", "0.25", "--prompts-file", str(prompts), "--prompts", "2",
                                      "--max-new-tokens", "12", "--json"])
    mod.main()
    res = json.loads(capsys.readouterr().out)
    raw, coded = res["raw"], res["coded"]
    assert res["same_tokens"] and raw["tokens"] == 24
    assert raw["k_hist"] == coded["k_hist"] and raw["k_hist"].get("3", 0) > 0 and max(map(int, raw["k_hist"])) == 3
    assert raw["plain_steps"] == coded["plain_steps"] == 0
    assert raw["experts_copied"] == coded["experts_copied"] > 0
    assert raw["host_experts"] == coded["host_experts"] and (raw["host_experts"] > 0) == (policy == "specter")
    assert 0 < coded["h2d_bytes_per_token"] < raw["h2d_bytes_per_token"]
    assert 0 < coded["link_profile_us_per_token"] < raw["link_profile_us_per_token"]


def test_a_pinned_coded_store_locks_exactly_its_bytes_in_place(monkeypatch):
    """On CUDA the coded store is page-locked in place, one arena a coded layer, exactly its bytes
    (pin_memory() rounds each tensor up to a power of two: up to 2x the host memory coding saves); the
    link reads it as pinned, it decodes to the same bits, and a refusal warns once and runs pageable."""
    import gc

    from test_big_load import _FakeCudart

    from specter.offload.cuda_link import CudaApi

    g = torch.Generator().manual_seed(0)
    layers = [ExpertWeights((torch.randn(3, 16, 64, generator=g) * 0.05).bfloat16(),
                            (torch.randn(3, 64, 8, generator=g) * 0.05).bfloat16()) for _ in range(2)]
    want = [(ew.w13.clone(), ew.w2.clone()) for ew in layers]
    fake = _FakeCudart(0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    coded = encode_store(list(layers), pin=True)
    plain = [[encode(w) for w in pair] for pair in want]
    assert fake.calls == [layer_major_nbytes(*p) for p in plain], "not one exact-size registration a coded layer"
    gc.collect()  # the locks live as long as the coded tensors (dtype views of the arenas)
    for layer, (w13, w2) in zip(coded, want):
        assert torch.equal(layer.w13.packed.decode(), w13) and torch.equal(layer.w2.packed.decode(), w2)
        for p in (layer.w13.packed, layer.w2.packed):  # what a copy reads: each expert's row and escape run
            assert all(CudaApi().is_pinned(t) for e in range(3) for t in (p.by_expert[e], p.expert_escapes(e)) if t.numel())
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _FakeCudart(2))
    layers = [ExpertWeights(w13.clone(), w2.clone()) for w13, w2 in want]
    with pytest.warns(UserWarning, match="could not pin the coded expert store") as caught:
        coded = encode_store(layers, pin=True)
    assert len([w for w in caught if "coded expert store" in str(w.message)]) == 1
    assert torch.equal(coded[1].w2.packed.decode(), want[1][1])


def test_experts_that_do_not_compress_are_warned_about(tiny, tmp_path):
    """Weights whose exponents are spread wide code larger than bf16 (the QA pass's 1.11x): the store
    then moves more bytes a copy, not fewer, so the load says so."""
    from safetensors.torch import load_file, save_file

    src, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    path = tmp_path / "m"
    shutil.copytree(src, path)
    tensors = load_file(src / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if ".experts." in name:  # every exponent about equally likely: nothing for a code to exploit
            scale = torch.exp2(torch.randint(-60, 60, t.shape, generator=g).float())
            tensors[name] = (torch.randn(t.shape, generator=g) * scale).to(torch.bfloat16)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(SpecterWarning, match=r"code to 1\.\d\dx their bf16 bytes"):
        shared = builder.load_shared(path, torch.device("cpu"), draft_cache="off", compress_experts=True)
    assert shared.compressed
