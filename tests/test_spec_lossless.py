"""Speculative decoding is lossless end to end (slow: engines over tiny checkpoints of three
architectures, and the bundled model).

1. Greedy: `spec-lru`, `specter` (adaptive K, and every K forced through a fixed governor) and
   `oracle` at residencies 0.25 / 0.5 / 1.0 produce exactly the greedy tokens of `resident` on tiny
   checkpoints (qwen3_moe; deepseek_v2: MLA, a shared expert and a dense first layer; mixtral), and
   on the bundled default model when it is present. Each run also checks that speculation really
   happened (drafted tokens, rejections, prefetches), so a decoder that silently fell back to plain
   decoding would fail. With penalties (repetition / presence / frequency) and min-p too.
2. KV commit and rollback: after every cycle (rejections included) the committed KV rows equal a
   fresh prefill of the committed tokens, and continuing from a committed prefix after a rejection
   with plain decoding gives the speculative engine's continuation.
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

from speculative_common import *  # noqa: F401,F403 -- constants, helpers and fixtures of these tests
from speculative_common import fast_link, resident_tokens  # noqa: F401 -- fixtures

pytestmark = pytest.mark.slow  # every test here decodes with real engines


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
