"""Optimistic drafting (greedy, no penalties): while the later stages verify a cycle, rank 0 drafts
the next one on the guess that all K drafts are accepted and the target's own token is the draft's
(docs/ARCHITECTURE.md, "Optimistic drafting"). A mixin of PipelineSpeculativeDecoder
(speculative.py), which holds the state it reads (stage, model, experts, planner, governor, opt).

One greedy cycle, t pending at n:
    draft     d1 .. dK at n .. n+K-1 (its rows go down the chain where rank 0 plans), or none: a
              kept PreDraft's first K (K at most its length) are this cycle's drafts. A fresh draft
              (no kept pre-draft: after a discard, a plain step, or at a generation's start) keeps
              the later stages waiting, so it drafts only `fresh_share` of the governor's K (unless
              K is fixed, or speculation is not the governor's running arm: measured first or probed
              from plain decoding, its cycles come after plain steps, fresh, and are all the governor
              sees of speculation); the pre-draft beside its verification drafts the whole K for the
              next cycle
    send      rank 0's stage over [t, d1 .. dK] (computed now, or while the last cycle's verification
              ran: PreDraft.step), then the STEP; the result's receive is posted at once (Posted)
    pre-draft while the later stages verify: the guess g (the draft's step on dK at n+K), then up to
              K steps on g from n+K+1 (the governor's K where this one was capped), rank 0's
              own planner prefetching from their rows. Between steps rank 0 looks at the result:
              once it has arrived and says the guess failed (a rejection, or a target token other
              than g), the pre-draft stops. When it ends with the guess still standing, rank 0 also
              runs its own stage over [g, drafted] (only where its stage copies nothing: a stage
              that copies would take copies and demotions of a cycle not yet accepted), so a kept
              pre-draft's STEP leaves as soon as the acceptance is known
    accept    greedy, on the target's logits: the committed tokens are the target's, whatever was
              drafted; the pre-draft is kept when all K were accepted and the target's token is g
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ..sampling import accept_greedy, sample
from .stage import kv_rows, put_kv_rows
from .standins import Sent, Step


def optimistic_stats() -> dict:
    """OptimisticCycles' counters (stats["pipeline"]["optimistic"]): pre-drafts made, kept, their tokens verified,
    their steps and seconds (the guess's step included); the steps drafted while no verification ran, and their
    seconds; pre-drafts stopped when the verification showed the guess failed; cycles whose rank-0 stage step ran
    during the last cycle's verification; cycles begun on a kept pre-draft and fresh ones: their count, tokens
    committed and wall seconds (drafting to the result)."""
    return dict(pre_drafted=0, kept=0, used_tokens=0, pre_steps=0, pre_draft_s=0.0, steps=0, draft_s=0.0, stopped=0,
                early_steps=0, kept_cycles=0, kept_tokens=0, kept_s=0.0, fresh_cycles=0, fresh_tokens=0, fresh_s=0.0)


@dataclass
class PreDraft:
    """The next cycle's drafts, drafted while the later stages verified this one, on the guess that
    all K drafts are accepted and the target's own token is `guess` (the draft's token after d_K)."""
    guess: int
    drafted: list[int]   # drafted on the guess, at positions n+K+1 ...: lookahead rows 0 .. len-1
    seconds: float       # drafting them took (planning included)
    guess_s: float       # the step that gave the guess took
    chunk: int | None    # rank 0's planner's steps between plans (None: no planner)
    step: Step | None = None  # rank 0's stage over [guess] + drafted at n+K+1, run before the acceptance
    t: int = -1          # once kept: the next cycle's pending token and its position
    n: int = -1


class OptimisticCycles:
    """PipelineSpeculativeDecoder's greedy cycles (see the module docstring)."""

    exposed_draft = True  # the governor's draft time: the wall's share beyond verification (_optimistic_cycle)
    fresh_share = 0.5  # a fresh draft's K: this share of the governor's K, rounded up (1: all of it)
    step_ema = None  # a draft step's own seconds, a moving average over the optimistic cycles
    k_want = 0  # the governor's K for the running cycle, before a kept pre-draft's length or fresh_share capped it

    def draft_step_s(self) -> float:
        """A draft step's own seconds, which planners size their chunks by (the governor's draft time
        is the exposed one, `exposed_draft`)."""
        return self.step_ema if self.step_ema is not None else (self.governor.draft_s or 0.0)

    def _optimistic_cycle(self, t: int, n: int, k: int, cache, params) -> list[int]:
        """One greedy cycle as SpeculativeDecoder._cycle runs it, except that rank 0 drafts the next
        cycle while the later stages verify this one (`_pre_draft`), and drafts this one only past what
        the last cycle pre-drafted for it. The committed tokens are the target's, whatever was drafted."""
        st, mgr, planner, clock = self._stats, self.experts, self.planner, time.perf_counter
        o = self.opt
        m0 = clock()
        pre, self.pre = self.pre, None
        if pre is not None and (pre.t, pre.n) != (t, n):  # not what it was kept for (cannot happen: safety)
            self._discard(pre)
            pre = None
        self.k_want = k  # the governor's K (the next pre-draft drafts that many, where this cycle is capped)
        if pre is not None:  # at most what it pre-drafted: drafting more here, rank 0 would keep the others waiting
            k = self.k = min(k, len(pre.drafted))
        elif self.governor.fixed is None and self.governor.arm == "spec":  # a fresh draft while speculation runs:
            # the later stages wait out every step of it (the pre-draft beside its verification drafts all of
            # the governor's K for the next cycle). K fixed, or speculation measured or probed (the governor's
            # arm None or plain; the module docstring): the whole K
            k = self.k = max(1, math.ceil(k * self.fresh_share))
        st["k_histogram"][k] += 1
        st["cycles"] += 1
        drafted, draft_s = [], 0.0
        if pre is not None:  # rows 0 .. len(pre) are in the lookahead: rank 0 planned them, the others get them now
            drafted, draft_s = pre.drafted[:k], pre.seconds * min(k, len(pre.drafted)) / len(pre.drafted)
            o["used_tokens"] += len(drafted)
            if len(drafted) == k and planner is not None:
                self.send_rows(k)
        if len(drafted) < k:
            c0, i0 = clock(), len(drafted)
            drafted, _, _ = self._draft_on(t, n, k, drafted, params, planner, pre.chunk if pre is not None else None)
            draft_s += clock() - c0
            o["steps"] += k - i0  # drafted while no verification ran (their time: draft_s)
            o["draft_s"] += clock() - c0
        m1 = clock()
        before = mgr.stats()
        later = mgr.remote[4]  # the later stages' step seconds since BEGIN, summed
        early = pre is not None and pre.step is not None and len(pre.drafted) >= k
        if early:  # rank 0's stage ran while the last cycle was verified: its first k + 1 rows are this step's
            step = pre.step.first(k + 1)
            o["early_steps"] += 1
        else:
            step = self.model.step(torch.tensor([t] + drafted, device=self.device), n, mgr)
        sent = self.model.send(step, post=True)
        m_sent = clock()
        if self.cancel_leftovers:  # rank 0's stage has verified: its leftovers (the others' after their step)
            mgr.cancel_prefetches()
        if planner is not None:
            planner.end_cycle()
        nxt_pre = self._pre_draft(drafted, n, k, cache, params, sent)
        logits = self.model.receive(sent)
        m2 = clock()
        m, nxt = accept_greedy(drafted, logits)
        mgr.demote_rejected(m + 1)
        pre_s = 0.0  # rank 0's work for the next cycle inside this one's wait
        if nxt_pre is not None:
            pre_s = nxt_pre.seconds + nxt_pre.guess_s + (nxt_pre.step.seconds if nxt_pre.step is not None else 0.0)
            o["pre_drafted"] += 1
            o["pre_draft_s"] += nxt_pre.seconds + nxt_pre.guess_s
            o["pre_steps"] += len(nxt_pre.drafted) + 1
            if m == k and nxt == nxt_pre.guess:
                o["kept"] += 1
                nxt_pre.t, nxt_pre.n = nxt, n + k + 1
                self.pre = nxt_pre
            else:
                self._discard(nxt_pre)
        stall = self._count_verification(before, k, m)
        # the governor: verification as it cost this cycle, rank 0's stage where it ran here (a stage run
        # early ran inside the last cycle's wall, counted there) and the later stages' steps (their seconds
        # come back with the logits), or the wall time less rank 0's work for the next cycle inside it
        # where that is longer (the hand-offs). Drafting:
        # `exposed_draft`, what the cycle's wall time holds beyond its verification (a kept pre-draft's
        # drafts ran beside the last verification; a fresh draft keeps the others waiting), so the
        # cycles' seconds add up to the wall time and the arms compare speculation's real rate with
        # plain steps'; else the drafts' own seconds, as if the two ran one after the other as in one
        # process. (Given the wall times as drafting before verification, a kept pre-draft's cycle looked
        # like free drafts and a slow verification, and it chose K = 0 for most steps; given the wall less
        # the pre-draft alone as verification, it looked as short as the wait after the pre-draft, and it
        # chose half one process's K.)
        verify_s = max(m2 - m1 - pre_s, (m_sent - m1) + (mgr.remote[4] - later))
        if pre is None:
            draft_s = m1 - m0
        d = draft_s / k  # a draft step's own seconds (planners size their chunks by it: draft_step_s)
        self.step_ema = d if self.step_ema is None else 0.75 * self.step_ema + 0.25 * d
        st["draft_s"] += draft_s  # the stats: the drafts' own seconds
        st["verify_s"] += verify_s
        self.governor.observe_cycle(k, m, max(0.0, (m2 - m0) - verify_s) if self.exposed_draft else draft_s, verify_s,
                                    stall, dear=pre is None)  # a fresh draft: the later stages waited it out
        kind = "kept" if pre is not None else "fresh"  # the cycle's wall and tokens, by whether a pre-draft began it
        o[kind + "_cycles"] += 1
        o[kind + "_tokens"] += m + 1
        o[kind + "_s"] += m2 - m0
        return drafted[:m] + [nxt]

    def _draft_on(self, t: int, n: int, k: int, drafted: list[int], params, planner, chunk: int | None,
                  stop=None) -> tuple[list[int], int | None, bool]:
        """Draft steps len(drafted) .. k-1 of the cycle whose token t sits at n (greedy), planning through
        `planner` as _draft does: a fresh cycle (chunk None) begins the planner's cycle; one that goes on
        from pre-drafted rows plans from there on. `stop()`, asked after each step: True ends the
        drafting there (no last plan). -> (drafted, chunk, stopped)."""
        link, st = self.experts.link, self.stage
        if planner is not None and chunk is None:
            chunk = planner.begin_cycle(k, self.draft_step_s())
        tok = drafted[-1] if drafted else t
        for i in range(len(drafted), k):
            st.draft.row = i
            logits = st.draft_forward(torch.tensor([tok], device=self.device), n + i)
            tok = int(sample(logits, params, None, None, drafted))
            drafted.append(tok)
            if stop is not None and stop(drafted):
                st.draft.row = None
                return drafted, chunk, True
            if planner is not None and (i == 0 or ((i + 1) % chunk == 0 and link.pending() <= self.plan_backlog)):
                planner.plan(i + 1)
        st.draft.row = None
        if planner is not None:
            planner.plan(k)
        return drafted, chunk, False

    def _verdict(self, sent: Sent, drafted: list[int], guess: int) -> bool | None:
        """Once the verification of `drafted` has come back: True if a pre-draft on `guess` will be kept
        (every draft accepted, and the target's token is the guess), else False; None before."""
        logits = self.model.logits(sent)
        if logits is None:
            return None
        m, nxt = accept_greedy(drafted, logits)
        return m == len(drafted) and nxt == guess

    def _pre_draft(self, drafted: list[int], n: int, k: int, cache, params, sent: Sent) -> PreDraft | None:
        """While the later stages verify `drafted` (at n+1 .. n+k; `sent`): the draft's step on the last
        drafted token (position pos = n+K) gives its guess of the target's next token; then steps on that
        guess from pos + 1, rank 0's own planner prefetching from their rows (the other ranks get the rows
        if the guess holds, in the next cycle): K of them, or the governor's K where a kept pre-draft
        or fresh_share capped this cycle's (drafting more than the next cycle verifies costs rank 0 steps it may
        need: it drafts more than one process does), stopped once the result has come back and shows
        the guess failed, or held with at least K drafted (the later stages wait for the next cycle
        then). Then, the result not back yet (or kept) and rank 0's stage copying nothing, rank
        0's stage over them. Positions past pos + 1 are scratch (rolled back by position); rank 0's own
        layers' target K/V at pos, which the draft's step overwrites, is put back."""
        pos = n + k
        j = min(max(k, self.k_want), self.need - 3 - pos)  # the next cycle drafts at most to need - 2
        if j < 1:                                           # (SpeculativeDecoder.run)
            return None
        t0 = time.perf_counter()
        st, spec, own = self.stage, self.stage.model.spec, self.stages[0].last
        saved = kv_rows(cache, spec, 0, own, pos, 1)
        st.draft.row = None
        guess = int(sample(st.draft_forward(torch.tensor([drafted[-1]], device=self.device), pos), params, None))
        put_kv_rows(cache, spec, 0, own, pos, 1, saved)
        t1 = time.perf_counter()
        if self._verdict(sent, drafted, guess) is False:
            self.opt["stopped"] += 1
            return PreDraft(guess, [], 0.0, t1 - t0, None)

        def stop(ahead: list[int]) -> bool:
            kept = self._verdict(sent, drafted, guess)
            return kept is False or (kept is True and len(ahead) >= k)
        planner = self.planner.inner if self.planner is not None else None  # the others get the rows if kept
        ahead, chunk, stopped = self._draft_on(guess, pos + 1, j, [], params, planner, None, stop)
        pre = PreDraft(guess, ahead, time.perf_counter() - t1, t1 - t0, chunk)
        kept = self._verdict(sent, drafted, guess)
        if kept is False:
            self.opt["stopped"] += stopped
        elif not stopped and kept is None and (self.experts.local is None or self.experts.local.all_resident):
            pre.step = self.model.step(torch.tensor([guess] + ahead, device=self.device), pos + 1, self.experts)
        return pre

    def _discard(self, pre: PreDraft) -> None:
        """A pre-draft not used: rank 0's prefetches for it withdrawn, its planner's cycle ended (the
        other ranks never saw its rows)."""
        if self.experts.local is not None:
            self.experts.local.cancel_prefetches()
        if self.planner is not None and pre.chunk is not None:
            self.planner.inner.end_cycle()

    def drop_pre(self) -> None:
        """A kept pre-draft that will not be used (a K = 0 step, sampling, the generation's end)."""
        if self.pre is not None:
            self._discard(self.pre)
            self.pre = None
