"""The draft's quantised experts (4, 3 or 2 bits), quantised once per checkpoint and width and cached on disk.

    <cache>/<key>/layer-<i>.safetensors    w13.{qweight,scale,shift}, w2.{...}: QuantExperts, fp32 scales

key = sha256 of the quantiser's settings (the format, the code width among them) and the checkpoint's
content fingerprint (every shard's size, modification time and safetensors header, which holds every
tensor's name, dtype, shape and offsets, plus 32 blocks of 64 KiB sampled across its data), so a
re-saved or edited checkpoint gets a new entry: the samples alone miss most edits of a few experts
(a Qwen3-30B-A3B expert is 9 MB; samples of a 4 GB shard lie 130 MB apart), the time does not. A
copy that keeps the times (cp -p, rsync -a) keeps its entries; any other copy is made anew once. An
in-place edit that keeps a shard's size and puts its time back (touch -r) is not seen, as make and
rsync do not see it: delete the entry (or load with --draft-cache off) after such an edit.
Each layer file records the key, its layer, its code width and a CRC32 of every tensor in its
metadata; a file that is missing, unreadable, truncated, for another key, layer or width, or whose
bytes fail the CRC is rebuilt from the host store, never trusted. An entry written by an older
format (another FORMAT) has another key: it is never read, so stale, and quantised afresh. Files are
written to a temporary name and renamed, so a crash never leaves half a file under the real name.

Quantisation runs layer by layer, on the device when there is one: one layer's experts in full
precision exist beside the store at a time, never all of them.

The cache lives in $SPECTER_DRAFT_CACHE, else $XDG_CACHE_HOME/specter/drafts (~/.cache/...);
`specter.load(..., draft_cache=DIR)` and `--draft-cache DIR` override both, and "off" disables it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from specter.triton_ops import Int4Experts, pack_experts, packed_nbytes
from specter.triton_ops.int4 import K_MULTIPLE, check_bits, packable_widths

from ..errors import ConfigError, warn
from ..moe import ExpertWeights
from ..sizes import format_size

FORMAT = 3  # 2: int32 words of eight codes, group-major scales (triton_ops/int4.py); 3: and the width (4, 3, 2)
GROUP_SIZE = 128
_SAMPLES, _BLOCK = 32, 64 << 10


def draft_expert_nbytes(spec, bits: int = 4, scale_bytes: int = 2) -> int:
    """Device bytes of one routed draft expert of `spec` (a ModelSpec) at `bits` (4, 3 or 2): its
    w13 [2I, H] and w2 [H, I] packed as the draft packs them (groups of GROUP_SIZE, shrunk where
    they do not divide a row), with scales and shifts of `scale_bytes` each (2: the compute dtype
    on CUDA, bf16/fp16; the cache on disk and a CPU draft keep fp32, 4)."""
    H, I = spec.hidden, spec.expert_inter
    return (packed_nbytes(2 * I, H, bits, GROUP_SIZE, scale_bytes)
            + packed_nbytes(H, I, bits, GROUP_SIZE, scale_bytes))


def cache_root(override: str | os.PathLike | None = None) -> Path | None:
    """The cache directory: `override`, else $SPECTER_DRAFT_CACHE, else the user cache; None = off. A
    leading ~ is the home directory (an environment set by Docker or systemd does not expand it)."""
    if override is not None and not isinstance(override, (str, os.PathLike)):
        raise ConfigError(f"draft_cache must be a directory (a str or path), 'off' or None, got {override!r}")
    where = override if override is not None else os.environ.get("SPECTER_DRAFT_CACHE")
    if where is None:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base).expanduser() / "specter" / "drafts"
    if str(where).lower() in ("", "off", "none", "0"):
        return None
    return Path(where).expanduser()


def make_entry(cache, name: str, what: str, source: dict | None = None) -> Path | None:
    """<root>/<name>, created; None when caching is off, or when the place (the default or
    $SPECTER_DRAFT_CACHE's) cannot be written: warned, and `what` is made without a cache. A place the
    caller named (`draft_cache=`, --draft-cache) that cannot be written is the caller's to fix: a
    ConfigError. An entry that already exists is used as it is (a read-only cache filled beforehand).
    `source`: what the entry is of (entry_source: its kind, its shards' paths on this host, its settings),
    kept in it as source.json; an entry of another name with the same source is of an earlier version of
    those files: never read again, so removed (prune_superseded)."""
    root = cache_root(cache)
    if root is None:
        return None
    entry = root / name
    try:
        entry.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if cache is not None:
            raise ConfigError(f"draft cache {root} is not writable ({e}); pass another --draft-cache "
                              f"or 'off'") from None
        warn(f"the cache {root} (drafts and coded experts) is not writable ({e}); {what} without a cache "
             f"(set SPECTER_DRAFT_CACHE to a writable directory)")
        return None
    _remove_dead_writes(entry)
    if source is not None:
        prune_superseded(entry, source)
    return entry


def entry_source(kind: str, files, settings: dict) -> dict:
    """A cache entry's source (make_entry): its kind, the real paths of its checkpoint's shards on this
    host, and the settings its bytes depend on (the draft's width, the quantiser's version, the format).
    Another host (a cache on a shared home), or another install (another quanto), has another source:
    its entries are never taken for superseded ones, which each would remove at every load."""
    return {"kind": kind, "shards": sorted(str(Path(f).resolve()) for f in files), "host": socket.gethostname(),
            "settings": settings}


def prune_superseded(entry: Path, source: dict) -> None:
    """Records `source` in `entry` and removes every other entry under its root that records the same
    source: their key was of those shards before they changed (a re-save, an edit, a chmod of the
    coded store's), which no load reads again, and a big model's entry is tens of GB. Entries that
    record no source (of an older version of Specter), or another (another host's, another
    install's, another width's), are left. An entry records the shards that made it: a copy that
    kept their times (cp -p) shares the draft's key, and quantises anew once after the original
    changes. Best effort: a file it cannot write or remove stays, quietly."""
    mark = entry / "source.json"
    tmp = entry / f".source.{os.getpid()}.tmp"
    try:
        if not mark.exists():
            tmp.write_text(json.dumps(source, sort_keys=True))
            os.replace(tmp, mark)
    except OSError:  # (a read-only cache filled beforehand, or a full disk: no half-written file left)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return
    freed, gone = 0, 0
    for other in entry.parent.iterdir():
        try:
            if other == entry or not other.is_dir() or json.loads((other / "source.json").read_text()) != source:
                continue
            size = sum(f.stat().st_size for f in other.iterdir() if f.is_file())
            _remove_entry(other)
            freed, gone = freed + size, gone + 1
        except (OSError, ValueError):  # no source (older), unreadable, or not ours to remove
            continue
    if gone:
        print(f"specter: removed {gone} cache entr{'y' if gone == 1 else 'ies'} of an earlier version of this "
              f"checkpoint ({format_size(freed)}) from {entry.parent}", file=sys.stderr)


def _remove_entry(entry: Path) -> None:
    """rmtree with the entry's source.json last: one cut short (a kill, a file not ours to remove) still
    records its source, so a later prune finishes it; removed first, its layers would stay as an older
    version's entry, which no load reads or prunes."""
    mark = entry / "source.json"
    for f in entry.iterdir():
        if f == mark:
            continue
        if f.is_dir() and not f.is_symlink():
            shutil.rmtree(f)
        else:
            f.unlink()
    mark.unlink(missing_ok=True)
    entry.rmdir()


def _remove_dead_writes(entry: Path, quiet_s: float = 60.0) -> None:
    """Temporary files (write_layer_file's) that a killed load left in `entry`: its process is gone (or
    had this process's pid, and this one is not writing it) and the file has not grown for `quiet_s`
    seconds. Never read, and a layer's worth of disk each."""
    now = time.time()
    for tmp in entry.glob(".*.tmp"):
        try:
            pid = int(tmp.name.rsplit(".", 2)[-2].split("-")[0])
            # this process's pid: its own if it is writing it now, else an earlier process's that had the
            # same pid (a container's pid 1 at every start: alive, so its files stayed forever)
            if now - tmp.stat().st_mtime < quiet_s or (tmp in _WRITING if pid == os.getpid() else _alive(pid)):
                continue
            tmp.unlink()
        except (ValueError, OSError):  # not ours, or gone already, or not ours to remove
            continue


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (another user's: alive)
        return True
    return True


QUANTIZERS = {4: "optimum-quanto MaxOptimizer qint4 float-shift", 2: "optimum-quanto MaxOptimizer qint2 float-shift",
              3: "affine min-max 3-bit float-shift (torch, quanto's scheme)"}


def settings(bits: int = 4) -> dict:
    """What the cached bytes depend on besides the checkpoint. (The version from the package's metadata:
    importing optimum.quanto takes seconds, which a cache hit never needs to spend.)"""
    from importlib.metadata import version

    return {"format": FORMAT, "bits": bits, "quantizer": QUANTIZERS[check_bits(bits)],
            "quanto": version("optimum-quanto"), "group_size": GROUP_SIZE, "scales": "float32"}


def fingerprint(files) -> str:
    """Content fingerprint of safetensors shards (see the module docstring); reads ~2 MiB a shard."""
    h = hashlib.sha256()
    for f in sorted({Path(f) for f in files}):
        st = f.stat()  # (a hub snapshot's symlink: its blob's)
        size = st.st_size
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(f.name.encode() + size.to_bytes(8, "little") + st.st_mtime_ns.to_bytes(16, "little", signed=True)
                     + fh.read(n))
            data = 8 + n
            for i in range(_SAMPLES):
                fh.seek(data + (size - data - _BLOCK) * i // max(_SAMPLES - 1, 1) if size - data > _BLOCK else data)
                h.update(fh.read(_BLOCK))
    return h.hexdigest()


def cache_key(files, bits: int = 4) -> str:
    h = hashlib.sha256(json.dumps(settings(bits), sort_keys=True).encode())
    h.update(fingerprint(files).encode())
    return h.hexdigest()[:32]


def check_packable(bits: int, hidden: int, inter: int) -> None:
    """A ConfigError unless a `bits` draft packs these row lengths, saying what does (or that none does)."""
    if bits in packable_widths(hidden, inter):
        return
    others = packable_widths(hidden, inter)
    what = f"draft_bits (--draft-bits) {' or '.join(map(str, others))}" if others else \
        "a policy without a draft (on-demand, next-layer or host), or k_max=0 (--k-max 0: no draft is made): no " \
        "draft width packs them"
    raise ConfigError(f"a {bits}-bit draft needs the hidden and expert intermediate sizes divisible by "
                      f"{K_MULTIPLE[bits]} (whole int32 words of codes); this model's are {hidden} and {inter}: "
                      f"use {what}")


def draft_int4(store: list[ExpertWeights], files, device: torch.device, *, cache=None,
               progress: bool | None = None, bits: int = 4) -> Iterator[tuple[Int4Experts, Int4Experts]]:
    """Yields (w13, w2) QuantExperts at `bits` per MoE layer (fp32 scales, on the CPU), each read from
    the cache or quantised from `store` (on `device`) and written to it: one layer at a time, so a
    consumer that moves or dequantises each as it comes never holds the whole draft on the host."""
    check_bits(bits)
    # before any work: a width the expert shapes cannot be packed at
    if hasattr(store, "shapes"):  # a StoredExperts (loader.py): its shapes, no layer read
        pairs = [store.shapes]
    else:
        pairs = [(ew.w13.shape, ew.w2.shape) for ew in store[:1]]
    for s13, s2 in pairs:  # the K of w13 and w2: the hidden size, the expert intermediate size
        check_packable(bits, s13[2], s2[2])
    entry = draft_entry(files, cache, bits)
    nbytes = getattr(store, "nbytes", None) or sum(ew.n_experts * ew.expert_nbytes() for ew in store)  # unread
    if progress is None:
        progress = nbytes > (256 << 20)
    bar = tqdm(total=len(store), desc=f"draft (INT{bits})", unit="layer", disable=not progress)
    for i in range(len(store)):
        path = entry / f"layer-{i}.safetensors" if entry is not None else None
        layer = _read(path, entry.name, i, bits) if path is not None else None
        if layer is None:  # a layer of the store read here (a StoredExperts: from the checkpoint; a first coded
            # load quantised the layers it read into the cache as it coded them: draft_along)
            bar.set_description("draft: quantising")
            ew = store[i]
            layer = quantise_layer(ew, device, bits)
            del ew  # (not held while the consumer takes the layer)
            if path is not None:
                _write(path, entry.name, i, layer)
        bar.update()
        yield layer
    bar.close()


def draft_entry(files, cache=None, bits: int = 4) -> Path | None:
    """The draft cache's entry for these shards at `bits` (make_entry: made if missing, the entries of the
    shards' earlier versions pruned), or None when the cache is off or its default place not writable."""
    return make_entry(cache, cache_key(files, bits), "quantising", source=entry_source("draft", files, settings(bits)))


def quantise_layer(ew: ExpertWeights, device: torch.device, bits: int = 4) -> tuple[Int4Experts, Int4Experts]:
    """One MoE layer's (w13, w2) draft experts at `bits` (fp32 scales, on the CPU), quantised on `device`."""
    return (pack_experts(ew.w13.to(device), bits, GROUP_SIZE, dtype=torch.float32).to("cpu"),
            pack_experts(ew.w2.to(device), bits, GROUP_SIZE, dtype=torch.float32).to("cpu"))


def draft_along(files, device: torch.device, cache=None, bits: int = 4):
    """A function (i, raw layer) that quantises MoE layer i's draft from a raw layer read for another reason
    and writes it to the draft cache (coded.coded_store's `also`: the first load of a coded store reads each
    expert to code it), so draft_int4 then finds it there instead of reading the experts from the checkpoint
    a second time (tens of GB on a big model); None when the cache is off (the draft then reads them)."""
    entry = draft_entry(files, cache, bits)
    if entry is None:
        return None

    def quantise(i: int, ew: ExpertWeights) -> None:
        path = entry / f"layer-{i}.safetensors"
        if not path.is_file():  # (a damaged one is rebuilt by draft_int4, as on any load)
            _write(path, entry.name, i, quantise_layer(ew, device, bits))
    return quantise


def cached_draft(files, n_layers: int, cache=None, bits: int = 4) -> list[tuple[Int4Experts, Int4Experts]] | None:
    """Every one of the `n_layers` MoE layers' draft experts from the cache, as draft_int4 would yield
    them on a hit, or None when the cache is off or any layer is missing, corrupt or stale (then
    draft_int4 rebuilds what is not there). Creates and writes nothing."""
    root = cache_root(cache)
    if root is None:
        return None
    entry = root / cache_key(files, bits)
    layers = []
    for i in range(n_layers):
        layer = _read(entry / f"layer-{i}.safetensors", entry.name, i, bits)
        if layer is None:
            return None
        layers.append(layer)
    return layers


def _tensors(layer: tuple[Int4Experts, Int4Experts]) -> dict[str, torch.Tensor]:
    return {f"{m}.{k}": t.contiguous() for m, q in zip(("w13", "w2"), layer) for k, t in q.tensors().items()}


def _crc(t: torch.Tensor) -> str:
    return f"{zlib.crc32(t.view(-1).view(torch.uint8).numpy()):08x}"


_ST_NAMES = {torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64", torch.float32: "F32", torch.bfloat16: "BF16",
             torch.float16: "F16"}


def _write(path: Path, key: str, layer: int, q: tuple[Int4Experts, Int4Experts]) -> None:
    write_layer_file(path, key, layer, _tensors(q), {"bits": str(q[0].bits)})


def write_layer_file(path: Path, key: str, layer: int, tensors: dict[str, torch.Tensor],
                     meta: dict[str, str] | None = None) -> None:
    """A cached layer's tensors, stamped with the cache key, the layer and every tensor's CRC32 (plus
    `meta`), written to a temporary name and renamed into place: a reader never sees half a file.
    A full or read-only disk costs the cache, not the load."""
    meta = {**(meta or {}), "key": key, "layer": str(layer),
            "crc32": json.dumps({n: _crc(t) for n, t in tensors.items()})}
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")  # (threads of one process too)
    _WRITING.add(tmp)
    try:
        _save(tensors, tmp, meta)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # a read-only mount: EROFS, not the ENOENT missing_ok skips
            pass
        if not isinstance(e, OSError):
            raise  # (Ctrl-C: no temporary file left behind either)
        if path.parent not in _UNWRITABLE:  # once a directory: every later layer would say the same
            _UNWRITABLE.add(path.parent)
            warn(f"could not write the cache file {path} ({e.strerror or e}): this load goes on without "
                 f"it, and every later load rebuilds what is missing; free space in {path.parent} or point "
                 f"the cache elsewhere (--draft-cache, $SPECTER_DRAFT_CACHE)")
    finally:
        _WRITING.discard(tmp)


_UNWRITABLE: set[Path] = set()  # cache entries a write failed in (warned once)
_WRITING: set[Path] = set()  # temporary files this process is writing now (_remove_dead_writes spares them)


def _save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """A safetensors file written from the tensors' own memory (safetensors.torch.save_file first
    copies every tensor into a bytes object: a second copy of the layer at the load's peak)."""
    header, off = {"__metadata__": metadata}, 0
    for name, t in tensors.items():
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)  # data 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for t in tensors.values():
            f.write(memoryview(t.view(-1).view(torch.uint8).numpy()))


def _read(path: Path, key: str, layer: int, bits: int = 4) -> tuple[Int4Experts, Int4Experts] | None:
    """The cached layer, or None when it is missing, corrupt or stale (and then it is rebuilt)."""
    read = read_layer_file(path, key, layer)
    if read is None:
        return None
    tensors, meta = read
    if meta.get("bits") != str(bits):
        return None
    try:
        return tuple(Int4Experts(**{k: tensors[f"{m}.{k}"] for k in ("qweight", "scale", "shift")}, bits=bits)
                     for m in ("w13", "w2"))
    except Exception:  # wrong tensors: rebuild
        return None


def read_layer_file(path: Path, key: str, layer: int) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """(tensors, metadata) of a file `write_layer_file` wrote for this key and layer, or None when it
    is missing, unreadable, truncated, for another key or layer, or a tensor fails its CRC."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("key") != key or meta.get("layer") != str(layer):
                return None
            crcs = json.loads(meta["crc32"])
            tensors = {n: f.get_tensor(n) for n in crcs}
        if any(_crc(t) != crcs[n] for n, t in tensors.items()):
            return None
        return tensors, meta
    except Exception:  # unreadable, truncated, malformed metadata
        return None
