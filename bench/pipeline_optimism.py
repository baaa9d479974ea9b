"""Could optimistic drafting (PEARL's post-verify) pay on a pipeline? Counters from one process on
the bundled model (specter, --expert-memory 9MiB, the emulated link, greedy, default prompts):
after each cycle's K drafts, one more draft step on d_K (at position n+K, which verification
overwrites, so the tokens are unchanged) gives the draft's guess of the target's bonus token. A
cycle whose K drafts are all accepted and whose bonus equals that guess is one whose next round
rank 0 could have drafted while the later ranks verified ("hit").

    python bench/pipeline_optimism.py [--k 5] [--new 64] [--rounds 1]   (--k 0: the adaptive governor)
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import specter  # noqa: E402
from specter.bench import DEFAULT_PROMPTS  # noqa: E402
from specter.sampling import SamplingParams, sample  # noqa: E402
from specter.speculative.governor import Governor  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--expert-memory", default="9MiB")
    a = ap.parse_args()
    eng = specter.load(specter.default_model_path(), device="cpu", policy="specter", expert_memory=a.expert_memory,
                       threads=1)
    dec = eng.decoder
    if a.k:
        dec.governor = Governor(32, fixed=a.k)
    draft, cycle = dec._draft, dec._cycle
    c, last = Counter(), {}

    def guessing_draft(t, n, k, cache, params, gen, hist):
        drafted, q = draft(t, n, k, cache, params, gen, hist)
        logits = dec.model(torch.tensor([drafted[-1]], device=dec.device), n + k, cache, dec.draft)
        last["guess"] = int(sample(logits, SamplingParams(temperature=0.0), None, None))
        return drafted, q

    def counted(t, n, k, *rest):
        new = cycle(t, n, k, *rest)
        m = len(new) - 1
        c["cycles"] += 1
        c["k"] += k
        c["accepted"] += m
        c["rejections"] += m < k
        c["all"] += m == k
        c["hit"] += m == k and new[-1] == last["guess"]
        c["tokens"] += len(new)
        return new

    dec._draft, dec._cycle = guessing_draft, counted
    for _ in range(a.rounds):
        for p in DEFAULT_PROMPTS:
            r = eng.generate(p, a.new, temperature=0.0)
            c["plain steps"] += r.stats["k_histogram"].get(0, 0)
            c["draft_s"] += r.stats["draft_s"]
            c["verify_s"] += r.stats["verify_s"]
            c["new"] += len(r.token_ids)
    eng.close()
    n = c["cycles"]
    print(f"K {'adaptive' if not a.k else a.k}: {n} cycles, mean K {c['k'] / n:.2f}, {c['plain steps']} plain steps; "
          f"alpha {c['accepted'] / (c['accepted'] + c['rejections']):.3f}; all K accepted {c['all']} "
          f"({c['all'] / n:.2f}); all K and bonus == draft's guess {c['hit']} ({c['hit'] / n:.2f}); "
          f"tokens a cycle {c['tokens'] / n:.2f}; draft / verify ms a token {c['draft_s'] / c['new'] * 1e3:.1f} / "
          f"{c['verify_s'] / c['new'] * 1e3:.1f}")


if __name__ == "__main__":
    main()
