"""Speculative decoding over offloaded experts: lossless, rollback-exact, and sensibly governed.

1. Lossless greedy: `spec-lru`, `specter` (adaptive K, and every K forced through a fixed governor)
   and `oracle` at residencies 0.25 / 0.5 / 1.0 produce exactly the greedy tokens of `resident` on
   tiny checkpoints of three architectures (qwen3_moe; deepseek_v2: MLA, a shared expert and a
   dense first layer; mixtral), and on the bundled default model when it is present. Each run also
   checks that speculation really happened (drafted tokens, rejections, prefetches), so a decoder
   that silently fell back to plain decoding would fail.
2. Lossless sampling: `accept_sampling` is driven directly with a fixed target p and a deliberately
   poor draft q; the emitted tokens follow p (chi-square goodness of fit, false-alarm rate 1e-3 per
   test, fixed seeds, so the outcome is deterministic). End to end, the first three tokens of the
   `specter` engine (K fixed) over 300 seeds follow the target's exact joint distribution,
   computed from the resident model (this also catches a decoder that drafts from one
   distribution but hands acceptance another).
3. KV commit and rollback: after every cycle (rejections included) the committed KV rows equal a
   fresh prefill of the committed tokens, and continuing from a committed prefix after a rejection
   with plain decoding gives the speculative engine's continuation.
4. Governor, end to end (the governor alone: tests/test_governor.py): an engine whose draft
   returns garbage decodes with K = 0 almost always (and is still lossless).
5. Prefetch planner: never more experts than slots, copies in layer order and most-demanded first,
   predicted experts are never evicted by the same cycle's later chunks, and what it prefetches is
   what verification then hits.
6. Configuration: K_max = 0 is plain decoding; a bad K_max is a ConfigError.
7. Penalties (repetition / presence / frequency) and min-p: greedy speculation with them equals
   plain decoding, sampled speculation follows the penalised target's exact joint distribution, and
   an exact draft (penalised like the target, position by position) has every token accepted.

Statistical tests use fixed seeds, so each outcome is deterministic; P_FALSE_ALARM is the chance
that a correct implementation fails over the choice of seeds.
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
from specter.speculative.draft import accept_greedy, accept_on_device, accept_sampling
from specter.speculative.draft import DraftExperts
from specter.speculative.governor import Governor
from specter.speculative.draft import Lookahead
from specter.speculative.planner import PrefetchPlanner

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


def test_chi2_sf_matches_tables():
    # scipy is not installed; chi2.ppf(0.999, df) from the standard tables: df=1 10.828, df=4 18.467,
    # df=8 26.124, df=26 54.052. The survival function at those points must be 1e-3.
    for df, crit in [(1, 10.828), (4, 18.467), (8, 26.124), (26, 54.052)]:
        assert chi2_sf(crit, df) == pytest.approx(1e-3, rel=2e-3), df


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


# ---------------------------------------------------------------------------------------- 1. lossless greedy
@pytest.mark.parametrize("residency", list(GREEDY_GRID))
@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_greedy_equals_resident(tiny, resident_tokens, fast_link, arch, residency):
    path, _ = tiny(arch, eos_token_id=None)
    k_maxes, forced, lru_k_maxes = GREEDY_GRID[residency]
    want = resident_tokens(arch)

    def check(engine, label):
        outs = gen_all(engine)
        for p, out, w in zip(PROMPTS, outs, want):
            assert out.token_ids == w, f"{arch} {label}, prompt {p}: {out.token_ids} != resident {w}"
        return outs

    def adaptive(policy, k_max):
        """Governor-chosen K: exact tokens, never above K_max, and some cycles did speculate."""
        engine = load(path, policy, residency=residency, k_max=k_max)
        try:
            outs = check(engine, f"{policy} residency={residency} k_max={k_max}")
        finally:
            engine.close()
        hist = k_histogram(outs)
        assert max(hist) <= k_max and sum(v for k, v in hist.items() if k > 0) > 0, hist
        return outs

    for k_max in k_maxes:
        adaptive("specter", k_max)
    # K forced (fixed governor): the whole draft/verify/accept/rollback path at each K
    engine = load(path, "specter", residency=residency, k_max=6)
    try:
        rates = []
        for k in forced:
            engine.decoder.governor = Governor(6, fixed=k)
            outs = check(engine, f"specter residency={residency} fixed K={k}")
            hist = k_histogram(outs)
            assert hist[k] > 0 and max(hist) == k, (k, hist)
            rates.append(total(outs, "accepted_tokens") / total(outs, "drafted_tokens"))
            if residency < 1.0:
                assert total(outs, "prefetch_issued") > 0 and total(outs, "prefetch_used") > 0, (residency, k)
            else:
                assert total(outs, "expert_misses") == 0 and total(outs, "h2d_bytes") == 0
        # rejections happened (so rollback was exercised), and so did acceptances
        assert min(rates) < 1.0 and max(rates) > 0.0, rates
    finally:
        engine.close()
    # spec-lru: governor-chosen K (never above K_max), on-demand fetches, no planner
    for k_max in lru_k_maxes:
        outs = adaptive("spec-lru", k_max)
        assert total(outs, "prefetch_issued") == 0
        if residency < 1.0:
            assert total(outs, "expert_misses") > 0
    # oracle (bench only)
    engine = load(path, "oracle", residency=residency)
    try:
        outs = check(engine, f"oracle residency={residency}")
        if residency < 1.0:
            assert total(outs, "prefetch_issued") > 0
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_speculative_greedy_with_penalties_equals_resident(tiny, fast_link, arch):
    """Penalties read the history (prompt, committed tokens, and at each drafted position the drafted
    tokens before it): greedy speculation with them still gives plain decoding's tokens."""
    path, _ = tiny(arch, eos_token_id=None)
    kw = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3)
    res, spec = load(path, "resident"), load(path, "specter", residency=0.25, k_max=6)
    try:
        want = [o.token_ids for o in gen_all(res)]
        for k in (2, 5):
            spec.decoder.governor = Governor(6, fixed=k)
            outs = [spec.generate(p, max_new_tokens=NEW, **kw) for p in PROMPTS]
            assert [o.token_ids for o in outs] == [res.generate(p, max_new_tokens=NEW, **kw).token_ids
                                                  for p in PROMPTS], (arch, k)
            assert total(outs, "drafted_tokens") > 0 and total(outs, "rejections") > 0
        assert [o.token_ids for o in outs] != want  # the penalties changed the tokens
    finally:
        spec.close()
        res.close()


def test_default_model_speculative_greedy_equals_resident(fast_link):
    path = specter.default_model_path()
    if not (path / "model.safetensors").exists():
        pytest.skip("the bundled default model is not present")
    prompts = ["def fibonacci(n):", "for i, line in enumerate(lines):"]
    engine = load(path, "resident")
    try:
        want = [o.token_ids for o in gen_all(engine, prompts, 32)]
    finally:
        engine.close()
    assert all(len(w) > 0 for w in want)
    for policy, kw in [("specter", {"residency": 0.25}), ("specter", {"residency": 0.5, "k_max": 3}),
                       ("spec-lru", {"residency": 0.25})]:
        engine = load(path, policy, **kw)
        try:
            outs = gen_all(engine, prompts, 32)
        finally:
            engine.close()
        for p, o, w in zip(prompts, outs, want):
            assert o.token_ids == w, f"default model {policy} {kw}, prompt {p!r}: {o.token_ids} != {w}"
        assert total(outs, "drafted_tokens") > 0


def test_accept_greedy_unit():
    V = 6
    logits = torch.full((4, V), -1.0)
    for i, best in enumerate([2, 4, 1, 5]):
        logits[i, best] = 1.0
    assert accept_greedy([2, 4, 1], logits) == (3, 5)   # all accepted + the target's bonus token
    assert accept_greedy([2, 0, 1], logits) == (1, 4)   # first mismatch at 1: the target's token there
    assert accept_greedy([3, 4, 1], logits) == (0, 2)
    assert accept_greedy([], logits[:1]) == (0, 2)


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


# ------------------------------------------------------------------------------------ 3. KV commit / rollback
@pytest.fixture
def record_caches(monkeypatch):
    """Every KVCache the speculative decoder allocates, in order."""
    made = []

    class Recording(KVCache):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(decoder_mod, "KVCache", Recording)
    return made


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_committed_kv_equals_fresh_prefill(tiny, fast_link, record_caches, arch):
    """Drive SpeculativeDecoder.run cycle by cycle (K fixed at 4): after each cycle, the cache rows
    [0, committed) -- drafted rows verified and kept, rejected ones beyond -- equal those of a fresh
    prefill of the committed tokens through the resident target."""
    path, _ = tiny(arch, eos_token_id=None)
    engine = load(path, "specter", residency=0.25, k_max=4)
    try:
        dec = engine.decoder
        dec.governor = Governor(4, fixed=4)
        resident = ResidentExperts(engine.expert_weights)
        prompt = [1, 5, 9, 33, 2]
        committed_tokens = list(prompt)
        it = dec.run(prompt, SamplingParams(), 40)
        first = next(it)
        cache = record_caches[-1]
        pending = first[-1]
        rejections, produced = 0, 1
        for chunk in it:
            # the cycle committed `pending` and the accepted drafted tokens; its last token is pending
            committed_tokens += [pending] + chunk[:-1]
            pending = chunk[-1]
            if len(chunk) < 5 and 40 - produced >= 5:
                rejections += 1  # K was 4 (not capped) and fewer than K+1 tokens came: a rejection
            produced += len(chunk)
            n = len(committed_tokens)
            fresh = KVCache(engine.spec, n, "cpu", torch.float32)
            engine.model(torch.tensor(committed_tokens), 0, fresh, resident)
            for layer in range(engine.spec.n_layers):
                torch.testing.assert_close(cache.k[layer][:, :n], fresh.k[layer], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(cache.v[layer][:, :n], fresh.v[layer], rtol=1e-5, atol=1e-5)
        assert rejections >= 2, rejections
    finally:
        engine.close()


@pytest.mark.parametrize("arch,kw", [("mixtral", {"sliding_window": 6}), ("deepseek_v2", {})],
                         ids=["mixtral-window6", "deepseek_v2"])
def test_continuation_after_rejection_equals_plain_decoding(tiny, fast_link, arch, kw):
    """Generate with `specter` (K fixed at 5, so every cycle with fewer than 6 tokens rejected a
    drafted token); from the committed prefix right after each such cycle, plain decoding of the
    resident target continues exactly as the speculative run did. Mixtral runs with a 6-token
    sliding window, so verification batches and rollbacks straddle the window's edge."""
    path, _ = tiny(arch, eos_token_id=None, **kw)
    N = 40
    spec = load(path, "specter", residency=0.5, k_max=5)
    res = load(path, "resident")
    checked = 0
    try:
        spec.decoder.governor = Governor(5, fixed=5)
        chunks = []
        run = spec.decoder.run

        def recording_run(*a, **kw):
            for c in run(*a, **kw):
                chunks.append(list(c))
                yield c

        spec.decoder.run = recording_run
        for prompt in PROMPTS:
            chunks.clear()
            out = spec.generate(prompt, max_new_tokens=N)
            assert out.token_ids == [t for c in chunks for t in c][:N]
            ends, j = [], len(chunks[0])
            for c in chunks[1:]:
                if len(c) < 6 and N - j >= 6:
                    ends.append(j + len(c))  # K was 5 and a drafted token was rejected: [0, j+len(c)) committed
                j += len(c)
            for j in ends[:2]:
                cont = res.generate(prompt + out.token_ids[:j], max_new_tokens=N - j).token_ids
                assert cont == out.token_ids[j:], f"{arch} {prompt}: after {j} tokens: {cont} != {out.token_ids[j:]}"
                checked += 1
    finally:
        spec.close()
        res.close()
    assert checked >= 3, checked


# ---------------------------------------------------------------------------------------------- 4. governor
# (the governor alone, against simulated cycle costs: tests/test_governor.py)
def settled(decisions, last: int = 50) -> Counter:
    return Counter(k for k, probe in decisions[-last:] if not probe)


def test_engine_with_garbage_draft_settles_on_plain_decoding(tiny, fast_link, resident_tokens, monkeypatch):
    """The draft's experts return large noise: its tokens are garbage, so the governor must decode
    with K = 0 almost all the time (probes aside) -- and the output is still the resident one."""
    path, _ = tiny("qwen3_moe", eos_token_id=None)
    engine = load(path, "specter", residency=0.5, k_max=6)
    try:
        g = torch.Generator().manual_seed(0)
        real_call = DraftExperts.__call__

        def garbage(self, layer, x, ids, weights):
            out = real_call(self, layer, x, ids, weights)  # keeps recording the lookahead
            return torch.randn(out.shape, generator=g, dtype=out.dtype) * 100.0

        monkeypatch.setattr(DraftExperts, "__call__", garbage)
        decisions = []
        next_k = engine.decoder.governor.next_k

        def recording_next_k(remaining):
            k = next_k(remaining)
            decisions.append((k, engine.decoder.governor.probe))
            return k

        engine.decoder.governor.next_k = recording_next_k
        prompt, n = [1, 5, 9, 33, 2], 96
        out = engine.generate(prompt, max_new_tokens=n)
    finally:
        engine.close()
    ref = load(path, "resident")
    try:
        assert out.token_ids == ref.generate(prompt, max_new_tokens=n).token_ids
    finally:
        ref.close()
    hist = out.stats["k_histogram"]
    assert out.stats["acceptance_rate"] < 0.2 and sum(v for k, v in hist.items() if k > 0) > 0, out.stats
    assert hist.get(0, 0) >= 0.7 * out.stats["cycles"], hist
    got = settled(decisions, 40)
    assert got[0] >= 0.8 * sum(got.values()), (got, hist)


# --------------------------------------------------------------------------------------- 5. prefetch planner
L_, E_, S_, TOPK = 3, 8, 3, 2


class RecordingLink(EmulatedLink):
    """A slow emulated link (copies stay in flight while the test looks) that records each copy's tag."""

    def __init__(self):
        super().__init__(bandwidth=20e6, latency=5e-3, name="recording")
        self.tags = []

    def copy(self, dst, src, *, urgent=False, tag=None):
        self.tags.append(tag)
        return super().copy(dst, src, urgent=urgent, tag=tag)


@pytest.fixture
def planner_setup():
    g = torch.Generator().manual_seed(0)
    H, I = 16, 8
    store = [ExpertWeights(torch.randn(E_, 2 * I, H, generator=g), torch.randn(E_, H, I, generator=g))
             for _ in range(L_)]
    link = RecordingLink()
    mgr = OffloadedExperts(store, S_, torch.device("cpu"), link)
    mgr.warm()                      # experts 0, 1, 2 resident in every layer
    mgr.reset_stats()
    link.tags.clear()
    la = Lookahead(6, L_, TOPK, "cpu")
    yield store, mgr, la, PrefetchPlanner(mgr, la), link
    link.close()


def fill(la: Lookahead, rows: list[list[tuple[int, int]]], start: int = 0):
    """rows[r][layer] = the two experts the draft's router picked for drafted token start + r."""
    for r, row in enumerate(rows):
        for layer, ids in enumerate(row):
            la.record(start + r, layer, torch.tensor([ids]), torch.tensor([[0.6, 0.4]]))


def residents(mgr, layer):
    return {e for e in range(E_) if mgr.is_resident(layer, e)}


def test_planner_layer_order_demand_order_and_slots(planner_setup):
    store, mgr, la, planner, link = planner_setup
    # layer 0: 6 x expert 5, 4 x 7, 2 x 1 (resident); layer 1: 6 x 4, 4 x 3, 2 x 6; layer 2: 6 x 0 (resident),
    # 3 x 6, 2 x 5, 1 x 7 -- four experts predicted for three slots
    rows = [[(5, 7), (4, 3), (0, 6)], [(5, 7), (4, 3), (0, 6)], [(5, 7), (4, 3), (0, 6)], [(5, 7), (4, 3), (0, 5)],
            [(5, 1), (4, 6), (0, 5)], [(5, 1), (4, 6), (0, 7)]]
    fill(la, rows)
    planner.begin_cycle()
    issued = planner.plan(6)
    # layer by layer, most demanded first; resident experts are not copied; at most S_ per layer
    assert link.tags == [(0, 5), (0, 7), (1, 4), (1, 3), (1, 6), (2, 6), (2, 5)], link.tags
    assert issued == 7 and mgr.stats()["prefetch_issued"] == 7
    mgr.slots.check()                             # invariants hold with copies in flight
    assert all((l, e) in mgr.inflight for l, e in link.tags)  # tracked until landed (polled)
    assert residents(mgr, 0) == {5, 7, 1}         # 1 was predicted: it stayed; 0 and 2 were evicted
    assert residents(mgr, 1) == {4, 3, 6}
    assert residents(mgr, 2) == {0, 6, 5}         # the least demanded (7) got no slot
    for layer in range(L_):
        assert len(residents(mgr, layer)) <= S_
    # planning again with nothing new issues nothing (in flight and resident are not re-copied)
    assert planner.plan(6) == 0 and len(link.tags) == 7
    link.synchronize()
    mgr.poll()
    mgr.slots.check()


def test_planner_never_evicts_what_this_cycle_predicted(planner_setup):
    """Chunk 1 predicts experts; chunk 2 predicts others. The first chunk's experts keep their slots
    (the verification of this cycle needs them), an expert pinned by a running computation too."""
    store, mgr, la, planner, link = planner_setup
    planner.begin_cycle()
    fill(la, [[(5, 6)] * L_, [(5, 6)] * L_])                    # chunk 1: 5 and 6, twice each
    planner.plan(2)
    link.synchronize()
    mgr.poll()
    (busy,) = residents(mgr, 2) - {5, 6}                        # layer 2's third slot: a warm expert
    mgr.slots.pin(2, [busy])                                    # ... being computed right now
    fill(la, [[(3, 4)] * L_], start=2)                          # chunk 2: 3 and 4, once each
    planner.plan(3)
    mgr.slots.check()
    for layer in range(L_):
        assert {5, 6} <= residents(mgr, layer), (layer, residents(mgr, layer))
        assert len(residents(mgr, layer)) <= S_
    assert busy in residents(mgr, 2)                            # pinned: not evicted
    assert (2, 3) not in link.tags and (2, 4) not in link.tags  # no slot left in layer 2 for chunk 2
    assert (0, 3) in link.tags and (1, 3) in link.tags          # one evictable slot: the first of the tie
    assert (0, 4) not in link.tags and (1, 4) not in link.tags
    mgr.slots.unpin(2, [busy])
    link.synchronize()


def test_planner_keeps_a_predicted_resident_outside_the_top_slots(planner_setup):
    """Layer 0 predicts 7 (3x), 5 and 6 (2x) and resident 0 (once): more experts than its 3 slots. Evicting
    0 for 6 would only swap two copies (verification needs both), so 0 stays and 6 waits for verification."""
    store, mgr, la, planner, link = planner_setup
    planner.begin_cycle()
    fill(la, [[(5, 6), (5, 6), (5, 6)], [(7, 5), (5, 6), (5, 6)], [(6, 7), (5, 6), (5, 6)], [(7, 0), (5, 6), (5, 6)]])
    planner.plan(4)
    assert [t for t in link.tags if t[0] == 0] == [(0, 7), (0, 5)], link.tags  # into 1's and 2's slots
    assert residents(mgr, 0) == {7, 5, 0}
    link.synchronize()


def test_planner_scores_decay_once_a_plain_step_as_once_a_cycle(planner_setup):
    """A plain step's use decays its layer's scores (a verification's does not: its cycle did at
    its start), so a score counts recent uses whether the governor drafts or not."""
    store, mgr, la, planner, link = planner_setup
    planner.observe_use(0, [5])
    planner.observe_use(0, [5])
    assert planner.score[0][5] == 3.0 * 0.8 + 3.0 and planner.score[1][5] == 0.0
    planner.begin_cycle(2)  # a speculative cycle: decayed at its start, not again at verification
    fill(la, [[(6, 7)] * L_])
    planner.plan(1)
    planner.observe_use(0, [5])
    assert planner.score[0][5] == (3.0 * 0.8 + 3.0) * 0.8 + 3.0
    planner.end_cycle()
    link.synchronize()


def test_late_experts_leave_the_highest_ranked_resident(planner_setup):
    """A layer needing more experts than its slots computes them in batches; with keep_rank the
    ones loaded last, and so left resident for the next cycle, are the highest ranked. The output
    is the resident experts' either way."""
    store, mgr, la, planner, link = planner_setup
    rank = {3: 0.0, 4: 5.0, 5: 1.0, 6: 4.0, 7: 3.0}
    mgr.keep_rank = lambda layer, e: rank.get(e, -1.0)
    ids = torch.tensor([[3, 4], [5, 6], [7, 3], [4, 6]])               # [4 tokens, top_k]: 5 experts
    g = torch.Generator().manual_seed(3)
    w = torch.softmax(torch.randn(4, TOPK, generator=g), -1)
    x = torch.randn(4, 16, generator=g)
    torch.testing.assert_close(mgr(0, x, ids, w), ResidentExperts(store)(0, x, ids, w), rtol=0, atol=0)
    assert residents(mgr, 0) == {4, 6, 7}, residents(mgr, 0)
    mgr.slots.check()


def test_planner_prefetch_is_what_verification_hits(planner_setup):
    """After planning and the copies landing, running each layer on the predicted routing is all hits,
    and the outputs equal the resident experts' (the bytes landed in the right slots)."""
    store, mgr, la, planner, link = planner_setup
    predicted = [[(5, 6), (2, 7), (4, 3)], [(5, 6), (7, 2), (3, 4)]]
    planner.begin_cycle()
    fill(la, predicted)
    assert planner.plan(2) == 5                 # layer 1's expert 2 is already resident (warm)
    link.synchronize()
    before = mgr.stats()
    resident = ResidentExperts(store)
    g = torch.Generator().manual_seed(1)
    for layer in range(L_):
        ids = torch.tensor([list(row[layer]) for row in predicted])          # [2 tokens, top_k]
        w = torch.softmax(torch.randn(2, TOPK, generator=g), -1)
        x = torch.randn(2, 16, generator=g)
        torch.testing.assert_close(mgr(layer, x, ids, w), resident(layer, x, ids, w), rtol=0, atol=0)
    st = {k: v - before[k] for k, v in mgr.stats().items() if isinstance(v, (int, float))}
    assert st["expert_misses"] == 0 and st["expert_hits"] == 2 * L_ and st["prefetch_used"] == 5, st
    mgr.slots.check()


def test_planner_chunk_size_follows_link_and_draft_speed(planner_setup):
    store, mgr, la, planner, link = planner_setup
    copy_s = mgr.expert_bytes / link.bandwidth + link.latency
    planner.new_per_token = 1.0
    assert planner.chunk_size(draft_step_s=copy_s / 10, k=6) == 1   # slow link: plan after every step
    assert planner.chunk_size(draft_step_s=copy_s * 3, k=6) == 3
    assert planner.chunk_size(draft_step_s=copy_s * 100, k=6) == 6  # fast link: one read per cycle
    assert planner.chunk_size(draft_step_s=0.0, k=4) == 1


# ------------------------------------------------------------------------------------------ configuration
@pytest.mark.parametrize("bad", [-1, "3", 2.5, True])
def test_bad_k_max_is_a_config_error(tiny, fast_link, bad):
    path, _ = tiny("qwen3_moe", eos_token_id=None)
    with pytest.raises(specter.ConfigError, match="k_max"):
        load(path, "specter", residency=0.5, k_max=bad)


def test_k_max_zero_is_plain_decoding(tiny, fast_link, resident_tokens):
    """K_max = 0: the speculative engine never drafts, and is still exact."""
    path, _ = tiny("qwen3_moe", eos_token_id=None)
    engine = load(path, "specter", residency=0.5, k_max=0)
    try:
        out = engine.generate(PROMPTS[0], max_new_tokens=NEW)
    finally:
        engine.close()
    assert out.token_ids == resident_tokens("qwen3_moe")[0]
    assert out.stats["drafted_tokens"] == 0 and set(out.stats["k_histogram"]) == {0}


def test_acceptance_stats_alpha_and_efficiency():
    """Two cycles of K = 4: all four accepted, then one accepted and the second rejected (two never tried)."""
    from specter.speculative.decoder import acceptance_stats
    s = acceptance_stats(accepted=5, drafted=8, rejections=1, spec_cycles=2)
    assert s == dict(acceptance_rate=5 / 6, draft_efficiency=5 / 8, accepted_per_cycle=2.5)
    assert acceptance_stats(0, 0, 0, 0) == dict(acceptance_rate=None, draft_efficiency=None, accepted_per_cycle=None)


def test_route_coverage_of_an_exact_draft(tiny, fast_link):
    """A draft whose experts are the target's own full-precision weights routes exactly like the
    target: every expert verification uses for t, d1 .. d_{K-1} was predicted; only d_K (never drafted)
    can surprise. So coverage >= K / (K + 1) with a fixed K, and every drafted token is accepted."""
    path, _ = tiny("qwen3_moe", eos_token_id=None)
    engine = load(path, "specter", residency=0.5, k_max=4)
    try:
        dec = engine.decoder
        dec.governor = Governor(4, fixed=4)
        dec.draft.layers = [ExpertWeights(w.w13.clone(), w.w2.clone()) for w in dec.experts.store]
        out = engine.generate([1, 5, 9, 33, 2], max_new_tokens=41)
        # penalties too: the draft's step i must see the drafted prefix exactly as target row i does
        pen = engine.generate([1, 5, 9, 33, 2], max_new_tokens=41, repetition_penalty=1.5, frequency_penalty=0.7)
    finally:
        engine.close()
    s = out.stats
    assert s["acceptance_rate"] == 1.0 and s["draft_efficiency"] == 1.0, s
    assert s["route_coverage"] >= 4 / 5 and s["route_coverage"] <= 1.0, s
    assert pen.stats["acceptance_rate"] == 1.0 and pen.token_ids != out.token_ids, pen.stats


def test_a_cycle_leaves_no_queued_prefetch_behind(tiny, resident_tokens, monkeypatch):
    """Prefetches still queued when verification ends were guesses it did not need (it waits for
    every copy it needs): the cycle withdraws them, so the steps after it queue behind nothing.
    A wrong guess is forced: after the draft's last plan, the last layer prefetches experts the draft
    did not predict, on a link slow enough (~5 ms a copy) that some are still queued. After every
    cycle, each copy in flight has started, the slots' bookkeeping holds, and the tokens are exact."""
    monkeypatch.setattr(builder, "make_link", lambda device, profile=None, **kw: EmulatedLink(5e6, 1e-3, name="slow"))
    path, _ = tiny("qwen3_moe", eos_token_id=None)
    engine = load(path, "specter", residency=0.5, k_max=2)
    try:
        dec = engine.decoder
        dec.governor = Governor(2, fixed=2)
        mgr, planner, cycle, queued = dec.experts, dec.planner, dec._cycle, []
        plan, last = planner.plan, mgr.slots.n_layers - 1

        def plan_and_guess(upto, host=False):
            n = plan(upto, host)
            if upto == planner.k:  # the draft is over: guess wrong on the layer verification reaches last
                unpredicted = [e for e in reversed(range(mgr.slots.n_experts)) if e not in planner.demand[last]]
                n += mgr.prefetch(last, unpredicted, protect=set(planner.demand[last]))
            return n

        def checked(*a, **kw):
            out = cycle(*a, **kw)
            queued.append(sum(t.t_started is None for t in mgr.inflight.values()))
            mgr.slots.check()
            return out

        planner.plan, dec._cycle = plan_and_guess, checked
        outs = [engine.generate(p, max_new_tokens=NEW, temperature=0.0) for p in PROMPTS[:2]]
    finally:
        engine.close()
    assert [o.token_ids for o in outs] == resident_tokens("qwen3_moe")[:2]
    assert queued and max(queued) == 0, queued
    assert total(outs, "prefetch_cancelled") > 0
