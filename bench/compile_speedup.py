"""What the compiled draft step (compile=True) buys end to end, measured side by side.

`specter bench` puts policies side by side; this puts the same policy three times -- the eager
draft, the sync-free draft step run eagerly, and compiled -- plus on-demand for scale,
alternating prompts in one process so machine load hits all alike.

    python bench/compile_speedup.py [--residency 0.25 0.5] [--repeat 3] [--max-new-tokens 64]

Measured on the 2-core CPU (emulated A100 PCIe 4.0 link, bundled model, 64 tokens, 3 repeats),
before the sync-free step: compiled/eager TPOT 0.93 at 25% residency and 0.87 at 50%; the draft's
share of decode time fell from 28% to 20% and from 40% to 29%. See docs/ARCHITECTURE.md for the
current numbers.
"""
from __future__ import annotations

import argparse

import specter
from specter.bench import DEFAULT_PROMPTS
from specter.builder import _compiled_draft_step


def measure(residency: float, repeat: int, max_new: int) -> dict:
    engines = {"eager": specter.load(None, policy="specter", residency=residency),
               "sync-free": specter.load(None, policy="specter", residency=residency),
               "compiled": specter.load(None, policy="specter", residency=residency, compile=True),
               "on-demand": specter.load(None, policy="on-demand", residency=residency)}
    dec = engines["sync-free"].decoder
    dec.draft_step = _compiled_draft_step(dec.model, dec.draft, compile=False)
    try:
        for e in engines.values():
            e.generate(DEFAULT_PROMPTS[0], max_new_tokens=8, temperature=0.0)
        decode = {k: 0.0 for k in engines}
        tokens = {k: 0 for k in engines}
        draft = {k: 0.0 for k in engines}
        for _ in range(repeat):
            for prompt in DEFAULT_PROMPTS:
                for name, e in engines.items():
                    s = e.generate(prompt, max_new_tokens=max_new, temperature=0.0).stats
                    n = s["new_tokens"] - 1
                    decode[name] += s["tpot_s"] * n
                    tokens[name] += n
                    draft[name] += s["draft_s"]
        return {name: dict(tpot_ms=decode[name] / tokens[name] * 1e3, draft_share=draft[name] / decode[name])
                for name in engines}
    finally:
        for e in engines.values():
            e.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--residency", type=float, nargs="+", default=[0.25, 0.5])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    for r in args.residency:
        m = measure(r, args.repeat, args.max_new_tokens)
        print(f"residency {r:g}: on-demand {m['on-demand']['tpot_ms']:.2f} ms; specter: eager draft "
              + ", ".join(f"{name} {m[name]['tpot_ms']:.2f} ms (draft {m[name]['draft_share']:.0%})"
                          for name in ("eager", "sync-free", "compiled"))
              + f"; sync-free/eager {m['sync-free']['tpot_ms'] / m['eager']['tpot_ms']:.3f}, "
              f"compiled/eager {m['compiled']['tpot_ms'] / m['eager']['tpot_ms']:.3f}")


if __name__ == "__main__":
    main()
