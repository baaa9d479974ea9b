"""Drafts at 4, 3 and 2 bits: the draft cache keys and checks the width, and speculation stays
lossless whatever the width (greedy tokens equal plain decoding, spec-lru and specter, on the
bundled model and on a tiny checkpoint)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import specter
from specter.errors import ConfigError
from specter.loader import load_checkpoint, open_checkpoint
from specter.speculative import draft_cache

from speculative_common import fast_link  # noqa: F401 -- a fixture

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def qwen(tiny):
    path, _ = tiny("qwen3_moe", eos_token_id=None)  # hidden 64, expert intermediate 32: every width fits
    return path


def _count_packs(monkeypatch):
    calls = []
    real = draft_cache.pack_experts
    monkeypatch.setattr(draft_cache, "pack_experts",
                        lambda w, bits, *a, **k: calls.append(bits) or real(w, bits, *a, **k))
    return calls


def _same(a, b) -> bool:
    return all(qa.bits == qb.bits and all(torch.equal(x, y) for x, y in zip(qa.tensors().values(),
                                                                            qb.tensors().values()))
               for la, lb in zip(a, b) for qa, qb in zip(la, lb))


# ---------------------------------------------------------------------------------- the cache
@pytest.mark.parametrize("bits", [3, 2])
def test_cache_miss_hit_corrupt_stale_at_each_width(qwen, tmp_path, monkeypatch, bits):
    _, store, ckpt = load_checkpoint(qwen, CPU, torch.float32)
    files, L = list(ckpt.files.values()), len(store)
    calls = _count_packs(monkeypatch)
    first = list(draft_cache.draft_int4(store, files, CPU, cache=tmp_path, bits=bits))
    assert calls == [bits] * 2 * L  # miss: every layer quantised at this width
    assert all(q.bits == bits for layer in first for q in layer)
    entry = tmp_path / draft_cache.cache_key(files, bits)
    assert sorted(p.name for p in entry.iterdir()) == [f"layer-{i}.safetensors" for i in range(L)] + ["source.json"]

    calls.clear()
    assert _same(list(draft_cache.draft_int4(store, files, CPU, cache=tmp_path, bits=bits)), first)
    assert calls == []  # hit

    f = entry / "layer-1.safetensors"  # corrupt: one flipped byte
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0xFF
    f.write_bytes(bytes(raw))
    calls.clear()
    assert _same(list(draft_cache.draft_int4(store, files, CPU, cache=tmp_path, bits=bits)), first)
    assert calls == [bits, bits]  # that layer alone, rebuilt

    # another width is another entry, never this one's files
    calls.clear()
    four = list(draft_cache.draft_int4(store, files, CPU, cache=tmp_path, bits=4))
    assert calls == [4] * 2 * L and all(q.bits == 4 for layer in four for q in layer)
    assert len(list(tmp_path.iterdir())) == 2

    # stale: a file of another width copied under this key (its own key stamped inside) is not trusted
    (entry / "layer-0.safetensors").write_bytes((tmp_path / draft_cache.cache_key(files, 4) / "layer-0.safetensors")
                                                .read_bytes())
    calls.clear()
    list(draft_cache.draft_int4(store, files, CPU, cache=tmp_path, bits=bits))
    assert calls == [bits, bits]


def test_a_hit_reads_no_layer_of_the_store(qwen, tmp_path):
    """draft_int4 indexed each layer of the store before it looked in the cache: a compressed load's
    StoredExperts then read every expert from the checkpoint on a full hit (1.2 GB for a 1.2 GB model)."""
    from specter.loader import StoredExperts

    _, store, ckpt = load_checkpoint(qwen, CPU, torch.float32)
    files = list(ckpt.files.values())
    first = list(draft_cache.draft_int4(store, files, CPU, cache=tmp_path))
    read = []

    class Counted(StoredExperts):
        def __getitem__(self, i):
            read.append(i)
            return super().__getitem__(i)

    stored = Counted(ckpt)
    assert _same(list(draft_cache.draft_int4(stored, files, CPU, cache=tmp_path)), first) and read == []
    (tmp_path / draft_cache.cache_key(files, 4) / "layer-1.safetensors").unlink()
    assert _same(list(draft_cache.draft_int4(stored, files, CPU, cache=tmp_path)), first) and read == [1]


def test_a_cache_write_that_fails_leaves_no_file_and_warns_once(tmp_path, monkeypatch):
    """On a read-only mount the temporary file's unlink raises EROFS (not the ENOENT missing_ok skips):
    the load crashed with a traceback. Ctrl-C mid-write left the temporary file behind."""
    import errno
    import pathlib

    from specter.errors import SpecterWarning

    def read_only(self, missing_ok=False):
        raise OSError(errno.EROFS, "Read-only file system")

    def refuse(*_):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(draft_cache, "_save", refuse)
    monkeypatch.setattr(pathlib.Path, "unlink", read_only)
    (tmp_path / "entry").mkdir()
    with pytest.warns(SpecterWarning, match="could not write the cache file"):
        draft_cache.write_layer_file(tmp_path / "entry" / "layer-0.safetensors", "k", 0, {"t": torch.zeros(2)})
    monkeypatch.undo()

    def interrupted(tensors, path, meta):
        path.write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(draft_cache, "_save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        draft_cache.write_layer_file(tmp_path / "layer-0.safetensors", "k", 0, {"t": torch.zeros(2)})
    assert list(tmp_path.iterdir()) == [tmp_path / "entry"]


def test_a_file_whose_width_disagrees_is_rebuilt(qwen, tmp_path, monkeypatch):
    """The width in a layer file's metadata is checked, not only the key: a file stamped with this
    key and layer but another width (written by a faulty or older writer) is rebuilt."""
    _, store, ckpt = load_checkpoint(qwen, CPU, torch.float32)
    files = list(ckpt.files.values())
    list(draft_cache.draft_int4(store, files, CPU, cache=tmp_path, bits=2))
    key = draft_cache.cache_key(files, 2)
    q = draft_cache._read(tmp_path / key / "layer-0.safetensors", key, 0, 2)
    assert q is not None and q[0].bits == 2
    draft_cache.write_layer_file(tmp_path / key / "layer-0.safetensors", key, 0, draft_cache._tensors(q),
                                 {"bits": "4"})
    assert draft_cache._read(tmp_path / key / "layer-0.safetensors", key, 0, 2) is None
    calls = _count_packs(monkeypatch)
    list(draft_cache.draft_int4(store, files, CPU, cache=tmp_path, bits=2))
    assert calls == [2, 2]


def test_entries_of_the_previous_format_are_stale_and_do_not_collide(qwen, tmp_path, monkeypatch):
    """Code of format 2 (before the width) wrote its 4-bit entries under other keys: this code never
    reads them (quantises afresh) and never writes into them."""
    _, store, ckpt = load_checkpoint(qwen, CPU, torch.float32)
    files = list(ckpt.files.values())
    assert draft_cache.FORMAT == 3
    with monkeypatch.context() as m:
        m.setattr(draft_cache, "FORMAT", 2)
        old_key = draft_cache.cache_key(files, 4)
        list(draft_cache.draft_int4(store, files, CPU, cache=tmp_path, bits=4))
    (tmp_path / old_key / "source.json").unlink()  # (format 2's code recorded no source: such entries are kept)
    old = {p.name: p.read_bytes() for p in (tmp_path / old_key).iterdir()}
    assert draft_cache.cache_key(files, 4) != old_key
    calls = _count_packs(monkeypatch)
    list(draft_cache.draft_int4(store, files, CPU, cache=tmp_path, bits=4))
    assert len(calls) == 2 * len(store)
    assert {p.name: p.read_bytes() for p in (tmp_path / old_key).iterdir()} == old


def test_the_4bit_draft_is_todays_bit_for_bit(qwen, tmp_path):
    """The default width packs exactly as pack_int4 (quanto's qint4) did."""
    from specter.triton_ops import pack_int4

    _, store, ckpt = load_checkpoint(qwen, CPU, torch.float32)
    got = list(draft_cache.draft_int4(store, list(ckpt.files.values()), CPU, cache="off"))
    want = [(pack_int4(ew.w13, 128, dtype=torch.float32), pack_int4(ew.w2, 128, dtype=torch.float32)) for ew in store]
    assert _same(got, want)


def test_bad_width_is_a_clear_error(qwen):
    with pytest.raises(ConfigError, match="draft_bits must be 4, 3 or 2"):
        specter.load(qwen, device="cpu", policy="specter", residency=0.5, draft_bits=8)
    with pytest.raises(ConfigError, match="one of 4, 3, 2"):
        next(draft_cache.draft_int4([], [], CPU, cache="off", bits=1))


# ------------------------------------------------------------------------------- losslessness
PROMPTS = [[5, 6, 7, 8], [17, 3, 99, 42, 8, 1]]


def _greedy(engine, prompts, n):
    try:
        return [engine.generate(p, max_new_tokens=n, temperature=0.0) for p in prompts]
    finally:
        engine.close()


@pytest.mark.parametrize("bits", [3, 2])
def test_low_bit_drafts_are_lossless_on_a_tiny_checkpoint(qwen, fast_link, bits):
    want = [o.token_ids for o in _greedy(specter.load(qwen, device="cpu", policy="resident"), PROMPTS, 24)]
    for policy in ("spec-lru", "specter"):
        engine = specter.load(qwen, device="cpu", policy=policy, residency=0.25, k_max=6, draft_bits=bits)
        assert engine.decoder.draft.q13 or engine.decoder.draft.layers
        outs = _greedy(engine, PROMPTS, 24)
        assert [o.token_ids for o in outs] == want, (policy, bits)
        assert sum(o.stats["drafted_tokens"] for o in outs) > 0


def test_low_bit_drafts_are_lossless_on_the_bundled_model(fast_link):
    path = specter.default_model_path()
    if not (path / "model.safetensors").exists():
        pytest.skip("the bundled default model is not present")
    prompts = ["def fibonacci(n):", "for i, line in enumerate(lines):"]
    want = [o.token_ids for o in _greedy(specter.load(path, device="cpu", policy="resident"), prompts, 24)]
    for bits in (3, 2):
        for policy in ("spec-lru", "specter"):
            outs = _greedy(specter.load(path, device="cpu", policy=policy, residency=0.25, draft_bits=bits),
                           prompts, 24)
            assert [o.token_ids for o in outs] == want, (policy, bits)
            assert sum(o.stats["drafted_tokens"] for o in outs) > 0


def test_the_draft_really_has_the_width_asked_for(qwen, fast_link):
    """Not the 4-bit draft under another name: the engine's draft experts dequantize to values on a
    grid of 2^bits levels per group, and differ from the 4-bit draft's."""
    drafts = {}
    for bits in (4, 2):
        engine = specter.load(qwen, device="cpu", policy="specter", residency=0.5, draft_bits=bits)
        try:
            d = engine.decoder.draft
            w = d.q13[0].dequantize() if d.packed else d.layers[0].w13
            drafts[bits] = w
            levels = max(len(torch.unique(row[:32])) for row in w.reshape(-1, w.shape[-1])[:64])
            assert levels <= 2 ** bits, (bits, levels)
        finally:
            engine.close()
    assert not torch.equal(drafts[4], drafts[2])


def test_draft_bits_flag_reaches_the_engine(qwen, tmp_path, fast_link, capsys):
    from specter.cli import main

    argv = ["generate", "--model", str(qwen), "--device", "cpu", "--residency", "0.25", "--max-new-tokens", "2",
            "--json", "--draft-cache", str(tmp_path / "dc"), "--prompt-ids", "1,2,3", "--draft-bits", "3"]
    assert main(argv) == 0
    spec_ = load_checkpoint(qwen, CPU, torch.float32)[2]
    entry = tmp_path / "dc" / draft_cache.cache_key(list(spec_.files.values()), 3)
    assert len(list(entry.glob("layer-*.safetensors"))) == 3
    with pytest.raises(SystemExit):
        main(argv[:-1] + ["5"])
    assert main(["generate", "--model", str(qwen), "--device", "cpu", "--policy", "on-demand", "--residency", "0.5",
                 "--max-new-tokens", "1", "--prompt-ids", "1,2", "--draft-bits", "2"]) != 0
    assert "--draft-bits" in capsys.readouterr().err


def test_bench_reports_the_draft_width(qwen, tmp_path, fast_link, capsys):
    import json

    from specter.cli import main

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[5, 6, 7, 8]]))
    argv = ["bench", "--model", str(qwen), "--device", "cpu", "--policies", "resident,spec-lru,specter",
            "--residency", "0.5", "--prompts", str(prompts), "--max-new-tokens", "8", "--draft-bits", "2"]
    assert main(argv + ["--json"]) == 0
    pols = json.loads(capsys.readouterr().out)["policies"]
    assert "draft_bits" not in pols["resident"]
    assert pols["spec-lru"]["draft_bits"] == pols["specter"]["draft_bits"] == 2
    assert all(pols[p]["lossless_vs_resident"] for p in pols)
    assert main(argv) == 0
    assert "draft INT2" in capsys.readouterr().out.splitlines()[0]


def test_a_width_the_shapes_cannot_take_is_refused_before_any_work(tiny, fast_link, capsys):
    """The tiny mixtral's experts are 48 wide: 3 bits (words of 32 codes) cannot pack them, 2 can. plan
    refuses that width as the load does, and ranks only the widths that pack."""
    from specter.cli import main

    path, _ = tiny("mixtral", eos_token_id=None)
    three = r"3-bit draft needs .* divisible by 32.*64 and 48.*draft_bits \(--draft-bits\) 4 or 2"
    with pytest.raises(ConfigError, match=three):
        specter.load(path, device="cpu", policy="specter", residency=0.5, draft_bits=3)
    engine = specter.load(path, device="cpu", policy="specter", residency=0.5, draft_bits=2)
    engine.close()
    assert main(["plan", "--model", str(path), "--draft-bits", "3", "--expert-memory", "100KiB"]) == 2
    assert re.search(three, capsys.readouterr().err)
    assert main(["plan", "--model", str(path), "--device", "cpu", "--device-memory", "1MiB", "--json"]) == 0
    ways = json.loads(capsys.readouterr().out)["options"]
    assert {o["draft_bits"] for o in ways if o["draft_bits"]} == {4, 2}


def test_a_model_no_width_packs_says_to_run_without_a_draft(tiny, tmp_path):
    """An expert intermediate size of 20 packs at no width: the refusal named "--draft-bits ()"."""
    from specter.offload.plan import fit, search
    from specter.speculative.draft_cache import check_packable

    with pytest.raises(ConfigError, match=r"this model's are 64 and 20: use a policy without a draft \(on-demand"):
        check_packable(4, 64, 20)
    path, _ = tiny("mixtral", intermediate_size=20)
    with pytest.raises(ConfigError, match="no draft width packs them"):
        specter.load(path, device="cpu", policy="specter", residency=0.5)
    ckpt = open_checkpoint(path)
    f = fit(ckpt.spec, ckpt.numel(), torch.float32, "1MiB", policy="specter")
    assert not f.fits and "no draft width packs" in f.suggestions[0] and "--k-max 0 runs specter" in f.suggestions[0]
    assert f.minimum == fit(ckpt.spec, ckpt.numel(), torch.float32, "1MiB", policy="specter", k_max=0).minimum > 0
    ways = search(ckpt.spec, ckpt.numel(), torch.float32, "1MiB")  # a drafting policy only without its draft
    assert all(o.draft_bits is None for o in ways) and any(o.policy == "specter" for o in ways)
    with pytest.raises(ConfigError, match=r"or k_max=0 \(--k-max 0"):
        specter.load(path, device="cpu", policy="specter", residency=0.5)
    engine = specter.load(path, device="cpu", policy="specter", residency=0.5, k_max=0)  # as it says
    engine.close()


def test_a_budget_only_a_narrower_draft_fits_says_which(fast_link):
    """The bundled model in 24 MiB of device_memory: the default INT4 draft leaves no top-k slots, where
    `specter plan` picks INT3. The load's refusal did not say a narrower draft runs."""
    from specter.loader import open_checkpoint
    from specter.offload.plan import fit

    ckpt = open_checkpoint(specter.default_model_path())
    assert fit(ckpt.spec, ckpt.numel(), torch.float32, "24MiB", policy="specter", device="cpu").draft_bits == 3
    with pytest.raises(specter.BudgetError, match=r"top-2 .*; or a narrower draft: draft_bits \(--draft-bits\) 3 or 2"):
        specter.load(None, device="cpu", policy="specter", device_memory="24MiB")
    with pytest.raises(specter.BudgetError) as err:  # nothing narrower fits: the refusal as it was
        specter.load(None, device="cpu", policy="specter", device_memory="20MiB")
    assert "narrower draft" not in str(err.value)


def test_a_new_entry_removes_its_shards_earlier_versions_entries(qwen, tmp_path, capsys):
    """Entries of older keys stayed forever: a re-saved or edited checkpoint (or, for the coded store, a
    chmod at every container start) added a new entry beside one that no load reads again, tens of GB
    each for a big model. The entry of the same shards and width is removed; other widths, other
    checkpoints and entries that record no source stay."""
    import os
    import shutil

    from specter import builder
    from specter.offload.coded import cache_entry

    path, cache = tmp_path / "m", tmp_path / "cache"
    shutil.copytree(qwen, path)
    _, store, ckpt = load_checkpoint(path, CPU, torch.float32)
    files = list(ckpt.files.values())
    for bits in (4, 2):
        list(draft_cache.draft_int4(store, files, CPU, cache=cache, bits=bits))
    other = tmp_path / "other"  # another checkpoint (a copy elsewhere) in the same cache
    shutil.copytree(qwen, other)
    theirs = list(open_checkpoint(other).files.values())
    os.utime(theirs[0], ns=(theirs[0].stat().st_atime_ns, theirs[0].stat().st_mtime_ns + 5 * 10**9))  # (copy2: its
    list(draft_cache.draft_int4(store, theirs, CPU, cache=cache))                        # time, so the same key)
    older = cache / "0123"  # an entry of an older Specter, which records no source
    older.mkdir()
    (older / "layer-0.safetensors").write_bytes(b"x")
    before = {bits: cache / draft_cache.cache_key(files, bits) for bits in (4, 2)}
    assert len(list(cache.iterdir())) == 4 and "removed" not in capsys.readouterr().err

    shard = files[0]
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))  # re-saved: a new key
    list(draft_cache.draft_int4(store, files, CPU, cache=cache, bits=4))
    now = cache / draft_cache.cache_key(files, 4)
    assert now != before[4] and now.is_dir() and not before[4].exists()
    assert before[2].is_dir() and older.is_dir() and len(list(cache.iterdir())) == 4
    assert "removed 1 cache entry of an earlier version of this checkpoint" in capsys.readouterr().err

    # a prune cut short (a kill, a file not ours to remove) leaves the entry's source: the next one finishes it
    # (source.json went first, and the rest stayed as an older version's entry, never pruned: a QA pass)
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    real_unlink, cut = Path.unlink, []

    def unlink(self, *a, **kw):  # the first layer file removed, then the process dies
        if self.parent == now and cut:
            raise OSError("killed")
        cut.append(self) if self.parent == now else None
        return real_unlink(self, *a, **kw)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Path, "unlink", unlink)
        list(draft_cache.draft_int4(store, files, CPU, cache=cache, bits=4))
    assert cut and (now / "source.json").is_file() and "removed" not in capsys.readouterr().err
    list(draft_cache.draft_int4(store, files, CPU, cache=cache, bits=4))
    assert not now.exists() and len(list(cache.iterdir())) == 4, list(cache.iterdir())
    assert "removed 1 cache entry" in capsys.readouterr().err
    now = cache / draft_cache.cache_key(files, 4)

    # another install (another quanto: another key, the same shards) or another host sharing the cache: kept,
    # each way (they removed each other's at every load, re-quantising every time)
    real = draft_cache.settings
    with pytest.MonkeyPatch.context() as m:
        m.setattr(draft_cache, "settings", lambda bits=4: {**real(bits), "quanto": "0.0.1"})
        list(draft_cache.draft_int4(store, files, CPU, cache=cache, bits=4))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(draft_cache.socket, "gethostname", lambda: "another-host")
        m.setattr(draft_cache, "fingerprint", lambda files: "its own copy of the shards")
        list(draft_cache.draft_int4(store, files, CPU, cache=cache, bits=4))
    assert len(list(cache.iterdir())) == 6 and now.is_dir()
    list(draft_cache.draft_int4(store, files, CPU, cache=cache, bits=4))
    assert len(list(cache.iterdir())) == 6 and "removed" not in capsys.readouterr().err

    builder.load_shared(path, CPU, draft_cache=str(cache), compress_experts=False)  # (no coded entry)
    first = cache_entry(files, str(cache))
    os.chmod(shard, shard.stat().st_mode ^ 0o040)  # a chmod: the coded key (ctime) changes, the draft's not
    second = cache_entry(files, str(cache))
    assert second != first and second.is_dir() and not first.exists() and now.is_dir()


def test_a_source_record_that_cannot_be_written_leaves_no_file(tmp_path, monkeypatch):
    """A full disk failed the source.json write and left its temporary file (a QA pass): it is removed."""
    def full(*_):
        raise OSError(28, "No space left on device")

    entry = tmp_path / "key"
    entry.mkdir()
    monkeypatch.setattr(draft_cache.os, "replace", full)
    draft_cache.prune_superseded(entry, {"kind": "draft"})
    assert list(entry.iterdir()) == []
