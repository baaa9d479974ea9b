"""Checkpoint loading: a local Hugging Face directory -> (model on the device, routed experts on
the host in the common `ExpertWeights` form, tokenizer).

The model is built on the meta device (accelerate's empty-weight init) and each tensor is
materialised straight from the memory-mapped safetensors into its final place, so loading never
holds two copies. Only safetensors are read: no pickle, no remote code.
"""
from __future__ import annotations

import json
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from safetensors import safe_open
from tqdm.auto import tqdm

from .config import SUPPORTED, ModelSpec, supported_list, token_ids
from .errors import CheckpointError, UnsupportedModelError, warn
from .model import MoETransformer
from .moe import ExpertWeights
from .sources import check_not_quantized, check_source, weights_hint
from .offload.store import allocate_store

# per-expert tensor names as published: (gate, up, down)
_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3", "block_sparse_moe.experts.{e}.w2"),
    "phimoe": ("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3", "block_sparse_moe.experts.{e}.w2"),
}
_DEFAULT_EXPERT_NAMES = ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj")


@dataclass
class Checkpoint:
    path: Path
    spec: ModelSpec
    files: dict[str, Path]         # tensor name -> safetensors file
    dtype: torch.dtype             # the checkpoint's storage dtype

    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in set(self.files.values()))

    def numel(self) -> int:
        """Parameters in the checkpoint, from the safetensors headers (no tensor is read)."""
        n = 0
        for f in sorted(set(self.files.values())):
            with safe_open(str(f), framework="pt") as h:
                n += sum(math.prod(h.get_slice(name).get_shape()) for name in h.keys())
        return n


_TRANSFORMERS = threading.Lock()


def transformers_attr(name: str):
    """transformers.<name>, imported under a lock: the first imports of its lazy module race across threads
    (two specter.load calls at once failed with "cannot import name 'AutoConfig' from 'transformers'")."""
    with _TRANSFORMERS:
        import transformers

        return getattr(transformers, name)


def read_config(path: str | os.PathLike):
    path = Path(path)
    check_source(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path / 'config.json'} is missing: not a Hugging Face model directory"
                              + weights_hint(path))
    raw = read_json_object(path / "config.json")
    model_type = raw.get("model_type")
    if model_type is None:
        raise CheckpointError(f"{path / 'config.json'} has no model_type, so its architecture is unknown; "
                              f"supported: {supported_list()}")
    if model_type not in SUPPORTED:
        raise UnsupportedModelError(f"architecture {model_type!r} is not supported; supported: {supported_list()}")
    check_not_quantized(raw, path)
    try:
        cfg = transformers_attr("AutoConfig").from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
    except Exception as e:  # malformed fields
        why = " ".join(str(e).split())  # (transformers' validation errors span lines; a CLI error is one)
        raise CheckpointError(f"{path / 'config.json'} could not be read: {why}") from None
    spec = ModelSpec.from_hf(cfg)
    gen = path / "generation_config.json"
    eos = spec.eos_token_ids
    if gen.is_file():
        eos = sorted(set(eos) | set(token_ids(read_json_object(gen).get("eos_token_id"), f"{gen}: eos_token_id")))
    spec.eos_token_ids = eos
    return cfg, spec


def read_json_object(file: Path) -> dict:
    """A settings file's JSON object; a CheckpointError naming the file when it is not UTF-8, not JSON, or
    not an object."""
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        kind = "null" if raw is None else type(raw).__name__
        raise CheckpointError(f"{file} holds a JSON {kind}, not the object of a model's settings")
    return raw


def describe(path: str | os.PathLike) -> tuple[ModelSpec, torch.dtype, int, bool]:
    """(spec, storage dtype, parameter count, weights present) for `specter plan`: from the weights'
    headers when the directory has them, else from config.json alone (dtype as the config states it,
    parameters counted on a meta-device model), so a plan needs no download."""
    path = Path(path)
    cfg, spec = read_config(path)
    if any(path.glob("*.safetensors")):
        ckpt = open_checkpoint(path)
        return ckpt.spec, ckpt.dtype, ckpt.numel(), True
    dtype = getattr(cfg, "dtype", None) or torch.float32  # transformers >= 5 reads torch_dtype into dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""), None)
    if dtype not in _DTYPES.values():
        raise CheckpointError(f"{path / 'config.json'}: dtype {dtype!r} is not one of float32, float16, bfloat16")
    with init_empty_weights(include_buffers=False):  # rope's tables (1 position) are computed for real:
        model = MoETransformer(spec, 1)                # YaRN's scaling reads values a meta tensor lacks
    numel = sum(p.numel() for p in model.parameters()) + spec.n_moe_layers * spec.n_experts * spec.expert_numel()
    return spec, dtype, numel, False


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    path = Path(path)
    _, spec = read_config(path)
    index = path / "model.safetensors.index.json"
    files: dict[str, Path] = {}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index} is malformed ({type(e).__name__}: {e}); "
                                  f"re-download or re-save it") from None
        if not isinstance(weight_map, dict) or not weight_map or \
                not all(isinstance(f, str) and f for f in weight_map.values()):
            raise CheckpointError(f"{index} is malformed: its weight_map must map tensor names to shard file "
                                  f"names; re-download or re-save it")
        shards = sorted({path / f for f in weight_map.values()})
        for f in shards:
            if not f.is_file():
                raise CheckpointError(f"shard {f} listed in {index.name} is missing")
        # the shards' own headers say where a tensor is, as the reader reads them, not the index
        files = _where(_check_headers(shards), f"re-download or re-save the checkpoint")
    else:
        shard_files = sorted(path.glob("*.safetensors"))
        if not shard_files:
            raise CheckpointError(f"no *.safetensors weights in {path}{weights_hint(path)}")
        files = _where(_check_headers(shard_files), f"with no {index.name} every *.safetensors file in {path} is "
                       f"read: remove the stray one, or add the index that names each tensor's shard")
    dtype = _storage_dtype(files)
    return Checkpoint(path, spec, files, dtype)


def _where(headers: dict[Path, list[str]], fix: str) -> dict[str, Path]:
    """Each tensor's file. A tensor in two files is refused: one of them would win silently (a stray
    copy of an old shard beside the real ones made the output another model's)."""
    files: dict[str, Path] = {}
    for f, names in headers.items():
        for n in names:
            if n in files:
                raise CheckpointError(f"tensor {n!r} is stored twice, in {files[n]} and in {f}: {fix}")
            files[n] = f
    return files


def _check_headers(shards: list[Path]) -> dict[Path, list[str]]:
    """Open every shard once: a truncated or corrupt file fails here, named, before any work."""
    out = {}
    for f in shards:
        try:
            with safe_open(str(f), framework="pt") as h:
                out[f] = list(h.keys())
        except Exception as e:
            raise CheckpointError(f"{f} is truncated or corrupt ({type(e).__name__}: {e}); re-download or re-save it") from None
    return out


def _storage_dtype(files: dict[str, Path]) -> torch.dtype:
    """The routed experts' stored dtype (the store keeps it: another would round or widen them), else the
    embedding's; a checkpoint may keep other tensors in another dtype (they load in the compute dtype)."""
    if not files:
        raise CheckpointError("the checkpoint's shards hold no tensors; re-download or re-save it")
    name = next((n for n in sorted(files) if ".experts." in n),
                next((n for n in files if n.endswith("embed_tokens.weight")), next(iter(files))))
    with safe_open(str(files[name]), framework="pt") as h:
        return _DTYPES.get(h.get_slice(name).get_dtype(), torch.float32)


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


_ST_DTYPES = {**_DTYPES, "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
              "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


_CONVERT_CHUNK = 16 << 20  # bytes read at a time into a tensor of another dtype


class _Reader:
    """Reads tensors with pread straight into their destination: no mapping stays resident and no
    page is held twice, so filling a store of N bytes raises RSS by N bytes and nothing more."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt, self.fds, self.entries = ckpt, {}, {}
        for f in sorted(set(ckpt.files.values())):
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
            for name, e in header.items():
                if name != "__metadata__":
                    begin, end = e["data_offsets"]
                    self.entries[name] = (f, e["dtype"], tuple(e["shape"]), 8 + n + begin, end - begin)

    def has(self, name: str) -> bool:
        return name in self.entries

    def dtype(self, name: str) -> torch.dtype:
        f, dt, *_ = self._entry(name)
        if dt not in _ST_DTYPES:
            raise CheckpointError(f"{f}: tensor {name!r} has dtype {dt}, which is not supported")
        return _ST_DTYPES[dt]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[2]

    def get(self, name: str) -> torch.Tensor:
        t = torch.empty(self.shape(name), dtype=self.dtype(name))
        self.read_into(name, t)
        return t

    def read_into(self, name: str, dst: torch.Tensor) -> None:
        """dst (contiguous, any dtype, the tensor's shape) <- the stored tensor."""
        f, _, shape, offset, nbytes = self._entry(name)
        if tuple(dst.shape) != shape:
            raise CheckpointError(f"{name}: shape {shape} does not match the config's {tuple(dst.shape)}")
        stored = self.dtype(name)
        if dst.numel() * stored.itemsize != nbytes:
            raise CheckpointError(f"{f}: tensor {name!r} has {nbytes} bytes for shape {shape}; the file is corrupt")
        if dst.dtype == stored:
            return self._pread(name, dst.view(-1), offset)
        flat, step = dst.view(-1), max(1, _CONVERT_CHUNK // stored.itemsize)  # convert through a small buffer
        buf = torch.empty(min(step, flat.numel()), dtype=stored)
        for i in range(0, flat.numel(), step):
            n = min(step, flat.numel() - i)
            self._pread(name, buf[:n], offset + i * stored.itemsize)
            flat[i:i + n].copy_(buf[:n])

    def _pread(self, name: str, dst: torch.Tensor, offset: int) -> None:
        """The stored bytes at `offset` into `dst` (contiguous, 1-D, of the stored dtype)."""
        f = self._entry(name)[0]
        _pread(self._fd(f), dst, offset, f"{f}: tensor {name!r}")

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def _entry(self, name: str):
        if name not in self.entries:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.ckpt.path}")
        return self.entries[name]

    def _fd(self, f: Path) -> int:
        if f not in self.fds:
            self.fds[f] = os.open(f, os.O_RDONLY)
        return self.fds[f]


def _pread(fd: int, dst: torch.Tensor, offset: int, what: str) -> None:
    """The file's bytes at `offset` into `dst` (contiguous); `what` names them in the error."""
    buf, done = memoryview(dst.view(-1).view(torch.uint8).numpy()), 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(f"{what} could not be read (the file is truncated); re-download or re-save it")
        done += n


def _checkpoint_name(name: str, spec: ModelSpec) -> str:
    """Our parameter name -> the name published checkpoints use."""
    if spec.arch in ("mixtral", "phimoe"):
        name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
    name = name.replace(".mlp.shared_gate.", ".mlp.shared_expert_gate.")
    if spec.arch == "qwen2_moe":
        name = name.replace(".mlp.shared.", ".mlp.shared_expert.")
    elif spec.arch == "deepseek_v2":
        name = name.replace(".mlp.shared.", ".mlp.shared_experts.")
    return name


def load_checkpoint(
    path: str | os.PathLike,
    device: torch.device,
    dtype: torch.dtype,
    *,
    max_len: int | None = None,
    pin_experts: bool = False,
    progress: bool | None = None,
    experts: bool = True,
    layers: tuple[int, int] | None = None,
    expert_layers: tuple[int, int] | None = None,
) -> tuple[MoETransformer, list[ExpertWeights], Checkpoint]:
    """Build the model with its non-expert weights on `device` in `dtype`, and return the routed experts
    as the host store: one `ExpertWeights` per MoE layer, in the checkpoint's own dtype (pinned in
    place when `pin_experts`), read once from the files straight into it. Each non-expert weight is
    read into its final dtype a chunk at a time, so no stored-dtype copy of it is ever held. On CPU
    the input embedding keeps a narrower checkpoint dtype (the rows it gathers are upcast: `MoETransformer.enter`).
    `experts=False`: the routed experts are not read (the store is []: a coded store came from its cache).
    `layers` (first, last): only decoder layers [first, last) are read, with the embedding when first
    is 0 and the final norm and lm_head when last is the last layer (a pipeline stage); every other
    parameter stays on the meta device, and the store holds those layers' MoE layers only.
    `expert_layers` (first, last): the store holds only these decoder layers' MoE layers (default:
    `layers`'), whatever non-expert weights are read."""
    ckpt = open_checkpoint(path)
    spec = ckpt.spec
    with init_empty_weights(include_buffers=False):
        model = MoETransformer(spec, max_len, dtype)
    reader = _Reader(ckpt)
    try:
        params = [(n, _source(n, spec, reader)) for n, _ in model.named_parameters()
                  if layers is None or _in_stage(n, layers, spec.n_layers)]
        every = _expert_names(reader, spec)
        _check_all_read(reader, spec, model, every)
        names = every if experts else []
        span = expert_layers if expert_layers is not None else layers
        if span is not None:
            names = [n for l, n in zip(spec.moe_layer_ids, names) if span[0] <= l < span[1]]
        total = sum(reader.entries[src][4] for _, src in params if src in reader.entries)
        total += sum(reader.entries[n][4] for layer in names for n in layer if n in reader.entries)
        if progress is None:
            progress = total > (512 << 20)
        bar = tqdm(total=total, desc="loading", unit="B", unit_scale=True, unit_divisor=1024, disable=not progress)
        narrow_embed = device.type == "cpu" and ckpt.dtype.itemsize < dtype.itemsize  # the table stays in ckpt.dtype
        for name, src in params:
            expected = tuple(model.get_parameter(name).shape)
            if reader.shape(src) != expected:
                raise CheckpointError(f"{src}: shape {reader.shape(src)} does not match the config's {expected}")
            value = torch.empty(expected, dtype=ckpt.dtype if narrow_embed and name == "model.embed_tokens.weight"
                                else dtype)
            reader.read_into(src, value)  # converts a chunk at a time
            set_module_tensor_to_device(model, name, device, value=value, dtype=value.dtype)
            del value  # not held while the store fills
            bar.update(reader.entries[src][4])
        model.rope.to(device)
        store = allocate_store(spec, ckpt.dtype, pin=pin_experts, n_layers=len(names)) if experts and names else []
        for ew, layer in zip(store, names):
            for name, dst in _destinations(layer, ew):
                reader.read_into(name, dst)
                bar.update(reader.entries[name][4])
        bar.close()
    finally:
        reader.close()
    model.eval()
    return model, store, ckpt


def _check_all_read(reader: _Reader, spec: ModelSpec, model: MoETransformer, experts: list[list[str]]) -> None:
    """Every stored tensor of a module the model computes is one it reads: a tensor left over there (a
    bias the config does not declare, or declares through an option Specter does not read) would make
    the output another model's, so it is a CheckpointError. Others (past the last decoder layer, e.g. a
    multi-token-prediction head) are warned about; rotary inv_freq buffers and a tied lm_head are not."""
    read = {_checkpoint_name(n, spec) for n, _ in model.named_parameters()}
    read.update(n for layer in experts for n in layer)  # (_expert_names: every MoE layer's)
    left = [n for n in reader.entries if n not in read and not n.endswith("rotary_emb.inv_freq")
            and not (n == "lm_head.weight" and spec.tie_embeddings) and not _computes_nothing(n, reader, spec)]
    if not left:
        return
    past = sorted({int(n.split(".")[2]) for n in left if n.startswith("model.layers.") and n.split(".")[2].isdigit()
                   and ".self_attn." in n})  # decoder layers the config does not count
    heads = getattr(spec.hf_config, "num_nextn_predict_layers", None) or 0  # (multi-token-prediction layers)
    if past and past[-1] >= spec.n_layers + heads:
        raise CheckpointError(
            f"{reader.ckpt.path}: the weights hold decoder layers up to model.layers.{past[-1]}, but config.json's "
            f"num_hidden_layers is {spec.n_layers}"
            + (f" (and num_nextn_predict_layers {heads})" if heads else "")
            + ": config.json describes another, shallower model, so the output would not be this one's; fix "
            "num_hidden_layers (a multi-token-prediction head is declared by num_nextn_predict_layers)")
    ours = [n for n in left if n.startswith(("model.embed_tokens.", "model.norm.", "lm_head."))
            or (n.startswith("model.layers.") and n.split(".")[2].isdigit() and int(n.split(".")[2]) < spec.n_layers)]
    if ours:
        raise CheckpointError(f"{reader.ckpt.path}: {len(ours)} tensor(s) of the layers Specter computes are not in "
                              f"its {spec.arch} model ({', '.join(map(repr, ours[:3]))}"
                              f"{', ...' if len(ours) > 3 else ''}): config.json describes another model (an "
                              f"option Specter does not support, e.g. mlp_bias), so the output would not be this one's")
    warn(f"{reader.ckpt.path}: {len(left)} tensor(s) outside the layers Specter computes are not read "
         f"({', '.join(map(repr, left[:3]))}{', ...' if len(left) > 3 else ''})")


def _computes_nothing(name: str, reader: _Reader, spec: ModelSpec) -> bool:
    """A shared expert of size zero (transformers builds one for Qwen2-MoE's shared_expert_intermediate_size
    0 and DeepSeek-V2's n_shared_experts 0: [0, H] and [H, 0] weights) and Qwen2-MoE's gate over it add
    nothing to a layer's output, so Specter, which builds no shared expert there, need not read them."""
    if spec.shared_inter or ".mlp.shared_expert" not in name:  # (shared_expert., shared_experts., shared_expert_gate.)
        return False
    return name.endswith(".mlp.shared_expert_gate.weight") or 0 in reader.shape(name)


def _in_stage(name: str, layers: tuple[int, int], n_layers: int) -> bool:
    """Whether parameter `name` belongs to the pipeline stage running decoder layers [first, last)."""
    first, last = layers
    if name.startswith("model.layers."):
        return first <= int(name.split(".")[2]) < last
    if name.startswith("model.embed_tokens."):
        return first == 0
    return last == n_layers  # the final norm and lm_head


def _source(name: str, spec: ModelSpec, reader: _Reader) -> str:
    src = _checkpoint_name(name, spec)
    if name == "lm_head.weight" and spec.tie_embeddings:
        src = "model.embed_tokens.weight"  # tied, as transformers ties them: a stored lm_head is not read
    if not reader.has(src):
        untied = " (config.json's tie_word_embeddings is false: it is not the embedding table)" \
            if name == "lm_head.weight" else ""
        raise CheckpointError(f"tensor {src!r} is missing from the checkpoint in {reader.ckpt.path}{untied}")
    return src


def _expert_names(reader: _Reader, spec: ModelSpec) -> list[list[str]]:
    """Per MoE layer, the stored tensors in store order: the fused (gate_up [E, 2I, H], down [E, H, I])
    pair of transformers-v5 layouts, or gate [I, H], up [I, H], down [H, I] of each expert in turn."""
    gate, up, down = _EXPERT_NAMES.get(spec.arch, _DEFAULT_EXPERT_NAMES)
    out = []
    for layer in spec.moe_layer_ids:
        prefix = f"model.layers.{layer}."
        if reader.has(prefix + "mlp.experts.gate_up_proj"):  # transformers-v5 in-memory layout saved as is
            names = [prefix + "mlp.experts.gate_up_proj", prefix + "mlp.experts.down_proj"]
        else:
            names = [prefix + n.format(e=e) + ".weight" for e in range(spec.n_experts) for n in (gate, up, down)]
        for n in names:
            if not reader.has(n):
                held = [reader.has(prefix + gate.format(e=e) + ".weight") for e in range(spec.n_experts)]
                stored = sum(held)  # the first `stored` of them and no other: fewer experts, not a damaged file
                why = f": config.json declares {spec.n_experts} routed experts a layer, the weights hold {stored} " \
                      f"(config.json describes another model)" if 0 < stored < spec.n_experts and all(held[:stored]) \
                    else ""
                raise CheckpointError(f"tensor {n!r} is missing from the checkpoint in {reader.ckpt.path}{why}")
        out.append(names)
    return out


class StoredExperts:
    """A checkpoint's routed experts as the store's readers see them: one ExpertWeights per MoE layer,
    read from the files (pread, the stored dtype) each time a layer is indexed, nothing kept, so a
    reader that walks the layers holds one at a time. What a coded store's readers read where they need
    raw bits (the draft's quantisation, resident rows, the host lane's copy, coding a layer the cache
    misses): reading is several times faster than decoding on a CPU, and the same bits. Made, it has
    checked every expert tensor's shape against the config (a load whose coded store came whole from its
    cache reads no expert, and would not have)."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt, spec = ckpt, ckpt.spec
        self.shapes = spec.expert_shapes()  # (w13, w2), without reading a layer
        meta = ExpertWeights(torch.empty(self.shapes[0], device="meta"), torch.empty(self.shapes[1], device="meta"))
        reader = _Reader(ckpt)
        try:
            self.names = _expert_names(reader, spec)
            for layer in self.names:  # every tensor's stored shape against the config's, from the headers
                for name, view in _destinations(layer, meta):
                    if reader.shape(name) != tuple(view.shape):
                        raise CheckpointError(f"{name}: shape {reader.shape(name)} does not match the config's "
                                              f"{tuple(view.shape)}")
        finally:
            reader.close()

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: int) -> ExpertWeights:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        (s13, s2), dt = self.shapes, self.ckpt.dtype
        ew = ExpertWeights(torch.empty(s13, dtype=dt), torch.empty(s2, dtype=dt))
        layer = self.names[i]
        reader = _Reader(self.ckpt)
        try:
            for name, dst in _destinations(layer, ew):
                reader.read_into(name, dst)
        finally:
            reader.close()
        return ew

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    @property
    def nbytes(self) -> int:
        (s13, s2), size = self.shapes, self.ckpt.dtype.itemsize
        return len(self) * (math.prod(s13) + math.prod(s2)) * size

    def expert_reads(self) -> list[ExpertWeights] | None:
        """Per MoE layer, its w13 and w2 as ExpertReads (`w13[e]`: expert e's rows, read when indexed),
        nothing read now; None where an expert tensor is stored in another dtype than the store's."""
        reader = _Reader(self.ckpt)
        try:
            if any(reader.dtype(n) != self.ckpt.dtype for layer in self.names for n in layer):
                return None
            files = {f: _OpenedFile(f) for f in sorted(set(self.ckpt.files.values()))}
            (s13, s2), out = self.shapes, []
            for layer in self.names:
                where = {n: (files[reader.entries[n][0]], reader.entries[n][3]) for n in layer}
                if len(layer) == 2:  # fused [E, N, K]: expert e's rows are one run
                    parts = [[[(*where[n], e * math.prod(s[1:]))] for e in range(s[0])]
                             for n, s in zip(layer, (s13, s2))]
                else:  # gate, up, down of each expert: w13[e] is its gate's rows then its up's
                    parts = [[[(*where[n], 0) for n in layer[3 * e:3 * e + 2]] for e in range(s13[0])],
                             [[(*where[layer[3 * e + 2]], 0)] for e in range(s13[0])]]
                out.append(ExpertWeights(*(ExpertReads(p, s[1:], self.ckpt.dtype) for p, s in zip(parts, (s13, s2)))))
            return out
        finally:
            reader.close()


class ExpertReads:
    """One MoE layer's stored w13 or w2 indexed by expert: `reads[e]` is expert e's rows [N, K] (the stored
    dtype), read from the checkpoint (pread) into a new tensor each time; nothing kept. What the emulated
    link's coded copies write from where no decoded store is kept (coded_tier.emulation_rows): the same
    bits as the decode, read in a few ms where this CPU's decode takes ~10x longer. Reads from any thread
    (pread on files opened once: a file replaced by a rename, as a hub download does, is still read as
    loaded). A file changed in place since raises CheckpointChanged (and warns once): its bytes are no
    longer the loaded weights, and the coded copy decodes its store instead (offload/coded.py)."""

    def __init__(self, parts: list[list[tuple]], shape, dtype: torch.dtype):
        # parts[e]: expert e's runs in order, each (_OpenedFile, the tensor's byte offset, the run's first element)
        self.parts, self.shape, self.dtype = parts, torch.Size(shape), dtype

    def __len__(self) -> int:
        return len(self.parts)

    def __getitem__(self, e) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        flat, n = out.view(-1), self.shape.numel() // len(self.parts[e])
        for i, (f, offset, first) in enumerate(self.parts[e]):
            f.read(flat[i * n:(i + 1) * n], offset + first * self.dtype.itemsize, f"{f.path}: expert {e}")
        return out


class CheckpointChanged(CheckpointError):
    """A checkpoint file changed on disk after the load (ExpertReads): its bytes are not the loaded weights."""


class _OpenedFile:
    """A checkpoint file opened once, read with pread from any thread, and its size, mtime and ctime then:
    a read that finds them changed (a write in place; a rename-replace leaves this file as it was) raises
    CheckpointChanged, as every later read does, and warns once."""

    def __init__(self, path: Path):
        self.path, self.fh = path, open(path, "rb", buffering=0)
        self.state, self.changed = self._state(), False

    def _state(self) -> tuple[int, int, int]:
        st = os.fstat(self.fh.fileno())
        return st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def read(self, dst: torch.Tensor, offset: int, what: str) -> None:
        if not self.changed:
            try:
                _pread(self.fh.fileno(), dst, offset, what)
            except CheckpointError:  # truncated: since the load, or (state unchanged) corrupt
                if self._state() == self.state:
                    raise
            if self._state() == self.state:
                return
            self.changed = True
            warn(f"{self.path} changed on disk after the load; coded copies decode the experts as loaded "
                 f"from now on (the same weights; slower on this CPU)")
        raise CheckpointChanged(f"{self.path} changed on disk after the load")


def _destinations(names: list[str], ew: ExpertWeights):
    """(stored tensor name, the view of `ew` it fills) for one MoE layer's names (_expert_names)."""
    return zip(names, iter((ew.w13, ew.w2)) if len(names) == 2 else _per_expert_views(ew))


def _per_expert_views(ew: ExpertWeights):
    I = ew.w2.shape[2]
    for e in range(ew.n_experts):
        yield ew.w13[e, :I]
        yield ew.w13[e, I:]
        yield ew.w2[e]


def load_tokenizer(path: str | os.PathLike):
    """The directory's tokenizer, or None when it ships none (token-id prompts still work)."""
    path = Path(path)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    try:
        tok = transformers_attr("AutoTokenizer").from_pretrained(str(path), local_files_only=True,
                                                                 trust_remote_code=False)
    except Exception as e:
        why = " ".join(line.strip() for line in str(e).splitlines() if line.strip())  # one line, as every error
        hint = "" if (path / "tokenizer.json").is_file() else \
            " (the directory has no tokenizer.json: copy the model's own next to config.json)"
        raise CheckpointError(f"the tokenizer in {path} could not be loaded{hint}: {why}") from None
    # the engine checks a prompt against its context itself (ContextLengthError): no "sequence length is
    # longer than the specified maximum ... indexing errors" warning from encoding a long one
    tok.model_max_length = int(1e30)
    return tok
