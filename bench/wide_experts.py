"""Write the bundled model with every routed expert widened W times (issue 24's realistic-size check).

    python bench/wide_experts.py OUT [--factor 32]

Each expert's intermediate dimension grows W-fold by repeating its gate and up rows W times and its
down columns W times, the down weights divided by W (a power of two: exact in bf16 for these values,
checked). The expert computes the same function up to fp32 summation order, so routing, the draft's
acceptance and the exponents' statistics (the code's ratio) stay the trained model's, while its bytes
are those of a realistically sized expert: at W = 32 one expert is 3 x 256 x 6144 x 2 B = 9,437,184 B,
exactly Qwen3-30B-A3B's (3 x 2048 x 768 x 2 B, bench/configs). Only the expert weights change; the
tokenizer and generation config are copied. Not the bundled model: report results on it as such.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SRC = Path(__file__).resolve().parents[1] / "specter" / "default_model"


def widen(src: Path, out: Path, factor: int) -> None:
    if factor < 1 or factor & (factor - 1):
        raise SystemExit("--factor must be a power of two (the down weights are divided by it exactly)")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    with safe_open(src / "model.safetensors", "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if ".mlp.experts." in name and name.endswith(("gate_proj.weight", "up_proj.weight")):
                t = t.repeat(factor, 1)                       # [I, H] -> [W I, H]
            elif ".mlp.experts." in name and name.endswith("down_proj.weight"):
                scaled = t / factor
                if not torch.equal(scaled.float() * factor, t.float()):
                    raise SystemExit(f"{name}: dividing by {factor} is not exact in bf16")
                t = scaled.repeat(1, factor)                  # [H, I] -> [H, W I]
            tensors[name] = t.contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["moe_intermediate_size"] *= factor
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    I, H = cfg["moe_intermediate_size"], cfg["hidden_size"]
    print(f"{out}: experts {I} x {H}, {3 * I * H * 2:,} B bf16 each")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--factor", type=int, default=32)
    ap.add_argument("--src", type=Path, default=SRC)
    a = ap.parse_args()
    widen(a.src, a.out, a.factor)


if __name__ == "__main__":
    main()
