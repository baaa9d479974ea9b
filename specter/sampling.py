"""Sampling parameters and the logits -> probabilities transform.

One pipeline, applied the same way to any distribution so speculative acceptance sees the draft's
and the target's distributions processed identically:

    logits [N, V] -> penalties (repetition, presence, frequency; from the token history)
                  -> temperature -> top-k -> top-p -> min-p -> probabilities [N, V]

Greedy parameters take the argmax of the penalised logits. Penalties read a `History`: the prompt
and every committed token, plus, for row i of a multi-row call, the drafted tokens before it. A
generation with no penalty set keeps none (history None).
As OpenAI and vLLM define them, `presence_penalty` / `frequency_penalty` count generated tokens
only and `repetition_penalty` (the CTRL / Hugging Face one) covers the prompt too.

Which keywords a generation samples with (`choose`: the caller's or the model's defaults) and their
short human summary (`describe`) are here too.

Random draws (`Draws`): a sampled token is the exponential race argmax(p / E), E a row of Exp(1)
noise (E_x / p_x is Exp(p_x), and the smallest of independent exponentials is the x-th with
probability p_x: an exact draw from p). A generation's row for position j is a function of its seed
and j alone, so the token at position j is the same whichever step draws it.

Acceptance (`accept_prefix`, `accept_greedy`, `accept_on_device`): which drafted tokens the target
keeps. One rule: the longest prefix of drafted tokens equal to the target's own token at each row,
plus the target's token after it. Greedy: the target's token is its argmax. Sampling: its draw with
the row's position's noise, argmax(p_i / E_j); the draft drew its token for position j with the
same noise (argmax(q_i / E_j)), so a drafted token is kept exactly when both draws agree. The output
is token for token what plain decoding draws with that seed, whatever K the governor picks (p and
q have penalties, temperature, top-k, top-p and min-p applied alike, each row with its own
history: the committed tokens plus drafted[:i]). This coupling keeps a drafted token with
probability sum_x 1 / sum_y max(p_y / p_x, q_y / q_x), a little under rejection sampling's
sum min(p, q) (docs/RESULTS.md), which would make the tokens depend on K.
"""
from __future__ import annotations

import difflib
import math
import numbers
import secrets
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Sequence

import torch

from .errors import ConfigError, warn


GREEDY_BELOW = 1e-5  # temperatures under this are greedy (as vLLM's _SAMPLING_EPS)
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1  # what a 64-bit generator seed holds (torch's manual_seed range)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0                # nucleus mass kept, in (0, 1]
    top_k: int = 0                    # 0 = off
    seed: int | None = None           # None: a fresh seed (never from the global torch RNG)
    min_p: float = 0.0                # drop tokens below min_p x the top token's probability; 0 = off
    repetition_penalty: float = 1.0   # > 0; seen tokens' logits divided (if >= 0) or multiplied by it
    presence_penalty: float = 0.0     # [-2, 2]; subtracted once from every generated token's logit
    frequency_penalty: float = 0.0    # [-2, 2]; subtracted per occurrence among generated tokens
    # derived once (read every step): temperatures below GREEDY_BELOW are greedy (dividing logits by
    # them overflows fp32), as is top_k = 1; penalized: some penalty is set
    greedy: bool = field(init=False, repr=False, compare=False)
    penalized: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        bad = set()  # the float fields that are not a finite number
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                bad.add(name)
            elif type(v) not in (int, float):  # numpy's scalars (a sweep's values) as Python's
                object.__setattr__(self, name, float(v))
        for name in ("top_k", "seed"):
            v = getattr(self, name)
            if isinstance(v, numbers.Integral) and not isinstance(v, bool) and type(v) is not int:
                object.__setattr__(self, name, int(v))
        t, p, k, s = self.temperature, self.top_p, self.top_k, self.seed
        if "temperature" in bad or t < 0:
            raise ConfigError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if "top_p" in bad or not (0 < p <= 1):
            raise ConfigError(f"top_p must be in (0, 1], got {p!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not SEED_MIN <= s <= SEED_MAX):
            raise ConfigError(f"seed must be None or an integer in [-2**63, 2**64 - 1] (what a 64-bit generator "
                              f"seed holds), got {s!r}")
        if "min_p" in bad or not (0 <= self.min_p <= 1):
            raise ConfigError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if "repetition_penalty" in bad or self.repetition_penalty <= 0:
            raise ConfigError(f"repetition_penalty must be a number > 0 (1 = off), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if name in bad or not (-2 <= v <= 2):
                raise ConfigError(f"{name} must be in [-2, 2] (0 = off), got {v!r}")
        object.__setattr__(self, "greedy", t < GREEDY_BELOW or k == 1)
        object.__setattr__(self, "penalized", self.repetition_penalty != 1 or self.presence_penalty != 0
                           or self.frequency_penalty != 0)

    def draws(self, device) -> Draws | None:
        """A generation's random draws (None: greedy), from the seed (None: a fresh one)."""
        return None if self.greedy else Draws(self.seed, device)


_MASK = 2 ** 64 - 1


def fresh_seed() -> int:
    """A seed for a generation given none: 53 random bits (exact as a JSON number, for a server's stats)."""
    return secrets.randbits(53)


def _mix(z: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit words in which every input bit moves every output bit."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
    return z ^ (z >> 31)


class Draws:
    """A sampled generation's randomness: for the token at position j, a row of Exp(1) noise [V] that
    is a function of (seed, j) alone (`fill`, `rows`); the token is argmax(p / row). A generator is
    reseeded per row from a mix of both, so seeds that differ only in high bits draw differently. (torch's
    CPU generator keeps 32 bits of a seed: two of N rows share their noise with chance ~N^2 / 2^33.)"""

    def __init__(self, seed: int | None, device):
        self.seed = secrets.randbits(64) if seed is None else seed & _MASK  # (never the global torch RNG)
        self._key = _mix(self.seed)  # mixed first: seed + c x position alone made seed s + c's rows s's, shifted
        self.gen = torch.Generator(device=device)

    def fill(self, out: torch.Tensor, pos: int) -> torch.Tensor:
        """out [V] (fp32) <- position `pos`'s noise, in place (no host sync)."""
        self.gen.manual_seed(_mix((self._key + 0x9E3779B97F4A7C15 * (pos + 1)) & _MASK))
        return out.exponential_(generator=self.gen).clamp_(min=torch.finfo(out.dtype).tiny)  # (never 0: p / 0)

    def rows(self, pos: int, n: int, V: int) -> torch.Tensor:
        """[n, V] fp32: the noise of positions pos .. pos + n - 1."""
        out = torch.empty(n, V, dtype=torch.float32, device=self.gen.device)
        for i in range(n):
            self.fill(out[i], pos + i)
        return out


class History:
    """The tokens penalties look at: the prompt's (a set) and the generated tokens' counts, on the host
    (commits are a few ints a cycle, never a device read). Penalties touch only these U columns of
    the logits, never all V: U is the prompt plus the output, V may be 150k."""

    def __init__(self, prompt: Sequence[int], device):
        self.device = device
        self.prompt = set(prompt)
        self.counts: Counter = Counter()
        self._base = None  # (token ids, column of each id, seen [U], counts [U]) of the committed history

    def commit(self, tokens: Sequence[int]) -> None:
        if tokens:
            self.counts.update(tokens)
            self._base = None

    def _committed(self):
        if self._base is None:
            ids = sorted(self.prompt | set(self.counts))
            seen = torch.tensor([t in self.prompt for t in ids], dtype=torch.bool)
            counts = torch.tensor([float(self.counts[t]) for t in ids])
            self._base = (ids, {t: c for c, t in enumerate(ids)}, seen.to(self.device), counts.to(self.device))
        return self._base

    def rows(self, n: int, pending: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids [U], seen [n, U], counts [n, U]) for the last n positions: the last row's history
        includes all of `pending` (uncommitted drafted tokens), row i its first len(pending) - n + 1 + i."""
        ids, col, seen, counts = self._committed()
        extra = [t for t in dict.fromkeys(pending) if t not in col]
        if extra:
            col = {**col, **{t: len(ids) + j for j, t in enumerate(extra)}}
            ids = ids + extra
            seen = torch.cat([seen, seen.new_zeros(len(extra))])
            counts = torch.cat([counts, counts.new_zeros(len(extra))])
        counts = counts.expand(n, -1)
        P = len(pending)
        if P:
            dev = counts.device
            cols = torch.tensor([col[t] for t in pending], device=dev).expand(n, P)              # [n, P]
            upto = torch.arange(n, device=dev)[:, None] + (P - n + 1)
            w = (torch.arange(P, device=dev)[None, :] < upto).float()                          # [n, P]
            counts = counts.scatter_add(1, cols, w)
        return torch.tensor(ids, device=counts.device), seen | (counts > 0), counts


def penalize(logits: torch.Tensor, p: SamplingParams, history: History | None,
             pending: Sequence[int] = ()) -> torch.Tensor:
    """logits [N, V] -> logits [N, V] with repetition, frequency and presence penalties applied
    (history None: no penalty is set)."""
    if history is None:
        return logits
    ids, seen, counts = history.rows(logits.shape[0], pending)   # [U], [N, U], [N, U]
    if not len(ids):
        return logits
    out = logits.float().clone()
    sub = out[:, ids]                                              # [N, U]
    r = p.repetition_penalty
    if r != 1:
        sub = torch.where(seen, torch.where(sub < 0, sub * r, sub / r), sub)  # (0 / r: 0 * inf was NaN)
    if p.frequency_penalty:
        sub = sub - p.frequency_penalty * counts
    if p.presence_penalty:
        sub = sub - p.presence_penalty * (counts > 0).float()
    out[:, ids] = sub
    return out


def probs(logits: torch.Tensor, p: SamplingParams, history: History | None = None,
          pending: Sequence[int] = ()) -> torch.Tensor:
    """logits [N, V] -> filtered probabilities [N, V] (fp32). Greedy params give one-hot rows."""
    logits = penalize(logits, p, history, pending).float()
    if p.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # an extreme penalty can overflow a logit; +inf would make softmax NaN, so it becomes the largest finite value
    logits = torch.nan_to_num(logits / p.temperature, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    out = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(out, dim=-1, descending=True, stable=True)  # ties: one order for every
        # batch (a verification's [K+1, V] and a plain step's [1, V] keep the same tokens of a tie)
        before = sorted_p.cumsum(-1) - sorted_p           # mass of strictly more likely tokens
        drop_sorted = before >= p.top_p                    # a top_p below fp32's range compares as 0 ...
        drop_sorted[..., 0] = False                        # ... so the likeliest token is always kept
        drop = torch.zeros_like(out, dtype=torch.bool).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, 0.0)
        out = out / out.sum(-1, keepdim=True)
    if p.min_p > 0:
        out = out.masked_fill(out < p.min_p * out.amax(-1, keepdim=True), 0.0)
        out = out / out.sum(-1, keepdim=True)
    return out


def sample(logits: torch.Tensor, p: SamplingParams, draws: Draws | None, history: History | None = None,
           pending: Sequence[int] = (), pos: int = 0) -> torch.Tensor:
    """logits [N, V] -> token ids [N] (int64): row i's token for position pos + i, the argmax when
    greedy, else its draw with that position's noise (`draws`; module docstring)."""
    if p.greedy:
        return (logits if history is None else penalize(logits, p, history, pending)).argmax(-1)
    return (probs(logits, p, history, pending) / draws.rows(pos, *logits.shape)).argmax(-1)


_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.init)  # SamplingParams' keywords


def choose(sampling: dict, defaults: dict) -> tuple[SamplingParams, str]:
    """generate()'s sampling keywords -> (params, where they came from): the caller's keywords ("caller")
    when they set any sampling value (None counts as unset, a seed alone as no choice), else the model's
    defaults plus the seed ("model"; "none" when the model has none: greedy). An unknown keyword is a
    ConfigError naming it."""
    given, chosen = {}, False
    for k, v in sampling.items():
        if k not in _FIELDS:
            others = [n for n in _FIELDS + ("max_new_tokens", "stop") if n != k]
            close = difflib.get_close_matches(k, others, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown argument {k!r}{hint}; sampling arguments are {', '.join(_FIELDS)}")
        if v is not None:
            given[k] = v
            chosen = chosen or k != "seed"
    if chosen:
        params = SamplingParams(**given)
        if (idle := idle_filters(params)) and "temperature" not in given:  # the neutral temperature 0 is greedy
            warn(f"{idle} no effect without a temperature: the generation is greedy (temperature 0, the neutral "
                 f"value); give a temperature (--temperature) to sample (the model's own settings apply only when "
                 f"no sampling argument is given)")
        return params, "caller"
    return SamplingParams(**{**defaults, **given}), "model" if defaults else "none"


def idle_filters(params: SamplingParams) -> str:
    """The filters set that greedy decoding ignores, as "top_p has" / "top_p and top_k have" ("": none)."""
    if not params.greedy or params.top_k == 1:  # (top_k 1 is what makes it greedy)
        return ""
    names = [f"{n} (--{n.replace('_', '-')})" for n, on in (("top_p", params.top_p < 1), ("top_k", params.top_k > 1),
                                                          ("min_p", params.min_p > 0)) if on]
    return f"{' and '.join(names)} {'has' if len(names) == 1 else 'have'}" if names else ""


def describe(params: SamplingParams) -> str:
    """A short human summary: "greedy" or "temperature 0.7, top-p 0.95, top-k 50, repetition 1.1"."""
    p = params
    parts = ["greedy"] if p.greedy else [f"temperature {p.temperature:g}"]
    for name, v, on in (("top-p", p.top_p, not p.greedy and p.top_p < 1), ("top-k", p.top_k, not p.greedy and p.top_k > 0),
                        ("min-p", p.min_p, not p.greedy and p.min_p > 0),
                        ("repetition", p.repetition_penalty, p.repetition_penalty != 1),
                        ("presence", p.presence_penalty, p.presence_penalty != 0),
                        ("frequency", p.frequency_penalty, p.frequency_penalty != 0)):
        if on:
            parts.append(f"{name} {v:g}")
    return ", ".join(parts)


# ------------------------------------------------------------------------------------- acceptance
def accept_prefix(drafted: list[int], best: list[int]) -> tuple[int, int]:
    """drafted [K], best [K+1] (the target's token at each row) -> (n accepted, the target's next token)."""
    n = 0
    while n < len(drafted) and drafted[n] == best[n]:
        n += 1
    return n, best[n]


def accept_greedy(drafted: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """drafted [K], target_logits [K+1, V] -> (n accepted, the target's next token)."""
    return accept_prefix(drafted, target_logits.argmax(-1).tolist())  # one host read


def accept_on_device(tokens: torch.Tensor, target_logits: torch.Tensor, params: SamplingParams,
                     draws: Draws | None, pos: int) -> tuple[int, int, list[int]]:
    """accept_prefix computed on the device, then one host read (no penalties: the sync-free draft's).

    tokens [K+1] (pending token, then the K drafted), target_logits [K+1, V] for positions pos ..
    pos + K -> (n accepted, next token, the accepted drafted tokens)."""
    K = tokens.shape[0] - 1
    drafted = tokens[1:]                                                   # [K]
    best = sample(target_logits, params, draws, pos=pos)                   # [K+1] the target's tokens
    m = (best[:K] == drafted).to(torch.int64).cumprod(0).sum()             # 0-d: accepted prefix
    nxt = best.gather(0, m.view(1))
    host = torch.cat((drafted, m.view(1), nxt)).tolist()                   # the one read
    m = host[K]
    return m, host[K + 1], host[:m]
