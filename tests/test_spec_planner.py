"""The prefetch planner: never more experts than slots, copies in layer order and most-demanded first,
predicted experts never evicted by the same cycle's later chunks, scores decaying per cycle, and
what it prefetches is what verification then hits.
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
    mgr.prefetch_batch = 1          # a copy each (as experts larger than a fixed cost's bytes go): tags name one
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
            la.ids[start + r, layer] = torch.tensor(ids)  # as DraftExperts writes a drafted token's row
            la.weights[start + r, layer] = torch.tensor([0.6, 0.4])


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


def test_scores_decay_in_place_of_every_value_and_fold_a_tiny_scale():
    """Scores keep raw values and a scale: a decay multiplies the scale only, an add touches the experts
    it names, and every value reads as the written-out arithmetic would give; a scale that would fall
    below TINY (a long prompt's decay ** tokens, or 0) is folded into the row, which keeps its values."""
    from specter.speculative.scores import Scores

    s, plain = Scores(2, 4), [[0.0] * 4 for _ in range(2)]
    for step, used in enumerate([[0, 1], [1], [1, 1, 3], [2]]):
        s.decay(0, 0.8)
        plain[0] = [0.8 * v for v in plain[0]]
        s.add(0, used, 3.0)
        for e in used:
            plain[0][e] += 3.0
    assert all(math.isclose(a, b) for a, b in zip(s.row(0), plain[0])) and s.row(1) == [0.0] * 4
    assert math.isclose(s.scale[0], 0.8 ** 4) and s.scale[1] == 1.0 and s.raw[1] == [0.0] * 4  # one layer only
    before = s.row(0)
    s.decay(0, 1e-60)
    s.decay(0, 1e-60)  # past TINY: folded, the values kept (tiny, but ordered as before)
    assert s.scale[0] == 1.0 and all(math.isclose(v, b * 1e-120) for v, b in zip(s.row(0), before))
    s.decay_all(0.0)  # a decay to nothing: every score 0, and adds count from there
    s.add(1, [2], 1.5)
    assert s.row(0) == [0.0] * 4 and s.row(1) == [0.0, 0.0, 1.5, 0.0] and s.value(1, 2) == 1.5
    s.set(1, 2, 4.0)
    assert s.value(1, 2) == 4.0


def test_planner_scores_decay_once_a_plain_step_as_once_a_cycle(planner_setup):
    """A plain step's use decays its layer's scores (a verification's does not: its cycle did at
    its start), so a score counts recent uses whether the governor drafts or not."""
    store, mgr, la, planner, link = planner_setup
    planner.observe_use(0, [5])
    planner.observe_use(0, [5])
    assert math.isclose(planner.scores.value(0, 5), 3.0 * 0.8 + 3.0) and planner.scores.value(1, 5) == 0.0
    planner.begin_cycle(2)  # a speculative cycle: decayed at its start, not again at verification
    fill(la, [[(6, 7)] * L_])
    planner.plan(1)
    planner.observe_use(0, [5])
    assert math.isclose(planner.scores.value(0, 5), (3.0 * 0.8 + 3.0) * 0.8 + 3.0)
    planner.end_cycle()
    link.synchronize()


def test_a_prompt_decays_scores_as_its_tokens_and_measures_no_reuse(planner_setup):
    """A prefill of T tokens is one call a layer but T steps of text: the scores decay by decay^T
    over it (begin_prefill, then the call's own decay), and its union of experts is no step-to-step
    reuse; the first plain step after it measures reuse again."""
    store, mgr, la, planner, link = planner_setup
    for _ in range(3):
        planner.observe_use(0, [0, 1])
    score, reuse = planner.scores.value(0, 0), planner.reuse[0]
    planner.begin_prefill(12)
    for layer in range(L_):  # the prompt's calls, layer by layer
        planner.observe_use(layer, [3, 4, 5, 6, 7])
    assert math.isclose(planner.scores.value(0, 0), score * 0.8 ** 12) and math.isclose(planner.scores.value(0, 3), 3.0)
    assert planner.reuse[0] == reuse
    planner.observe_use(0, [3, 4])  # a plain step: measured against the prompt's experts
    assert planner.reuse[0] == 0.9 * reuse + 0.1


def test_a_new_prompt_copies_over_the_last_texts_residents(planner_setup):
    """Both lanes: the residents the previous generation used every step keep no claim on the slots
    once a new prompt runs (begin_prefill), so its misses are copied where the exchange pays; without
    it their old uses price every copy out and the prompt's experts stay on the host, each of them
    a miss again in the first steps after it."""
    from specter.offload.calibrate import HostParams
    from specter.offload.host_lane import LaneChoice

    store, mgr, la, planner, link = planner_setup
    mgr.link.copy_seconds = lambda nbytes: 7e-3
    # host: 5 ms a job + 1 ms an expert; a copy: 7 ms
    params = HostParams(bandwidth=mgr.expert_bytes / 1e-3, flops_per_s=0.0, latency=5e-3,
                        pcie_bandwidth=float("inf"))
    choose = LaneChoice(mgr, params, planner=planner)
    for _ in range(5):  # the last text used the residents 0, 1, 2 every step
        planner.observe_use(0, [0, 1, 2])
    routed = [3, 4, 5, 3, 4, 5]  # the new prompt's tokens need 3, 4, 5 (none resident)
    assert choose(0, [3, 4, 5], routed) == [3, 4, 5]  # as one more step of the old text: all hosted
    planner.begin_prefill(12)
    assert choose(0, [3, 4, 5], routed) == [4, 3]  # a new text: one copied (7 ms, beside 7 on the host),
    # the one its last token used (prompt_uses)


def test_a_prompt_copies_the_experts_its_last_tokens_used(planner_setup):
    """Both lanes in a prompt: the earlier text's scores say nothing of the prompt's experts (begin_prefill
    decays them all alike), so its misses are ranked by its own tokens as the steps after it will see
    them (token T-1-d's uses weigh decay^d): the copies go to the experts its last tokens used, and the
    host computes the ones only its first tokens used. Ranked by the scores alone, ties kept the misses'
    order and copied an early token's expert: the first decode step missed ~9.5 experts against ~7.6
    (top8 at 1/2 residency, docs/RESULTS.md "Issue 23: a prompt's hosted experts")."""
    from specter.offload.calibrate import HostParams
    from specter.offload.host_lane import LaneChoice, prompt_uses

    store, mgr, la, planner, link = planner_setup
    mgr.link.copy_seconds = lambda nbytes: 7e-3
    params = HostParams(bandwidth=mgr.expert_bytes / 1e-3, flops_per_s=0.0, latency=5e-3,
                        pcie_bandwidth=float("inf"))
    choose = LaneChoice(mgr, params, planner=planner)
    routed = [3, 4, 5, 6, 5, 6]  # three tokens, top-2: the first used 3 and 4, the last two 5 and 6
    assert prompt_uses(routed, 3, 0.8) == pytest.approx({3: 0.64, 4: 0.64, 5: 1.8, 6: 1.8})
    assert prompt_uses(routed, 3, 0.8, tail=2) == {5: 1.8, 6: 1.8}
    planner.begin_prefill(3)
    assert choose(0, [3, 4, 5, 6], routed) == [6, 3, 4]  # one copied (7 ms beside 8 on the host): 5, a last token's
    choose.rank_prompt = False
    assert choose(0, [3, 4, 5, 6], routed) == [4, 5, 6]  # by the scores alone: 3, the first token's
    planner.observe_use(L_ - 1, [3, 4, 5, 6])  # the prompt's last layer ends it: plain steps rank by the scores
    assert planner.prompt_tokens == 0
    choose.rank_prompt = True
    planner.observe_use(0, [4])  # a plain step used 4; then a one-token prompt needs 3 and 4, alike by its uses:
    planner.begin_prefill(1)
    assert choose(0, [3, 4], [3, 4]) == [3]  # the scores break the tie, 4 copied


def _steps(mgr, steps):
    """Plain steps of layer 0: one token each, routed to the given two experts."""
    g = torch.Generator().manual_seed(5)
    for ids in steps:
        mgr(0, torch.randn(1, 16, generator=g), torch.tensor([ids]), torch.tensor([[0.6, 0.4]]))
    mgr.link.synchronize()


def test_plain_steps_evict_by_recency_cycles_by_score(planner_setup):
    """Outside a cycle the planner ranks every resident alike, so a plain step's miss evicts what plain
    decoding would (the least recently used: expert 1, used three steps running but not lately), not the
    lowest decayed score (expert 2, used once, last step); while a cycle runs its scores decide."""
    store, mgr, la, planner, link = planner_setup
    _steps(mgr, [(0, 1)] * 3 + [(0, 2)])
    assert planner.scores.value(0, 1) > planner.scores.value(0, 2)
    _steps(mgr, [(0, 3)])  # a miss: layer 0 is at its quota of 3
    assert residents(mgr, 0) == {0, 2, 3} and planner.rank(0, 1) == planner.rank(0, 2) == 0.0
    planner.begin_cycle(2)
    assert planner.rank(0, 2) == planner.scores.value(0, 2) > 0.0
    planner.scores.set(0, 0, 0.0)  # the cycle's scores say 0 is the coldest, though it was used last
    _steps(mgr, [(3, 4)])  # a cycle's miss: the lowest score goes, not the least recent (2)
    assert residents(mgr, 0) == {2, 3, 4}
    planner.end_cycle()
    assert planner.rank(0, 3) == 0.0
    mgr.slots.check()


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


def test_a_cycle_plans_every_chunk_of_drafts_that_link_and_draft_speed_allow(planner_setup):
    store, mgr, la, planner, link = planner_setup
    copy_s = mgr.expert_bytes / link.bandwidth + link.latency
    planner.new_per_token = 1.0
    assert planner.begin_cycle(6, draft_step_s=copy_s / 10) == 1   # slow link: plan after every step
    assert planner.begin_cycle(6, draft_step_s=copy_s * 3) == 3
    assert planner.begin_cycle(6, draft_step_s=copy_s * 100) == 6  # fast link: one read per cycle
    assert planner.begin_cycle(4, draft_step_s=0.0) == 1
    mgr.prefetch_batch = 4  # small experts: 4 cross in one fixed cost, so a plan waits until a layer's fill one
    assert planner.begin_cycle(6, draft_step_s=copy_s / 10) == 6   # 4 x 3 layers / 1 new expert a token: 12
    planner.new_per_token = 6.0
    assert planner.begin_cycle(6, draft_step_s=copy_s / 10) == 2   # 12 / 6


def test_a_cycle_after_thousands_without_a_new_expert_reads_once(planner_setup):
    """Every expert resident: each plan issues nothing, and the EMA of new experts a token decays toward 0.
    After ~3200 cycles it is subnormal and draft_step_s / copy_s overflowed (OverflowError in every later
    cycle: the engine was broken for good). Now: one read a cycle, K whatever the EMA."""
    store, mgr, la, planner, link = planner_setup
    copy_s = mgr.expert_bytes / link.bandwidth + link.latency
    for n in range(3000, 3400, 2):  # the EMA after n cycles without one, until it is 0
        planner.new_per_token = 0.8 ** n
        assert planner.begin_cycle(6, draft_step_s=copy_s / 10) == 6
        assert planner.begin_cycle(1, draft_step_s=copy_s / 10) == 1
