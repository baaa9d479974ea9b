"""Acceptance: which drafted tokens the target keeps, and that sampling stays the target's distribution.

Greedy acceptance is the longest matching prefix plus the target's token. Sampled: `accept_sampling`
(and its on-device twin) is driven directly with a fixed target p and a deliberately poor draft q;
the emitted tokens follow p (chi-square goodness of fit, false-alarm rate 1e-3 per test, fixed
seeds, so the outcome is deterministic). End to end (slow), the first three tokens of the `specter`
engine (K fixed) over 300 seeds follow the target's exact joint distribution computed from the
resident model, with penalties and min-p too. Also the acceptance figures (alpha, efficiency).
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
from specter.sampling import accept_greedy, accept_on_device, accept_sampling
from specter.speculative.draft import DraftExperts, Lookahead, PrefetchPlanner
from specter.speculative.governor import Governor

from speculative_common import *  # noqa: F401,F403 -- constants, helpers and fixtures of these tests
from speculative_common import fast_link, resident_tokens  # noqa: F401 -- fixtures


def test_chi2_sf_matches_tables():
    # scipy is not installed; chi2.ppf(0.999, df) from the standard tables: df=1 10.828, df=4 18.467,
    # df=8 26.124, df=26 54.052. The survival function at those points must be 1e-3.
    for df, crit in [(1, 10.828), (4, 18.467), (8, 26.124), (26, 54.052)]:
        assert chi2_sf(crit, df) == pytest.approx(1e-3, rel=2e-3), df




def test_accept_greedy_unit():
    V = 6
    logits = torch.full((4, V), -1.0)
    for i, best in enumerate([2, 4, 1, 5]):
        logits[i, best] = 1.0
    assert accept_greedy([2, 4, 1], logits) == (3, 5)   # all accepted + the target's bonus token
    assert accept_greedy([2, 0, 1], logits) == (1, 4)   # first mismatch at 1: the target's token there
    assert accept_greedy([3, 4, 1], logits) == (0, 2)
    assert accept_greedy([], logits[:1]) == (0, 2)


def test_acceptance_stats_alpha_and_efficiency():
    """Two cycles of K = 4: all four accepted, then one accepted and the second rejected (two never tried)."""
    from specter.speculative.decoder import acceptance_stats
    s = acceptance_stats(accepted=5, drafted=8, rejections=1, spec_cycles=2)
    assert s == dict(acceptance_rate=5 / 6, draft_efficiency=5 / 8, accepted_per_cycle=2.5)
    assert acceptance_stats(0, 0, 0, 0) == dict(acceptance_rate=None, draft_efficiency=None, accepted_per_cycle=None)




# -------------------------------------------------------------------------------------- 2. lossless sampling
P_TARGET = torch.tensor([[0.40, 0.25, 0.15, 0.12, 0.08],
                         [0.10, 0.15, 0.20, 0.25, 0.30],
                         [0.30, 0.10, 0.30, 0.10, 0.20]])
Q_POOR = torch.tensor([[0.02, 0.03, 0.05, 0.10, 0.80],     # mass where p has little, none where p has most
                       [0.70, 0.00, 0.00, 0.30, 0.00],
                       [0.00, 0.90, 0.00, 0.00, 0.10]])


def accept_on_device_as_lists(drafted, q, p, gen):
    """accept_on_device (the sync-free draft's rule) behind accept_sampling's signature: the target
    logits log p give back p under temperature 1."""
    tokens = torch.tensor([0] + list(drafted), device=p.device)
    m, nxt, accepted = accept_on_device(tokens, p.log(), q, SamplingParams(temperature=1.0), gen)
    assert accepted == list(drafted[:m])
    return m, nxt


def run_acceptance(K: int, q: torch.Tensor, p: torch.Tensor, n: int, seed: int, device="cpu",
                   accept=accept_sampling):
    """n independent cycles: draft K tokens from q, accept against p. Returns the emitted token lists."""
    q, p = q.to(device), p.to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen) for i in range(K)], 1) \
        if K else torch.zeros(n, 0, dtype=torch.long, device=device)
    out = []
    for row in drafts.tolist():
        m, nxt = accept(row, q[:K], p[:K + 1], gen)
        assert 0 <= m <= K
        out.append(row[:m] + [nxt])
    return out


def assert_fits(counts: Counter, p_row: torch.Tensor, n: int, what: str):
    stat, df, pv = chi2_gof(counts, dict(enumerate(p_row.tolist())), n)
    assert pv > P_FALSE_ALARM, f"{what}: chi2={stat:.1f} df={df} p={pv:.2e}, counts {sorted(counts.items())}"


def test_accept_sampling_first_token_follows_target(device):
    """K=1, V=5, a draft far from the target: the emitted token is distributed as p[0]."""
    n = 20000
    outs = run_acceptance(1, Q_POOR, P_TARGET, n, seed=1234, device=device)
    assert_fits(Counter(o[0] for o in outs), P_TARGET[0], n, "first token")
    # the acceptance rate is sum_x min(p(x), q(x)) (binomial: a 5-sigma band)
    acc = sum(len(o) == 2 for o in outs) / n
    a = float(torch.minimum(P_TARGET[0], Q_POOR[0]).sum())
    assert abs(acc - a) < 5 * math.sqrt(a * (1 - a) / n), (acc, a)
    # the bonus token after an acceptance is drawn from p[1]
    second = [o[1] for o in outs if len(o) == 2]
    assert_fits(Counter(second), P_TARGET[1], len(second), "bonus token")


@pytest.mark.parametrize("accept", [accept_sampling, accept_on_device_as_lists], ids=["host", "on-device"])
def test_accept_sampling_multi_position_follows_target(device, accept):
    """K=2: the first emitted token ~ p[0]; given one was accepted, the next ~ p[1] (accepted draft,
    residual resample or never reached); given two, the bonus ~ p[2]. Both rules: the host one and
    the sync-free draft's (all rows' replacements drawn at once by argmax(r / Exp(1)))."""
    n = 12000
    outs = run_acceptance(2, Q_POOR, P_TARGET, n, seed=99, device=device, accept=accept)
    assert_fits(Counter(o[0] for o in outs), P_TARGET[0], n, "K=2 token 0")
    second = [o[1] for o in outs if len(o) >= 2]
    assert len(second) > 1000
    assert_fits(Counter(second), P_TARGET[1], len(second), "K=2 token 1")
    third = [o[2] for o in outs if len(o) == 3]
    assert len(third) > 100  # P(both accepted) = 0.27 * 0.4
    assert_fits(Counter(third), P_TARGET[2], len(third), "K=2 token 2")


def test_accept_sampling_power_and_edge_cases(device):
    """The same test rejects a sampler that keeps the draft's token; p == q accepts everything."""
    n = 20000
    gen = torch.Generator().manual_seed(7)
    naive = torch.multinomial(Q_POOR[0], n, replacement=True, generator=gen).tolist()
    _, _, pv = chi2_gof(Counter(naive), dict(enumerate(P_TARGET[0].tolist())), n)
    assert pv < P_FALSE_ALARM
    # identical distributions: every drafted token is accepted
    outs = run_acceptance(2, P_TARGET, P_TARGET, 500, seed=3, device=device)
    assert all(len(o) == 3 for o in outs)
    # K = 0: a plain sample from p[0]
    outs = run_acceptance(0, P_TARGET, P_TARGET, 4000, seed=5, device=device)
    assert_fits(Counter(o[0] for o in outs), P_TARGET[0], 4000, "K=0")
    # a draft token the target gives probability 0 is always rejected, and the replacement is in p's support
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], device=device)
    q = torch.tensor([[0.0, 0.0, 1.0]], device=device)
    gen = torch.Generator(device=device).manual_seed(11)
    for _ in range(200):
        m, nxt = accept_sampling([2], q, p, gen)
        assert m == 0 and nxt in (0, 1)


SAMPLE = dict(temperature=1.0, top_k=3)   # top-k applies to draft and target alike; 3^3 = 27 outcomes
# penalties and min-p: history-dependent, so every drafted position must see its own prefix
PENALIZED = dict(SAMPLE, repetition_penalty=1.8, presence_penalty=0.6, frequency_penalty=0.9, min_p=0.2)


def target_probs(model, experts, ids: list[int], n_prompt: int, kw: dict) -> torch.Tensor:
    """The target's next-token probabilities after `ids`, processed by a reference written out here
    (independent of specter.sampling's history tensors): penalties over prompt / generated tokens,
    then temperature, top-k, min-p."""
    cache = KVCache(model.spec, len(ids) + 1, "cpu", torch.float32)
    logits = model(torch.tensor(ids), 0, cache, experts, logits_for="last")[0].clone()
    r = kw.get("repetition_penalty", 1.0)
    for t in set(ids):
        logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r
    generated = Counter(ids[n_prompt:])
    for t, c in generated.items():
        logits[t] -= kw.get("frequency_penalty", 0.0) * c + kw.get("presence_penalty", 0.0)
    logits = logits / kw["temperature"]
    logits[logits < torch.topk(logits, kw["top_k"]).values[-1]] = float("-inf")
    p = torch.softmax(logits, -1)
    p[p < kw.get("min_p", 0.0) * p.max()] = 0
    return p / p.sum()


def exact_joint(model, experts, prompt: list[int], depth: int, kw: dict) -> dict:
    """The target's exact distribution of its first `depth` sampled tokens: {(t1, .., td): P}."""
    out = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, pr in out.items():
            row = target_probs(model, experts, prompt + list(prefix), len(prompt), kw)
            for t in torch.nonzero(row).flatten().tolist():
                nxt[prefix + (t,)] = pr * float(row[t])
        out = nxt
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kw", [SAMPLE, PENALIZED], ids=["top-k", "penalties+min-p"])
def test_speculative_sampling_matches_target_end_to_end(tiny, fast_link, kw):
    """The first three tokens of `specter` (K fixed at 2, then 1: both come from speculation) over
    300 seeds follow the target's exact joint distribution; a `resident` run over the same seeds is
    the control. Same seed -> the same first token (sampled from prefill, before any speculation).
    With penalties the target's distribution at each drafted position depends on the drafted tokens
    before it: a decoder that penalised the draft and the target differently would fail here."""
    path, _ = tiny("qwen3_moe", eos_token_id=None)
    prompt, n, depth = [1, 5, 9, 33, 2], 300, 3
    res = load(path, "resident")
    spec = load(path, "specter", residency=0.5, k_max=4)
    try:
        joint = exact_joint(res.model, res.decoder.experts, prompt, depth, kw)
        assert sum(joint.values()) == pytest.approx(1.0, abs=1e-5)
        if kw is SAMPLE:
            assert len(joint) == 27
        else:  # the penalties move real mass: the test would catch their absence
            plain = exact_joint(res.model, res.decoder.experts, prompt, depth, SAMPLE)
            tv = sum(abs(joint.get(c, 0) - plain.get(c, 0)) for c in set(joint) | set(plain)) / 2
            assert tv > 0.3, tv
        spec.decoder.governor = Governor(4, fixed=4)
        got_spec, got_res = Counter(), Counter()
        drafted = accepted = 0
        for seed in range(n):
            a = spec.generate(prompt, max_new_tokens=depth + 1, seed=seed, **kw)
            b = res.generate(prompt, max_new_tokens=depth, seed=seed, **kw)
            assert a.token_ids[0] == b.token_ids[0], seed
            assert a.stats["k_histogram"].get(2) == 1, a.stats["k_histogram"]  # the first cycle speculated
            drafted += a.stats["drafted_tokens"]
            accepted += a.stats["accepted_tokens"]
            got_spec[tuple(a.token_ids[:depth])] += 1
            got_res[tuple(b.token_ids[:depth])] += 1
    finally:
        spec.close()
        res.close()
    # both paths ran: acceptances, and >= 25 rejections (each discards at most K = 2 drafted tokens)
    assert accepted > 0.5 * drafted and drafted - accepted >= 50, (accepted, drafted)
    for name, got in [("resident", got_res), ("specter", got_spec)]:
        stat, df, pv = chi2_gof(got, joint, n)
        assert pv > P_FALSE_ALARM, f"{name}: chi2={stat:.1f} df={df} p={pv:.2e}"
