"""What compiling buys end to end (compile=True: the draft step and the piecewise verifier), side by side.

`specter bench` puts policies side by side; this puts the same policy four ways -- the eager draft,
the sync-free draft step run eagerly, the compiled draft step with the eager verifier, and both
compiled -- plus on-demand for scale, alternating prompts in one process so machine load hits all
alike. The last two are one engine with its compiled verifier switched off and on per prompt.
Greedy tokens of every variant are compared with eager plain decoding (`resident`).

    python bench/compile_speedup.py [--residency 0.25 0.5] [--repeat 3] [--max-new-tokens 64]

What it measured, with dates: docs/RESULTS.md (builder and CLI defaults).
"""
from __future__ import annotations

import argparse
import time

import specter
from specter.bench import DEFAULT_PROMPTS
from specter.builder import _compiled_draft_step

NAMES = ("eager", "sync-free", "compiled draft", "compiled draft+verify")


def measure(residency: float, repeat: int, max_new: int) -> dict:
    t0 = time.perf_counter()
    both = specter.load(None, policy="specter", residency=residency, compile=True)
    load_s = time.perf_counter() - t0
    engines = {"eager": specter.load(None, policy="specter", residency=residency),
               "sync-free": specter.load(None, policy="specter", residency=residency),
               "compiled draft": both, "compiled draft+verify": both,
               "on-demand": specter.load(None, policy="on-demand", residency=residency)}
    plain = specter.load(None, policy="resident")
    dec = engines["sync-free"].decoder
    dec.draft_step = _compiled_draft_step(dec.model, dec.draft, compile=False)
    verify = both.decoder.verify_step
    try:
        for e in engines.values():
            e.generate(DEFAULT_PROMPTS[0], max_new_tokens=8, temperature=0.0)
        decode, tokens, draft, ver, same, runs = ({k: 0 for k in engines} for _ in range(6))
        for _ in range(repeat):
            for prompt in DEFAULT_PROMPTS:
                ref = plain.generate(prompt, max_new_tokens=max_new, temperature=0.0).token_ids
                for name, e in engines.items():
                    if e is both:
                        both.decoder.verify_step = verify if name.endswith("verify") else None
                    out = e.generate(prompt, max_new_tokens=max_new, temperature=0.0)
                    s, n = out.stats, out.stats["new_tokens"] - 1
                    decode[name] += s["tpot_s"] * n
                    tokens[name] += n
                    draft[name] += s["draft_s"]
                    ver[name] += s["verify_s"]
                    same[name] += out.token_ids == ref
                    runs[name] += 1
        both.decoder.verify_step = verify
        return dict(load_s=load_s, **{name: dict(tpot_ms=decode[name] / tokens[name] * 1e3,
                                                 draft_share=draft[name] / decode[name],
                                                 verify_share=ver[name] / decode[name],
                                                 same=f"{same[name]}/{runs[name]}") for name in engines})
    finally:
        for e in {id(e): e for e in list(engines.values()) + [plain]}.values():
            e.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--residency", type=float, nargs="+", default=[0.25, 0.5])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    for r in args.residency:
        m = measure(r, args.repeat, args.max_new_tokens)
        eager = m["eager"]["tpot_ms"]
        print(f"residency {r:g} (compile at load {m['load_s']:.0f} s): on-demand {m['on-demand']['tpot_ms']:.2f} ms")
        for name in NAMES:
            print(f"  {name:<22} TPOT {m[name]['tpot_ms']:6.2f} ms  x{m[name]['tpot_ms'] / eager:.3f} of eager  "
                  f"draft {m[name]['draft_share']:.0%}  verify {m[name]['verify_share']:.0%}  "
                  f"greedy tokens == resident: {m[name]['same']}")
        print(f"  compiled verify / eager verify (same engine): "
              f"{m['compiled draft+verify']['tpot_ms'] / m['compiled draft']['tpot_ms']:.3f}", flush=True)


if __name__ == "__main__":
    main()
