"""What a model path is when it is not a usable checkpoint directory, said plainly before loading.

Specter reads local Hugging Face directories of 16/32-bit safetensors and never downloads, so a
GGUF file, a hub id or a pre-quantized (GPTQ, AWQ, bitsandbytes, FP8, ...) checkpoint each get an
error that names what was given and what to pass instead.
"""
from __future__ import annotations

import re
from pathlib import Path

from .errors import CheckpointError, UnsupportedModelError

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name, as on huggingface.co


def check_source(path: Path) -> None:
    """Raise a CheckpointError unless `path` is an existing directory."""
    if path.is_dir():
        return
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            raise CheckpointError(
                f"{path} is a GGUF file (llama.cpp's format); Specter loads a Hugging Face model directory "
                "(config.json and *.safetensors): pass the original model's directory instead")
        raise CheckpointError(f"{path} is a file; pass the Hugging Face model directory that holds config.json")
    if _HUB_ID.fullmatch(str(path)):
        raise CheckpointError(
            f"{str(path)!r} is not a local directory; if it is a Hugging Face hub id, Specter never downloads: "
            f"download with `hf download {path} --local-dir DIR`, then pass the directory")
    raise CheckpointError(f"model directory {str(path)!r} does not exist (pass a local Hugging Face model directory)")


def check_not_quantized(config: dict, path: Path) -> None:
    """Raise for a checkpoint stored quantized: its tensors are not the weights Specter reads."""
    q = config.get("quantization_config")
    if not q:
        return
    method = q.get("quant_method", "unknown method") if isinstance(q, dict) else "unknown method"
    raise UnsupportedModelError(
        f"{path} holds a quantized checkpoint ({method}); Specter loads 16/32-bit weights (and makes its own "
        "INT4 draft): pass the original bf16/fp16/fp32 checkpoint")


def weights_hint(path: Path) -> str:
    """Why a directory has no safetensors, when its files say so ('' when they do not)."""
    if list(path.glob("*.gguf")):
        return " (it holds GGUF files, llama.cpp's format: pass the original Hugging Face model directory)"
    if list(path.glob("*.bin")) or list(path.glob("*.pt")):
        return " (pickle .bin checkpoints are not loaded; convert them to safetensors)"
    return ""
