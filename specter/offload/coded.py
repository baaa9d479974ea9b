"""The host expert store, losslessly coded (`specter.load(..., compress_experts=True)`, issue 24).

    store   [host]  CodedLayer per MoE layer: w13, w2 CodedTensor, each a LosslessExperts
                    (triton_ops/lossless.py: sign and mantissa raw, exponents in a fixed-width code)
    copy            link.copy([slot_w13, slot_w2], [store[l].w13[e], store[l].w2[e]]): the sources are
                    CodedExpert, the link moves their coded bytes and decodes them into the slot
                    before the copy completes (before any reader can see the slot)

On CUDA a layer's two coded tensors are laid out together in one page-aligned arena locked in place
(lossless.layer_major: expert e's record is its rows of the four fixed tensors of w13, then of w2,
then its two escape runs, one contiguous run of bytes), so a copy of an expert into bf16 slots is
one host-to-device copy and a share of one decode launch for a layer call's experts
(CodedExpert.decode_all_on), not five copies a tensor: each copy and each launch costs the issuing
thread tens of microseconds on a GPU's host, more than a small expert takes to cross the link.
(Records are padded to the layer's longest, 0.2-0.3% of the arena on the bundled model; a layer where
one expert escapes far more than the rest keeps its runs after all rows: a copy is then three.)

What reads the store, and what it gets (the decision per reader):
- the offload manager's copies: coded bytes over the link, decoded into the slot when they land
  (EmulatedLink: the torch decode on its worker thread, charged coded bytes at the link's bandwidth
  plus the decode at the profile's device memory bandwidth, scaled like the link; CudaLink: the coded
  bytes into device memory on the copy stream (lossless.stage_pair), then the Triton decode kernel
  into both slots on that stream (lossless.decode_staged_pair; a slot of another dtype: each tensor
  alone, lossless.stage and decode_staged, then converted), before the event readers wait on).
- the INT4 draft: the checkpoint's own experts (loader.StoredExperts), each layer read from the files
  when quantisation reads it (a draft cache hit reads nothing), one layer at a time; so is
  `Loaded.resident_experts` (resident, oracle). Reading is the same bits, and several times faster
  than decoding on the CPU. (A pipeline stage decodes: `DecodedStore`.) A first load that codes a layer
  quantises its draft from the same read into the draft cache (coded_store's `also`), so the experts
  are not read twice; the raw copy below, where kept, is read first and coded from.
- the host lane (policy host; specter on CPU, or on CUDA with host_threads): a raw copy of the
  whole store, read from the checkpoint once and kept (builder.Loaded.host_rows). The lane reads
  experts in place at memory speed; decoding each one per job on the CPU would cost it more than its
  GEMV, and such policies move few bytes over the link anyway. The price: with a host lane the host
  holds the raw store beside the coded one (the PCIe saving stays, the host memory saving is lost;
  `specter plan` counts both).
- the CPU aliased pool (plan.alias_pool, big models on CPU): not used with compress_experts:
  compute cannot read coded rows, so the pool is a real one that copies decode into.
- the compressed device tier (offload/coded_tier.py; CUDA: opt-in): part of the expert budget holds
  coded experts on the device; a miss among them is decoded into its slot instead of copied over PCIe.
  On CUDA it keeps the buffer a pair copy staged (decode_all_on leaves it on the source: `staged`).
- the emulated link's decode (CPU): a coded copy writes the slot from raw rows (`emulate_from`: the same
  bits, tests/test_lossless.py) instead of running the torch decode on the link's thread: the host
  lane's rows, a decoded copy when the raw store is at most ROWS_MAX_BYTES, else the expert read from
  the checkpoint as the copy runs (coded_tier.emulation_rows, loader.ExpertReads; a file written in place
  since the load is noticed, and its experts decoded instead). The decode is charged
  from the profile either way; this keeps this CPU's own decode (tens of times slower than a GPU's, and
  on a core compute shares) out of the emulated device's time, as the tier's hits do. Where the
  checkpoint cannot be read as stored (an expert tensor in another dtype) the link decodes.

Encoding happens once per checkpoint and is cached on disk beside the INT4 draft (its machinery:
draft_cache's root, content fingerprint, safetensors writer and CRCs):

    <cache>/coded-<key>/layer-<i>.safetensors   w13.{signman,planes,table,esc_off,escapes,esc_start}, w2.{...}

key = sha256 of the format's settings, the checkpoint's fingerprint and each shard's inode change time
(cache_key: a stale coded store would change the output, where a stale draft costs only speed, so an
in-place edit that puts a shard's modification time back is a miss here too). A file that is missing,
unreadable, for another key or layer, of the wrong shape or failing its CRC is not trusted. When
every layer hits, the loader reads no expert at all; otherwise each layer that missed is read from
the checkpoint, coded (and written) and dropped before the next is read, so a first load holds the
coded store and one raw layer, not the raw store beside the coded one. `draft_cache` (--draft-cache,
$SPECTER_DRAFT_CACHE) places or disables both caches.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from specter.triton_ops import lossless
from specter.triton_ops.lossless import LosslessExperts, encode

from ..errors import ConfigError, warn
from ..loader import CheckpointChanged
from ..moe import ExpertWeights
from .store import host_limits, is_locked, page_aligned, register


class CodedExpert:
    """One expert of a CodedTensor: the source of one link copy. `nbytes`: the coded bytes it moves;
    `raw_nbytes`: the bf16 bytes it decodes to."""

    dtype = torch.bfloat16
    is_cuda = False
    staged = None  # CUDA, a pair's first tensor once copied: its staged bytes on the device (decode_all_on)

    def __init__(self, packed: LosslessExperts, e: int, rows: torch.Tensor | None, nbytes: int,
                 pair: lossless.CodedPair | None = None):
        self.packed, self.e, self.rows, self.nbytes, self.pair = packed, e, rows, nbytes, pair
        self.shape = torch.Size(packed.shape[1:])
        self.raw_nbytes = self.shape.numel() * 2

    def decode_into(self, out: torch.Tensor) -> torch.Tensor:
        """The expert's bf16 bits into `out` (any dtype: converted exactly from bf16 when it is wider),
        on the coded tensors' device; from the decoded rows when the store keeps them (`emulate_from`)."""
        if self.rows is not None:
            from .link import _copy_serial  # chunked, on the calling (link) thread only

            try:
                _copy_serial(out, self.rows[self.e])
                return out
            except CheckpointChanged:  # ExpertReads of a file changed since the load (warned): decode instead
                pass
        return self._bf16_into(out, lambda slot: self.packed.decode_into(slot, self.e))

    def decode_on(self, out: torch.Tensor) -> torch.Tensor:
        """CUDA, on the current (copy) stream: the expert's row and escape run into device memory (one
        staging buffer from the caching allocator, allocated on this stream: reused only after it), then
        the decode kernel into `out` (any dtype: converted exactly from bf16 when it is wider)."""
        if self.packed.by_expert is None:
            raise RuntimeError("a coded copy to CUDA needs the store laid out expert-major "
                               "(coded_store / encode_store with cuda=True)")
        staged = lossless.stage(self.packed, self.e, out.device)
        return self._bf16_into(out, lambda slot: lossless.decode_staged(self.packed, staged, slot))

    @staticmethod
    def decode_all_on(dsts: list[torch.Tensor], srcs: list["CodedExpert"]) -> None:
        """CUDA, on the current (copy) stream: each coded source into its destination, as decode_on does,
        except that an expert's two tensors listed side by side (w13 then w2, as the manager lists a
        copy's sources) from a layer laid out together (for_cuda_layer) into bf16 slots cross as one
        copy (lossless.stage_pair: its record), and the experts of one layer then decode in one
        launch (lossless.decode_staged_pairs; in place: a launch each); the first source then holds the
        staged bytes (`staged`: what the compressed tier keeps, offload/coded_tier.py)."""
        jobs: list = []  # (source, staged, out_a, out_b): experts of jobs[0]'s pair staged, not yet decoded
        i = 0
        while i < len(srcs):
            s = srcs[i]
            if i + 1 < len(srcs) and s.pairs_with(srcs[i + 1]) and all(
                    d.dtype == torch.bfloat16 and d.is_contiguous() for d in dsts[i:i + 2]):
                if s.pair.in_place:
                    s.pair.decode_into(s.e, dsts[i], dsts[i + 1])
                else:
                    if jobs and jobs[0][0].pair is not s.pair:
                        CodedExpert._decode_staged(jobs)
                    s.staged = lossless.stage_pair(s.pair, s.e, dsts[i].device)
                    jobs.append((s, s.staged, dsts[i], dsts[i + 1]))
                i += 2
            else:
                s.decode_on(dsts[i])
                i += 1
        if jobs:
            CodedExpert._decode_staged(jobs)

    @staticmethod
    def _decode_staged(jobs: list) -> None:
        """One launch for staged experts of one pair: jobs as decode_all_on gathers them."""
        lossless.decode_staged_pairs(jobs[0][0].pair, [(s.e, staged, a, b) for s, staged, a, b in jobs])
        jobs.clear()

    def pairs_with(self, other) -> bool:
        """`other` is this expert's second tensor (w2, this one w13) in one CodedPair."""
        return (self.pair is not None and getattr(other, "pair", None) is self.pair and other.e == self.e
                and self.packed is self.pair.a and other.packed is self.pair.b)

    def _bf16_into(self, out: torch.Tensor, decode) -> torch.Tensor:
        """decode(slot) writes the expert's bf16 bits into a contiguous bf16 slot: `out` itself, or a
        temporary converted into `out` (exact: every bf16 value is one of a wider float type's)."""
        if out.dtype == torch.bfloat16 and out.is_contiguous():
            return decode(out)
        return out.copy_(decode(torch.empty(self.shape, dtype=torch.bfloat16, device=out.device)))

    def __repr__(self) -> str:
        return f"CodedExpert({self.e}, {tuple(self.shape)}, {self.nbytes} B coded)"


class CodedTensor:
    """A coded [E, N, K] tensor indexed like the raw one: `t[e]` is expert e's CodedExpert."""

    dtype = torch.bfloat16

    def __init__(self, packed: LosslessExperts, pair: lossless.CodedPair | None = None):
        self.packed, self.pair = packed, pair  # pair: its layer's two tensors laid out together (for_cuda_layer)
        self.shape = torch.Size(packed.shape)
        self.rows = None  # emulate_from: its raw rows, rows[e] expert e's (a bf16 [E, N, K] or loader.ExpertReads)
        self._nbytes = [packed.expert_nbytes(e) for e in range(self.shape[0])]  # each copy's, asked per copy

    def __getitem__(self, e) -> CodedExpert:
        e = self.packed.expert(int(e))  # (a negative index from the end)
        return CodedExpert(self.packed, e, self.rows, self._nbytes[e], self.pair)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    @property
    def raw_nbytes(self) -> int:
        return self.packed.raw_nbytes

    def decode(self) -> torch.Tensor:
        return self.packed.decode()


class CodedLayer:
    """One MoE layer's routed experts, coded: what ExpertWeights is for a raw store."""

    def __init__(self, w13: LosslessExperts, w2: LosslessExperts, pair: lossless.CodedPair | None = None):
        self.w13, self.w2 = CodedTensor(w13, pair), CodedTensor(w2, pair)

    @property
    def n_experts(self) -> int:
        return self.w13.shape[0]

    def expert_nbytes(self) -> int:
        """The mean coded bytes a copy of one of this layer's experts moves (each copy counts its own)."""
        E = self.n_experts
        return round(sum(self.w13[e].nbytes + self.w2[e].nbytes for e in range(E)) / E)

    def raw_expert_nbytes(self) -> int:
        return (self.w13.shape[1:].numel() + self.w2.shape[1:].numel()) * 2

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes

    def decoded(self) -> ExpertWeights:
        return ExpertWeights(self.w13.decode(), self.w2.decode())


class DecodedLayer:
    """A CodedLayer read as ExpertWeights: each access of w13 / w2 decodes it anew (nothing kept), so
    a reader that walks the layers holds one layer's bf16 weights at a time."""

    def __init__(self, coded: CodedLayer):
        self.coded = coded

    @property
    def w13(self) -> torch.Tensor:
        return self.coded.w13.decode()

    @property
    def w2(self) -> torch.Tensor:
        return self.coded.w2.decode()

    @property
    def n_experts(self) -> int:
        return self.coded.n_experts

    def expert_nbytes(self) -> int:
        return self.coded.raw_expert_nbytes()


class DecodedStore(list):
    """The coded store as the raw store's readers see it (a list of DecodedLayer)."""

    def __init__(self, coded: list[CodedLayer]):
        super().__init__(DecodedLayer(c) for c in coded)


def emulate_from(store: list[CodedLayer], rows: list[ExpertWeights] | None) -> None:
    """CPU: coded copies write their slot from `rows`, the store's raw experts (each layer's w13 and w2:
    bf16 tensors or loader.ExpertReads, equal to its decode) instead of decoding on the link's thread;
    None: they decode (see the module doc)."""
    for i, layer in enumerate(store):
        layer.w13.rows, layer.w2.rows = (None, None) if rows is None else (rows[i].w13, rows[i].w2)


def is_coded(store) -> bool:
    return bool(store) and isinstance(store[0], CodedLayer)


def coded_ratio(store: list[CodedLayer]) -> float:
    """A coded store's bytes over its bf16 bytes (what coded_store_bytes predicts from the weights)."""
    return store_nbytes(store) / sum(layer.w13.raw_nbytes + layer.w2.raw_nbytes for layer in store)


def encode_store(store: list[ExpertWeights], *, cuda: bool = False, pin: bool = False) -> list[CodedLayer]:
    """The raw store's layers coded, dropping each raw layer from `store` as it is coded (the list is
    emptied: the arena is freed once its last view goes). `cuda`: laid out for CUDA copies (expert
    major); `pin` (implies it): and page-locked."""
    if not store:
        return []
    if store[0].w13.dtype != torch.bfloat16:
        raise ConfigError(f"compress_experts codes bf16 checkpoints; this one stores {store[0].w13.dtype} "
                          f"(fp16 and fp32 are not supported): load it without compress_experts")
    coded, refused = [], []
    while store:
        ew = store.pop(0)
        w13, w2 = encode(ew.w13), encode(ew.w2)
        coded.append(for_cuda_layer(w13, w2, pin=pin, refused=refused) if cuda or pin else CodedLayer(w13, w2))
        del ew
    _warn_refused(refused)
    return coded


def for_cuda_layer(w13: LosslessExperts, w2: LosslessExperts, *, pin: bool, refused: list[str]) -> CodedLayer:
    """A layer's two coded tensors laid out together for copies (lossless.layer_major: expert e's rows of
    both in one run, so a copy of it is one copy of the rows and one launch) in one page-aligned arena,
    locked in place when `pin` (store.register: exactly its bytes, where pin_memory() would round each
    tensor up to a power of two: up to 2x the host memory the coding saves). A refusal is appended to
    `refused` and the arena stays pageable."""
    arena = page_aligned(lossless.layer_major_nbytes(w13, w2), torch.uint8)
    pair = lossless.layer_major(w13, w2, arena)
    for part in (*pair.a.tensors()[:-1], pair.a.by_expert, *pair.b.tensors()[:-1], pair.b.by_expert, pair.rows,
                 pair.words):
        part._arena = arena  # a dtype view does not keep its base alive: the lock goes with the arena
    if pin and not refused and (error := register(arena)) is not None:
        refused.append(error)
    return CodedLayer(pair.a, pair.b, pair)


def ready_on_cuda(store: list[CodedLayer], device) -> None:
    """A CUDA store, once coded and laid out: decoding in place where SPECTER_CODED_IN_PLACE=1 (an
    experiment: decode_in_place), and every decode kernel compiled now (warm_decode): the pair kernel
    (a copy of one expert) and the batch kernel (a coalesced copy's experts, a tier's hits)."""
    if os.environ.get("SPECTER_CODED_IN_PLACE") == "1":
        decode_in_place(store, device)
    warm_decode(store, device)
    warm_decode(store, device, batch=True)


def warm_decode(store: list[CodedLayer], device, *, batch: bool = False) -> int:
    """Runs the pair decode once for each kind of layer of a CUDA store (w13's and w2's shapes and code
    widths: one kernel specialization each), so Triton compiles them at load, not on the copy thread
    in the middle of the first generation; `batch`: the batch kernel instead (two experts), what a
    coalesced copy's experts and a CUDA tier's hits run. -> the kinds run."""
    kinds = {}
    for layer in store:
        pair = layer.w13.pair
        if pair is not None:
            kinds.setdefault((pair.a.shape[1:], pair.a.bits, pair.b.shape[1:], pair.b.bits), pair)
    for pair in kinds.values():
        outs = [[torch.empty(p.shape[1:], dtype=torch.bfloat16, device=device) for p in (pair.a, pair.b)]
                for _ in range(2 if batch else 1)]
        if batch:
            lossless.decode_staged_pairs(pair, [(0, lossless.stage_pair(pair, 0, device), *o) for o in outs])
        else:
            pair.decode_into(0, *outs[0])
    return len(kinds)


def decode_in_place(store: list[CodedLayer], device) -> int:
    """A CUDA store's copies decode straight from each layer's page-locked arena
    (lossless.decode_pair_in_place: no staging copy, one launch reading the coded bytes over the bus),
    its code tables copied to `device`. An experiment (SPECTER_CODED_IN_PLACE=1, builder), timed by
    bench/experiments/coded_copy_cost.py beside the staged copy; a layer whose arena is not locked
    (the host refused) keeps the staged copy. -> the layers that decode in place."""
    n = 0
    for layer in store:
        pair = layer.w13.pair
        if pair is not None and is_locked(pair.words):
            pair.with_tables(device).in_place = True
            n += 1
    return n


def _warn_refused(refused: list[str]) -> None:
    if refused:  # once a store: the first refusal stops the pinning of the rest
        warn(f"could not pin the coded expert store ({refused[0]}; {host_limits()}); it stays "
             f"pageable and coded copies are synchronous (slower). Raise `ulimit -l` (memlock) or "
             f"free host memory to pin it.")


def store_nbytes(store) -> int:
    return sum(layer.nbytes if isinstance(layer, CodedLayer) else layer.w13.nbytes + layer.w2.nbytes
               for layer in store)


def coded_store_bytes(path, per_layer: list | None = None) -> tuple[int, int]:
    """(coded, raw) bytes of a bf16 checkpoint's expert store under compress_experts, computed from
    each tensor's exponent histograms, a layer at a time (`specter plan --compress-experts`: it reads
    every expert once, without coding them). `per_layer`: a list each MoE layer's coded bytes are
    appended to (plan --ranks: each rank's own layers')."""
    from ..loader import StoredExperts, open_checkpoint
    from ..triton_ops.lossless import best_width, encoded_nbytes, histograms

    ckpt = open_checkpoint(path)
    if ckpt.dtype != torch.bfloat16:
        raise ConfigError(f"compress_experts codes bf16 checkpoints; {path} stores {str(ckpt.dtype)[6:]}")
    coded = raw = 0
    for ew in StoredExperts(ckpt):
        before = coded
        for w in (ew.w13, ew.w2):
            hist, numel = histograms(w), w[0].numel()
            coded += encoded_nbytes(hist, numel, best_width(hist, numel))
            raw += w.nbytes
        if per_layer is not None:
            per_layer.append(coded - before)
    return coded, raw


# ------------------------------------------------------------------------------ on-disk cache
CACHE_FORMAT = 1
_FIELDS = ("signman", "planes", "table", "esc_off", "escapes", "esc_start")


def cache_settings() -> dict:
    """What the cached bytes depend on besides the checkpoint."""
    return {"format": CACHE_FORMAT, "code": "lossless bf16: raw sign/mantissa, fixed-width exponent codes",
            "widths": list(lossless.WIDTHS), "block": lossless.BLOCK}


def cache_key(files) -> str:
    """The draft's content fingerprint (draft_cache.fingerprint: sizes, modification times, headers, samples)
    and each shard's ctime, which the kernel sets on every write and on every change of the modification
    time (touch -r, os.utime), and nothing can set back: an edit the fingerprint misses is a miss here. A
    copy of the checkpoint (cp -p and rsync -a too) is coded anew, once; so is a shard after a chmod, a
    chown or a new hard link (a container runtime that chowns the model at every start recodes at every
    start). The entry of an older key of the same shards is removed when a new one is made
    (draft_cache.prune_superseded)."""
    from ..speculative.draft_cache import fingerprint

    h = hashlib.sha256(json.dumps(cache_settings(), sort_keys=True).encode())
    h.update(fingerprint(files).encode())
    for f in sorted({Path(f) for f in files}):
        h.update(f.stat().st_ctime_ns.to_bytes(16, "little", signed=True))  # (a hub snapshot's symlink: its blob's)
    return h.hexdigest()[:32]


def cache_entry(files, cache=None) -> Path | None:
    """The cache directory of this checkpoint's coded store (created), or None: caching off, or the
    default place not writable (warned); a named one not writable: ConfigError (draft_cache.make_entry)."""
    from ..speculative.draft_cache import entry_source, make_entry

    source = entry_source("coded", files, cache_settings())
    return make_entry(cache, f"coded-{cache_key(files)}", "coding at every load", source=source)


def read_cached(entry: Path | None, n_layers: int, shapes, first: int = 0) -> list[CodedLayer | None]:
    """Each layer's cached coding, or None where it is missing, stale or corrupt (or not of `shapes`,
    the config's (w13, w2): ModelSpec.expert_shapes). `first`: the MoE layer the list starts at (a
    pipeline stage's own layers)."""
    if entry is None:
        return [None] * n_layers
    return [_read_layer(entry / f"layer-{i}.safetensors", entry.name, i, shapes)
            for i in range(first, first + n_layers)]


def coded_store(store, cached: list[CodedLayer | None], entry: Path | None, *,
                cuda: bool = False, pin: bool = False, first: int = 0, also=None) -> list[CodedLayer]:
    """The coded store: cached layers as they are, the others coded from `store[i]` (the raw store, or a
    loader.StoredExperts that reads a layer when indexed; [] when every layer hit) and written to `entry`.
    Only the layers that missed are read, one at a time. `cuda`, `pin`: as encode_store's. `first`: the
    MoE layer `cached[0]` is (a pipeline stage's own layers; the cache is one process's). `also(i, raw)`:
    called with each layer read, before it is dropped (draft_cache.draft_along: the draft from the same read)."""
    out, refused = [], []
    for i, hit in enumerate(cached):
        if hit is None:
            if not len(store):
                raise ConfigError("coded_store: a layer missed the cache and no raw store was loaded")
            raw = store[i]
            if also is not None:
                also(first + i, raw)
            hit = encode_store([raw])[0]
            if entry is not None:
                _write_layer(entry / f"layer-{first + i}.safetensors", entry.name, first + i, hit)
            del raw  # (a StoredExperts' layer: freed here, before the next is read)
        if cuda or pin:
            hit = for_cuda_layer(hit.w13.packed, hit.w2.packed, pin=pin, refused=refused)
        out.append(hit)
    _warn_refused(refused)
    if out and (ratio := coded_ratio(out)) >= 1:  # (trained weights code to ~0.7; these do not)
        warn(f"the experts code to {ratio:.2f}x their bf16 bytes (exponents too spread out to compress), so "
             f"compress_experts (--compress-experts) moves more bytes, not fewer: load without it")
    return out


def _tensors(layer: CodedLayer) -> dict[str, torch.Tensor]:
    return {f"{m}.{k}": t.contiguous() for m in ("w13", "w2")
            for k, t in zip(_FIELDS, getattr(layer, m).packed.compact().tensors())}


def _write_layer(path: Path, key: str, i: int, layer: CodedLayer) -> None:
    from ..speculative.draft_cache import write_layer_file

    write_layer_file(path, key, i, _tensors(layer),
                     {"shapes": json.dumps({m: list(getattr(layer, m).shape) for m in ("w13", "w2")})})


def _read_layer(path: Path, key: str, i: int, shapes) -> CodedLayer | None:
    from ..speculative.draft_cache import read_layer_file

    read = read_layer_file(path, key, i)
    if read is None:
        return None
    tensors, meta = read
    try:
        stored = json.loads(meta["shapes"])  # (not under the tensors' CRCs)
        if [tuple(stored[m]) for m in ("w13", "w2")] != [tuple(s) for s in shapes]:
            return None
        return CodedLayer(*(LosslessExperts(tuple(stored[m]), *(tensors[f"{m}.{k}"] for k in _FIELDS))
                            for m in ("w13", "w2")))
    except Exception:  # malformed shapes, wrong tensors: rebuild
        return None
