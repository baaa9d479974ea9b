"""Sampling parameters and the logits -> probabilities transform.

`probs` applies temperature, top-k and top-p the same way to any distribution, so speculative
acceptance can filter the draft's and the target's distributions identically.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 = greedy
    top_p: float = 1.0         # nucleus mass kept, in (0, 1]
    top_k: int = 0             # 0 = off
    seed: int | None = None

    def __post_init__(self):
        t, p, k, s = self.temperature, self.top_p, self.top_k, self.seed
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ConfigError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 < p <= 1):
            raise ConfigError(f"top_p must be in (0, 1], got {p!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        if s is not None and (isinstance(s, bool) or not isinstance(s, int)):
            raise ConfigError(f"seed must be an integer or None, got {s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def generator(self, device) -> torch.Generator | None:
        if self.greedy:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed if self.seed is not None else torch.seed())
        return g


def probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> filtered probabilities [N, V] (fp32). Greedy params give one-hot rows."""
    logits = logits.float()
    if p.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    out = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(out, dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p           # mass of strictly more likely tokens
        drop = torch.zeros_like(out, dtype=torch.bool).scatter(-1, order, before >= p.top_p)
        out = out.masked_fill(drop, 0.0)
        out = out / out.sum(-1, keepdim=True)
    return out


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
    """logits [N, V] -> token ids [N] (int64)."""
    if p.greedy:
        return logits.argmax(-1)
    return torch.multinomial(probs(logits, p), 1, generator=gen)[:, 0]
