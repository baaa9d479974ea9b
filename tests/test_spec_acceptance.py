"""Acceptance: which drafted tokens the target keeps, and that sampling stays the target's distribution.

Acceptance is the longest drafted prefix equal to the target's own tokens plus the target's next one.
Sampled: a cycle is driven directly with a fixed target p and a deliberately poor draft q drawing
with the generation's noise (sampling.Draws); it emits exactly the target's own draws, which follow p
(chi-square goodness of fit, false-alarm rate 1e-3 per test, fixed seeds, so the outcome is
deterministic). End to end, `specter` and `spec-lru` sampled with a seed give resident's tokens
for that seed, token for token, with penalties and min-p too; and (slow) the first three tokens over
300 seeds follow the target's exact joint distribution computed from the resident model. Also the
acceptance figures (alpha, efficiency).
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
from specter.sampling import Draws, SamplingParams, probs, sample
from specter.sampling import accept_greedy, accept_on_device, accept_prefix
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
T1 = SamplingParams(temperature=1.0)  # log p as logits gives p back


def coupled_acceptance(p: torch.Tensor, q: torch.Tensor) -> float:
    """P(argmax(p / E) == argmax(q / E)), E ~ Exp(1) iid: sum_x 1 / sum_y max(p_y / p_x, q_y / q_x)."""
    both = ((p > 0) & (q > 0)).nonzero()[:, 0].tolist()
    return sum(1.0 / float(torch.maximum(p / p[x], q / q[x]).sum()) for x in both)


def cycle(K: int, q: torch.Tensor, p: torch.Tensor, seed: int, on_device: bool, pos: int = 7):
    """One cycle as the decoder runs it: K tokens drafted from q with the generation's noise at positions
    pos .. pos+K-1, accepted against p (rows at the same positions) -> (emitted tokens, the target's own
    draws at those positions)."""
    draws = Draws(seed, p.device)
    drafted = (q[:K] / draws.rows(pos, K, q.shape[1])).argmax(-1).tolist() if K else []
    own = sample(p[:K + 1].log(), T1, draws, pos=pos).tolist()
    if on_device:
        tokens = torch.tensor([0] + drafted, device=p.device)
        m, nxt, accepted = accept_on_device(tokens, p[:K + 1].log(), T1, draws, pos)
        assert accepted == drafted[:m]
    else:
        m, nxt = accept_prefix(drafted, sample(p[:K + 1].log(), T1, draws, pos=pos).tolist())
    return drafted[:m] + [nxt], own


def assert_fits(counts: Counter, p_row: torch.Tensor, n: int, what: str):
    stat, df, pv = chi2_gof(counts, dict(enumerate(p_row.tolist())), n)
    assert pv > P_FALSE_ALARM, f"{what}: chi2={stat:.1f} df={df} p={pv:.2e}, counts {sorted(counts.items())}"


def test_draws_are_a_function_of_the_seed_and_the_position(device):
    """A row of noise depends on (seed, position) alone: however many rows a call asks for and whichever
    call asks. Seeds apart by 2**32 differ (torch's CPU generator keeps a seed's low 32 bits)."""
    V = 11
    a, b = Draws(5, device), Draws(5, device)
    rows = a.rows(0, 6, V)
    assert (rows > 0).all() and rows.dtype == torch.float32
    assert torch.equal(b.rows(3, 2, V), rows[3:5])
    assert torch.equal(a.fill(torch.empty(V, device=device), 4), rows[4])
    assert torch.equal(Draws(5 + 2 ** 64, device).rows(0, 6, V), rows)  # a seed is taken modulo 2**64
    for other in (Draws(6, device), Draws(5 + 2 ** 32, device), Draws(None, device)):
        assert not torch.equal(other.rows(0, 6, V), rows)
    assert not torch.equal(rows[0], rows[1])
    shifted = Draws(5 + 0x9E3779B97F4A7C15, device).rows(0, 5, V)  # the key's step a position: not s's rows, moved
    assert not any(torch.equal(shifted[i], rows[i + 1]) for i in range(5))


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "on-device"])
def test_a_cycle_emits_the_targets_own_draws(device, on_device):
    """K = 2, a draft far from the target: every cycle emits exactly the target's own draws at those
    positions (plain decoding's tokens), cut after the first drafted token it does not draw. Over
    seeds: the first token follows p[0]; a drafted token is kept at the coupling's rate
    (coupled_acceptance, 5-sigma band), below rejection sampling's sum min(p, q)."""
    p, q, n = P_TARGET.to(device), Q_POOR.to(device), 4000
    firsts, kept = Counter(), 0
    for seed in range(n):
        out, own = cycle(2, q, p, seed, on_device)
        assert out == own[:len(out)], (seed, out, own)
        firsts[out[0]] += 1
        kept += len(out) > 1
    assert_fits(firsts, P_TARGET[0], n, "first token")
    a = coupled_acceptance(P_TARGET[0], Q_POOR[0])
    assert abs(kept / n - a) < 5 * math.sqrt(a * (1 - a) / n), (kept / n, a)
    assert a < float(torch.minimum(P_TARGET[0], Q_POOR[0]).sum())


def test_acceptance_power_and_edge_cases(device):
    """The goodness-of-fit test rejects a sampler that keeps the draft's token; p == q keeps every
    drafted token; K = 0 is a plain draw; a token p gives 0 is never drafted into the output."""
    n = 20000
    gen = torch.Generator().manual_seed(7)
    naive = torch.multinomial(Q_POOR[0], n, replacement=True, generator=gen).tolist()
    _, _, pv = chi2_gof(Counter(naive), dict(enumerate(P_TARGET[0].tolist())), n)
    assert pv < P_FALSE_ALARM
    p = P_TARGET.to(device)
    assert all(len(cycle(2, p, p, seed, True)[0]) == 3 for seed in range(300))
    outs = Counter(cycle(0, p, p, seed, False)[0][0] for seed in range(4000))
    assert_fits(outs, P_TARGET[0], 4000, "K=0")
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], device=device)
    q = torch.tensor([[0.0, 0.0, 1.0]], device=device)
    for seed in range(200):
        out, _ = cycle(1, q, p, seed, True)
        assert len(out) == 1 and out[0] in (0, 1)


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


@pytest.mark.parametrize("policy, k", [("specter", 2), ("specter", None), ("spec-lru", 3)])
@pytest.mark.parametrize("kw", [SAMPLE, PENALIZED, dict(temperature=0.8, top_p=0.9)],
                         ids=["top-k", "penalties+min-p", "top-p"])
def test_speculative_sampling_is_plain_sampling_token_for_token(tiny, fast_link, policy, k, kw):
    """Sampled with a seed, a drafting policy gives resident's tokens for that seed, every one: with K
    fixed, and with the governor choosing (k None: plain steps and cycles mixed), the sync-free
    on-device acceptance (no penalty) and the eager one (penalties). Before, a draw depended on the
    K the governor picked, so a seed fixed only the distribution (a server's `seed` did not repeat)."""
    path, _ = tiny("qwen3_moe", eos_token_id=None)
    prompt = [1, 5, 9, 33, 2]
    res, spec = load(path, "resident"), load(path, policy, residency=0.5, k_max=4)
    try:
        if k is not None:
            spec.decoder.governor = Governor(4, fixed=k)
        rejected = 0
        for seed in range(12):
            a = spec.generate(prompt, max_new_tokens=10, seed=seed, **kw)
            b = res.generate(prompt, max_new_tokens=10, seed=seed, **kw)
            assert a.token_ids == b.token_ids, seed
            rejected += a.stats["drafted_tokens"] - a.stats["accepted_tokens"]
        assert k is None or rejected > 0  # (both paths of a cycle ran)
    finally:
        spec.close()
        res.close()


@pytest.mark.slow
@pytest.mark.parametrize("kw", [SAMPLE, PENALIZED], ids=["top-k", "penalties+min-p"])
def test_speculative_sampling_matches_target_end_to_end(tiny, fast_link, kw):
    """The first three tokens of `specter` (K fixed at 2, then 1: both come from speculation) over
    300 seeds follow the target's exact joint distribution, and are resident's for the same seed.
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
            assert a.token_ids[:depth] == b.token_ids, seed
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
