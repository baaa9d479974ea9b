"""Shared by the speculative decoding tests (test_spec_*.py): tiny-checkpoint engines on a fast
emulated link, plain decoding's reference tokens, and the chi-square helpers of the statistical tests.
No timing asserts: the engine tests use a fast emulated link (copies still in flight while layers
compute) instead of the calibrated one, which only changes how long runs take, never their tokens.
"""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

import specter
import specter.builder as builder
import specter.speculative.decoder as decoder_mod
from specter.layers import KVCache
from specter.moe import ExpertWeights, ResidentExperts
from specter.offload.link import EmulatedLink
from specter.offload.manager import OffloadedExperts
from specter.sampling import SamplingParams, probs
from specter.sampling import accept_greedy, accept_on_device
from specter.speculative.draft import DraftExperts, Lookahead, PrefetchPlanner
from specter.speculative.governor import Governor

ARCHS = ["qwen3_moe", "deepseek_v2", "mixtral"]
PROMPTS = [[1, 5, 9, 33, 2], [7, 7, 7], [100, 3, 64, 12, 90, 45, 8]]
NEW = 32
# residency -> (K_max values for the adaptive governor, K values forced with a fixed governor, K_max values
# for spec-lru): every K at the tightest budget, a few elsewhere (the run time is mostly these generations)
GREEDY_GRID = {0.25: ((1, 3, 6), (1, 2, 3, 4, 5, 6), (6, 2)), 0.5: ((6,), (2, 5), (6,)), 1.0: ((3,), (4,), (6,))}
P_FALSE_ALARM = 1e-3   # every statistical test below rejects a correct implementation with this probability


# ------------------------------------------------------------------------------------------------ helpers
def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df): the regularised upper incomplete gamma Q(df/2, stat/2)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chi2_gof(counts: Counter, expected_p: dict, n: int) -> tuple[float, int, float]:
    """Pearson goodness of fit of `counts` (n samples) against probabilities `expected_p`.

    A sample outside the support of `expected_p` fails at once (an exact check). The least likely
    cells are pooled until the pool expects >= 5 samples and every remaining cell does too, so the
    chi-square approximation holds. Returns (statistic, degrees of freedom, p-value)."""
    outside = set(counts) - {c for c, q in expected_p.items() if q > 0}
    assert not outside, f"samples outside the target's support: {sorted(outside)}"
    assert sum(counts.values()) == n and abs(sum(expected_p.values()) - 1) < 1e-4
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for c, q in sorted(expected_p.items(), key=lambda cq: cq[1]):
        if pool_e < 5 or q * n < 5:
            pool_o, pool_e = pool_o + counts.get(c, 0), pool_e + q * n
        else:
            obs.append(counts.get(c, 0))
            exp.append(q * n)
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(obs) - 1
    return stat, df, chi2_sf(stat, df)


@pytest.fixture
def fast_link(monkeypatch):
    """Engines built in the test get a fast EmulatedLink instead of the calibrated (slow) one: a tiny
    expert (~25 KB) takes ~0.45 ms, so copies are in flight while layers compute, but runs stay short."""
    made = []

    def make_link(device, profile=None, **kw):
        link = EmulatedLink(100e6, 2e-4, name="test")
        made.append(link)
        return link

    monkeypatch.setattr(builder, "make_link", make_link)
    yield made
    for link in made:
        link.close()


def load(path, policy, **kw):
    return specter.load(path, device="cpu", policy=policy, **kw)


@pytest.fixture(scope="module")
def resident_tokens(tiny):
    done = {}

    def get(arch):
        if arch not in done:
            path, _ = tiny(arch, eos_token_id=None)
            engine = load(path, "resident")
            try:
                done[arch] = [engine.generate(p, max_new_tokens=NEW).token_ids for p in PROMPTS]
            finally:
                engine.close()
            # not degenerate (comparing against it can fail): full length, many distinct tokens
            assert all(len(t) == NEW for t in done[arch]) and len({t for ts in done[arch] for t in ts}) > 10
        return done[arch]

    return get


def gen_all(engine, prompts=PROMPTS, n=NEW):
    """Greedy continuations (explicitly: a model's generation_config.json may say to sample)."""
    return [engine.generate(p, max_new_tokens=n, temperature=0.0) for p in prompts]


def k_histogram(outs) -> Counter:
    hist = Counter()
    for o in outs:
        hist.update(o.stats["k_histogram"])
    return hist


def total(outs, key):
    return sum(o.stats[key] for o in outs)
