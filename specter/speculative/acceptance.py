"""Acceptance: which drafted tokens the target keeps.

Greedy: the longest prefix of drafted tokens equal to the target's argmax, plus the target's own
next token -- exactly the tokens of plain greedy decoding.
Sampling: standard speculative rejection sampling. Drafted token x_i (drawn from q_i) is accepted
with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the token is resampled from
normalise(max(p_i - q_i, 0)); if every token is accepted, one more is drawn from p_K. The output is
distributed exactly as the target's p (p and q already have penalties, temperature, top-k, top-p
and min-p applied alike, each row with its own history: the committed tokens plus drafted[:i]).
"""
from __future__ import annotations

import torch


def accept_greedy(drafted: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """drafted [K], target_logits [K+1, V] -> (n accepted, the target's next token)."""
    best = target_logits.argmax(-1).tolist()  # one host read
    n = 0
    while n < len(drafted) and drafted[n] == best[n]:
        n += 1
    return n, best[n]


def accept_sampling(drafted: list[int], q: torch.Tensor, p: torch.Tensor, gen: torch.Generator | None
                    ) -> tuple[int, int]:
    """drafted [K], q [K, V] draft probs, p [K+1, V] target probs -> (n accepted, next token)."""
    K = len(drafted)
    if K:
        idx = torch.tensor(drafted, device=p.device)
        rows = torch.arange(K, device=p.device)
        ratio = (p[rows, idx] / q[rows, idx]).clamp(max=1.0)             # [K]
        u = torch.rand(K, generator=gen, device=p.device)
        rejected = (u >= ratio).tolist()
        for i in range(K):
            if rejected[i]:
                residual = (p[i] - q[i]).clamp(min=0)
                if residual.sum() <= 0:  # p == q where it matters: any p-sample is exact
                    residual = p[i]
                tok = torch.multinomial(residual / residual.sum(), 1, generator=gen)
                return i, int(tok)
    return K, int(torch.multinomial(p[K], 1, generator=gen))


def accept_on_device(tokens: torch.Tensor, target_logits: torch.Tensor, q: torch.Tensor | None, params,
                     gen: torch.Generator | None) -> tuple[int, int, list[int]]:
    """Both rules above computed on the device, then one host read.

    tokens [K+1] (pending token, then the K drafted), target_logits [K+1, V], q [K, V] (sampling)
    -> (n accepted, next token, the accepted drafted tokens). Sampling draws every row's
    replacement token at once (argmax(r / Exp(1)) is an exact draw from r normalised) and keeps
    the one at the first rejection, so the output has the same distribution as accept_sampling."""
    from ..sampling import probs

    K = tokens.shape[0] - 1
    drafted = tokens[1:]                                                   # [K]
    if params.greedy:
        best = target_logits.argmax(-1)                                    # [K+1]
        m = (best[:K] == drafted).to(torch.int64).cumprod(0).sum()         # 0-d: accepted prefix
        nxt = best.gather(0, m.view(1))
    else:
        p = probs(target_logits, params)                                   # [K+1, V]
        rows = torch.arange(K, device=p.device)
        ratio = (p[rows, drafted] / q[rows, drafted]).clamp(max=1.0)       # [K]
        u = torch.rand(K, generator=gen, device=p.device)
        m = (u < ratio).to(torch.int64).cumprod(0).sum()
        residual = (p[:K] - q).clamp(min=0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:K])  # p == q: any p-sample
        choices = torch.cat((residual, p[K:]))                             # [K+1, V]
        noise = torch.empty_like(choices).exponential_(generator=gen)
        nxt = (choices / noise).argmax(-1).gather(0, m.view(1))
    host = torch.cat((drafted, m.view(1), nxt)).tolist()                   # the one read
    m = host[K]
    return m, host[K + 1], host[:m]
