"""What the sampling controls cost: the sampling arithmetic of one K = 32 speculative cycle (a
33-row verification plus 32 single-row draft steps) with min-p only and with penalties + min-p,
at the default model's vocabulary and at Qwen's (151936), one thread, side by side. With
--end-to-end, also `specter` at residency 0.25 on the bundled model (bench prompts, 64 greedy
tokens) with and without penalties: acceptance and bytes copied, which the changed text moves.

    python bench/experiments/penalty_cost.py [--end-to-end]
"""
import argparse
import time

import torch

from specter.sampling import History, SamplingParams, probs

PENALTIES = dict(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.3)


def cycle_ms(V: int, params: SamplingParams, reps: int = 10) -> float:
    hist = History(list(range(50)), "cpu") if params.penalized else None  # a 50-token prompt
    if hist is not None:
        hist.commit(list(range(100, 164)))           # 64 generated tokens
    verify, step, drafted = torch.randn(33, V), torch.randn(1, V), list(range(200, 232))
    t0 = time.perf_counter()
    for _ in range(reps):
        probs(verify, params, hist, drafted)
        for i in range(32):
            probs(step, params, hist, drafted[:i])
    return (time.perf_counter() - t0) / reps * 1e3


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--end-to-end", action="store_true", help="also the bundled model's end-to-end run")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for V in (4096, 151936):
        plain = cycle_ms(V, SamplingParams(temperature=1.0, min_p=0.05))
        pen = cycle_ms(V, SamplingParams(temperature=1.0, min_p=0.05, **PENALTIES))
        print(f"V={V:>6}: min-p only {plain:6.2f} ms a cycle, penalties + min-p {pen:6.2f} ms ({pen / plain:.2f}x)")

    if args.end_to_end:
        import specter
        from specter.bench import DEFAULT_PROMPTS

        engine = specter.load(None, policy="specter", residency=0.25)
        try:
            for name, kw in [("plain", {}), ("penalties", PENALTIES)]:
                outs = [engine.generate(p, max_new_tokens=64, **kw).stats for p in DEFAULT_PROMPTS]
                total = {k: sum(s[k] for s in outs) for k in ("accepted_tokens", "drafted_tokens", "h2d_bytes")}
                print(f"{name:<9}: accepted/drafted {total['accepted_tokens']}/{total['drafted_tokens']}, "
                      f"H2D {total['h2d_bytes'] / 1e6:.0f} MB")
        finally:
            engine.close()
