"""Why the first policy of a `specter bench` on a GPU decodes ~3-4x slower than the same engine later
(first GPU run, 2026-12-04: resident 41 ms a token first in the run, on-demand 54 ms first and 13 ms
second). Suspect: scaled_dot_product_attention picks cuDNN attention on Hopper, which builds a plan
per new (query, key) length, so every token of a first generation pays one; later generations reuse
the process's plan cache. Since then a CUDA load sets the process's backends to memory-efficient
attention (layers.cuda_attention_backends); this compares that with torch's own choice.

    python bench/experiments/first_run_cost.py            # each mode in a fresh process, on CUDA

Per mode (torch-default: flash and cuDNN turned back on after the load; specter: as loaded): the
backend SDPA picks for a decode-shaped and a verify-shaped call of the bundled model, then the
resident engine's TPOT over three generations of 64 tokens: prompt A, prompt A again (every length
seen), prompt B (longer: new lengths).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

MODES = ("torch-default", "specter")
BACKENDS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}  # torch's SDPBackend order


def one(mode: str) -> dict:
    import torch
    import torch.nn.functional as F  # noqa: F401

    import specter
    from specter.bench import DEFAULT_PROMPTS

    engine = specter.load(specter.default_model_path(), device="cuda", policy="resident")
    if mode == "torch-default":
        torch.backends.cuda.enable_flash_sdp(True)
        torch.backends.cuda.enable_cudnn_sdp(True)
    s = engine.spec
    dt = engine.dtype
    q1 = torch.randn(1, s.n_heads, 1, s.head_dim, device="cuda", dtype=dt)
    k = torch.randn(1, s.n_kv_heads, 100, s.head_dim, device="cuda", dtype=dt)
    q5 = torch.randn(1, s.n_heads, 5, s.head_dim, device="cuda", dtype=dt)
    mask = torch.ones(5, 100, dtype=torch.bool, device="cuda").tril(95)
    gqa = s.n_kv_heads != s.n_heads
    choice = {"decode": BACKENDS.get(int(torch._fused_sdp_choice(q1, k, k, None, 0.0, False, enable_gqa=gqa))),
              "verify": BACKENDS.get(int(torch._fused_sdp_choice(q5, k, k, mask, 0.0, False, enable_gqa=gqa)))}
    tpot = []
    for prompt in (DEFAULT_PROMPTS[0], DEFAULT_PROMPTS[0], DEFAULT_PROMPTS[-1] * 2):
        out = engine.generate(prompt, max_new_tokens=64, temperature=0.0)
        tpot.append(round(out.stats["tpot_s"] * 1e3, 2))
    engine.close()
    return {"mode": mode, "sdpa_choice": choice, "tpot_ms_A_A_B": tpot,
            "cudnn_sdp_enabled": torch.backends.cuda.cudnn_sdp_enabled()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--one", choices=MODES, help="run one mode in this process (what each child is asked)")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():  # checked once here, not as each child's traceback
        print(f"first_run_cost: needs a CUDA GPU; torch {torch.__version__} sees none", file=sys.stderr)
        return 2
    if args.one:
        print(json.dumps(one(args.one)))
        return 0
    for mode in MODES:
        r = subprocess.run([sys.executable, __file__, "--one", mode], capture_output=True, text=True, timeout=240)
        print(r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else
              f"{mode}: exit {r.returncode}\n{r.stderr[-1500:]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
