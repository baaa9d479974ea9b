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
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from safetensors import safe_open
from tqdm.auto import tqdm

from .config import SUPPORTED, ModelSpec, supported_list
from .errors import CheckpointError, UnsupportedModelError
from .model import MoETransformer
from .moe import ExpertWeights
from .sources import check_not_quantized, check_source, weights_hint

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


def read_config(path: str | os.PathLike):
    path = Path(path)
    check_source(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path / 'config.json'} is missing: not a Hugging Face model directory")
    try:
        raw = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path / 'config.json'} is not valid JSON ({e})") from None
    model_type = raw.get("model_type")

    if model_type not in SUPPORTED:
        raise UnsupportedModelError(f"architecture {model_type!r} is not supported; supported: {supported_list()}")
    check_not_quantized(raw, path)
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
    except Exception as e:  # malformed fields
        raise CheckpointError(f"{path / 'config.json'} could not be read: {e}") from None
    spec = ModelSpec.from_hf(cfg)
    gen = path / "generation_config.json"
    eos = spec.eos_token_ids
    if gen.is_file():
        try:
            g = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{gen} is not valid JSON ({e})") from None
        if g is not None:
            eos = sorted(set(eos) | set(g if isinstance(g, list) else [g]))
    spec.eos_token_ids = eos
    return cfg, spec


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    path = Path(path)
    _, spec = read_config(path)
    index = path / "model.safetensors.index.json"
    files: dict[str, Path] = {}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is malformed ({e})") from None
        shards = {name: path / f for name, f in weight_map.items()}
        for f in sorted(set(shards.values())):
            if not f.is_file():
                raise CheckpointError(f"shard {f} listed in {index.name} is missing")
        files = shards
        _check_headers(sorted(set(shards.values())))
    else:
        shard_files = sorted(path.glob("*.safetensors"))
        if not shard_files:
            raise CheckpointError(f"no *.safetensors weights in {path}{weights_hint(path)}")
        for f, names in _check_headers(shard_files).items():
            files.update({n: f for n in names})
    dtype = _storage_dtype(files)
    return Checkpoint(path, spec, files, dtype)


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
    name = next((n for n in files if n.endswith("embed_tokens.weight")), next(iter(files)))
    with safe_open(str(files[name]), framework="pt") as h:
        return _DTYPES.get(h.get_slice(name).get_dtype(), torch.float32)


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class _Reader:
    """Memory-mapped tensor access across shards; keeps each shard open once."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt, self.handles = ckpt, {}

    def has(self, name: str) -> bool:
        return name in self.ckpt.files

    def get(self, name: str) -> torch.Tensor:
        f = self.ckpt.files.get(name)
        if f is None:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.ckpt.path}")
        if f not in self.handles:
            self.handles[f] = safe_open(str(f), framework="pt")
        try:
            return self.handles[f].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{f}: tensor {name!r} could not be read ({e}); the file may be truncated") from None


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
) -> tuple[MoETransformer, list[ExpertWeights], Checkpoint]:
    """Build the model with its non-expert weights on `device` and return the routed experts on the
    host (pinned when `pin_experts`), one `ExpertWeights` per MoE layer, in `dtype`."""
    ckpt = open_checkpoint(path)
    spec = ckpt.spec
    with init_empty_weights(include_buffers=False):
        model = MoETransformer(spec, max_len)
    reader = _Reader(ckpt)
    params = [n for n, _ in model.named_parameters()]
    if progress is None:
        progress = ckpt.nbytes() > (512 << 20)
    bar = tqdm(total=len(params) + spec.n_moe_layers, desc="loading", unit="tensor", disable=not progress)
    for name in params:
        src = _checkpoint_name(name, spec)
        if name == "lm_head.weight" and not reader.has(src):
            src = "model.embed_tokens.weight"  # tied embeddings
        t = reader.get(src)
        expected = model.get_parameter(name).shape
        if t.shape != expected:
            raise CheckpointError(f"{src}: shape {tuple(t.shape)} does not match the config's {tuple(expected)}")
        set_module_tensor_to_device(model, name, device, value=t, dtype=dtype)
        bar.update()
    model.rope.to(device)
    experts = []
    for layer in spec.moe_layer_ids:
        experts.append(_load_experts(reader, spec, layer, dtype, pin_experts))
        bar.update()
    bar.close()
    model.eval()
    return model, experts, ckpt


def _load_experts(reader: _Reader, spec: ModelSpec, layer: int, dtype, pin: bool) -> ExpertWeights:
    E, I, H = spec.n_experts, spec.expert_inter, spec.hidden
    w13 = torch.empty(E, 2 * I, H, dtype=dtype, pin_memory=pin)  # [E, 2I, H]
    w2 = torch.empty(E, H, I, dtype=dtype, pin_memory=pin)       # [E, H, I]
    prefix = f"model.layers.{layer}."
    fused = prefix + "mlp.experts.gate_up_proj"
    if reader.has(fused):  # transformers-v5 in-memory layout saved as is
        w13.copy_(reader.get(fused))
        w2.copy_(reader.get(prefix + "mlp.experts.down_proj"))
        return ExpertWeights(w13, w2)
    gate, up, down = _EXPERT_NAMES.get(spec.arch, _DEFAULT_EXPERT_NAMES)
    for e in range(E):
        for dst, name, shape in ((w13[e, :I], gate, (I, H)), (w13[e, I:], up, (I, H)), (w2[e], down, (H, I))):
            full = prefix + name.format(e=e) + ".weight"
            t = reader.get(full)
            if tuple(t.shape) != shape:
                raise CheckpointError(f"{full}: shape {tuple(t.shape)} does not match the config's {shape}")
            dst.copy_(t)
    return ExpertWeights(w13, w2)


def load_tokenizer(path: str | os.PathLike):
    """The directory's tokenizer, or None when it ships none (token-id prompts still work)."""
    path = Path(path)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as e:
        raise CheckpointError(f"the tokenizer in {path} could not be loaded: {e}") from None
