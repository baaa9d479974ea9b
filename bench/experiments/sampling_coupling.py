"""How often a drafted token is kept under sampling: rejection sampling's rule (sum_x min(p_x, q_x))
against the coupled draws the engine uses (the draft and the target draw a position's token with the
same Exp(1) noise: sum_x 1 / sum_y max(p_y / p_x, q_y / q_x), sampling.py). Teacher-forced over two
texts (Specter's own source and README) with the bundled model (target, residency 1) and its INT4
draft, at three sampling settings; both figures are exact expectations at each position, averaged.

    python bench/experiments/sampling_coupling.py
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

import specter
from specter.layers import KVCache
from specter.sampling import SamplingParams, probs

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [ROOT / "specter" / "engine.py", ROOT / "README.md"]
SETTINGS = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.95, top_k=50), dict(temperature=0.3)]


def coupled(p: torch.Tensor, q: torch.Tensor) -> float:
    """P(argmax(p / E) == argmax(q / E)) for one position, E ~ Exp(1) iid."""
    both = ((p > 0) & (q > 0)).nonzero()[:, 0]
    union = ((p > 0) | (q > 0)).nonzero()[:, 0]
    if not len(both):
        return 0.0
    r = torch.maximum(p[union][None, :] / p[both][:, None], q[union][None, :] / q[both][:, None])
    return float((1.0 / r.sum(-1)).sum())


def main() -> None:
    engine = specter.load(None, device="cpu", policy="specter", residency=1.0)
    model, target, draft = engine.decoder.model, engine.decoder.experts, engine.decoder.draft
    logits = []
    for path in TEXTS:
        ids = torch.tensor(engine.encode(path.read_text()[:3000])[:400])
        pair = []
        for experts in (target, draft):
            cache = KVCache(model.spec, len(ids), "cpu", engine.dtype)
            pair.append(model(ids, 0, cache, experts, logits_for="all"))
        logits.append(pair)
    engine.close()
    print(f"{'setting':<50} {'rejection':>10} {'coupled':>8} {'positions':>9}")
    for kw in SETTINGS:
        params = SamplingParams(**kw)
        rej = cp = n = 0.0
        for lp, lq in logits:
            p, q = probs(lp, params), probs(lq, params)
            rej += float(torch.minimum(p, q).sum())
            cp += sum(coupled(p[i], q[i]) for i in range(p.shape[0]))
            n += p.shape[0]
        print(f"{str(kw):<50} {rej / n:>10.4f} {cp / n:>8.4f} {int(n):>9}")


if __name__ == "__main__":
    # no options: the parser gives --help and refuses stray arguments before minutes of work
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
