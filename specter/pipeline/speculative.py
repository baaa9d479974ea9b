"""Speculation across the stages: rank 0's decoder is the single-process SpeculativeDecoder itself,
given stand-ins for the model and the offload manager that reach every rank.

    PipeModel    what the decoder calls its model. A draft step runs on rank 0 alone: its stage holds
                 the whole draft (every layer, stage.StageModel.whole), so the K draft steps of a
                 cycle cross no boundary. A target step is rank 0's stage, then a STEP down the chain
                 with flags saying which experts run (the target's, or with next-layer guesses) and
                 what follows it (decoder.py), and the last stage's logits back with the other
                 ranks' K/V rows (the draft reads the target's K/V of every layer, as in one process)
    PipeExperts  what it calls its offload manager: rank 0's own (None without an MoE layer), plus
                 the other ranks' counters that come back with each target step (stall, hits,
                 misses, bytes), so the governor and the recall stats see the whole pipeline;
                 `demote_rejected` also rides on the next header to every rank
    _PlanRelay   what it calls its planner: rank 0's own (or `_NoPlanner`); each `plan(upto)` also
                 sends the lookahead rows drafted since down the chain (ROWS, not waited for), so
                 every rank's planner reads rows where one process's planner would and starts its
                 own layers' copies while the draft goes on

The governor, acceptance and sampling run on rank 0 only, exactly as in one process (same
generator, history and K choices' rules); each rank's planner prefetches its own layers' experts
from its own columns of the draft's lookahead rows while later draft steps run, and cancels and
demotes as the single-process cycle does. The draft is always the eager one (no compiled steps
under a pipeline).
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from functools import partial

import torch

from ..sampling import accept_greedy, sample
from ..speculative.decoder import SpeculativeDecoder
from ..speculative.governor import Governor
from .decoder import (ALL, BEGIN, CANCEL, CYCLE, END, GUESS, KV, PREFILL, ROWS, SIDE, STATS, STEP, Wire,
                      finish, inline_rows, pipeline_info, summed)
from .group import Group
from .stage import StageModel, kv_row_bytes, kv_rows, put_kv_rows
from .stages import Stage


class _NoLink:
    """Rank 0's link when its stage copies nothing."""

    @staticmethod
    def pending() -> int:
        return 0


class _NoPlanner:
    """Rank 0's planner when its stage has no MoE layer (specter): the other ranks plan their own."""

    cover_hits = cover_total = 0

    def begin_cycle(self, k: int = 0, draft_step_s: float = 0.0) -> int:
        return max(k, 1)

    def begin_prefill(self, tokens: int) -> None:
        pass

    def plan(self, upto: int, host: bool = False) -> int:
        return 0

    def end_cycle(self) -> None:
        pass

    def reset_stats(self) -> None:
        pass


class _PlanRelay:
    """Rank 0's planner as the decoder sees it: each `plan(upto)` (the decoder's planning points: row 0,
    chunk boundaries while rank 0's link is not backlogged, the last row) also sends the lookahead
    rows drafted since the last one down the chain (ROWS), so the other ranks' planners read rows
    where one process's planner would, and no rank wakes for a row it would not plan from."""

    def __init__(self, inner, dec: "PipelineSpeculativeDecoder"):
        self.inner, self.dec = inner, dec

    def plan(self, upto: int, host: bool = False) -> int:
        issued = self.inner.plan(upto, host)
        self.dec.send_rows(upto)
        return issued

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _Draft:
    """What the decoder calls its draft: it sets `row` on it; PipeModel reads it."""

    row = None


class PipeExperts:
    """The decoder's offload manager on rank 0 (see the module docstring)."""

    def __init__(self, stage: StageModel, all_resident: bool):
        self.local, self.all_resident = stage.mgr, all_resident
        self.link = stage.mgr.link if stage.mgr is not None else _NoLink()
        self.remote = [0.0] * len(SIDE)     # the other ranks' counters since BEGIN, summed
        self.per_rank: list[dict] | None = None  # every rank's stats, once the generation has ended
        self.demote = 0                     # rows kept by the last acceptance, for the next header
        self.cancel = False                 # leftovers withdrawn here since the last header: the others too

    def __call__(self, layer, x, ids, weights, guess=None):
        raise RuntimeError("PipeModel runs each stage's own experts; PipeExperts only names them")

    def stats(self) -> dict:
        if self.per_rank is not None:
            return summed(self.per_rank)
        s = self.local.stats() if self.local is not None else {}
        for k, v in zip(SIDE[:4], self.remote):
            s[k] = s.get(k, 0) + (int(v) if k != "stall_s" else v)
        return s

    def reset_stats(self) -> None:
        if self.local is not None:
            self.local.reset_stats()
        self.remote = [0.0] * len(SIDE)
        self.per_rank = None

    def cancel_prefetches(self) -> int:
        self.cancel = True
        return self.local.cancel_prefetches() if self.local is not None else 0

    def demote_rejected(self, kept_rows: int) -> None:
        if self.local is not None:
            self.local.demote_rejected(kept_rows)
        self.demote = kept_rows

    def pending(self) -> tuple[int, int]:
        """(CANCEL or 0, demote) for the next header, then cleared."""
        out = (CANCEL if self.cancel else 0, self.demote)
        self.cancel, self.demote = False, 0
        return out

    def close(self) -> None:
        """The stage closes it (finish)."""


@dataclass
class PreDraft:
    """The next cycle's drafts, drafted while the later stages verified this one, on the guess that
    all K drafts are accepted and the target's own token is `guess` (the draft's token after d_K)."""
    guess: int
    drafted: list[int]   # drafted on the guess, at positions n+K+1 ...: lookahead rows 0 .. len-1
    seconds: float       # drafting them took (planning included)
    guess_s: float       # the step that gave the guess took
    chunk: int | None    # rank 0's planner's steps between plans (None: no planner)
    t: int = -1          # once kept: the next cycle's pending token and its position
    n: int = -1


class PipeModel:
    """The decoder's model on rank 0 (see the module docstring)."""

    def __init__(self, dec: "PipelineSpeculativeDecoder"):
        self.dec, self.spec = dec, dec.stage.model.spec
        stages = dec.stages
        row = kv_row_bytes(self.spec, dec.stage.dtype)
        self.kv = [(s.first, s.last, (s.last - s.first) * row) for s in stages[1:]]  # what each rank returns

    def __call__(self, tokens: torch.Tensor, start: int, cache, experts, logits_for: str = "all") -> torch.Tensor:
        d, st = self.dec, self.dec.stage
        if experts is d.draft:  # the whole draft, here (its rows go down the chain as rank 0 plans)
            st.draft.row = d.draft.row
            return st.draft_forward(tokens, start, logits_for)
        if d.pre is not None:  # a K = 0 step after a kept pre-draft (verifications call send and receive)
            d.drop_pre()
        return self.receive(self.send(tokens, start, experts, logits_for))

    def send(self, tokens: torch.Tensor, start: int, experts, logits_for: str = "all") -> tuple[int, int, int]:
        """Rank 0's stage of a target step, then the STEP down the chain -> what `receive` needs."""
        d, st = self.dec, self.dec.stage
        T = tokens.shape[0]
        flags, local = (ALL if logits_for == "all" else 0) | STATS | KV, None
        if isinstance(experts, partial):  # the decoder's next-layer fallback (K = 0 steps)
            flags |= GUESS
            local = st.guessing
        elif flags & ALL and T > 1:
            flags |= CYCLE
        if d.prompt:  # the generation's first step: each rank's planner begins it as the decoder's does
            flags, d.prompt = flags | PREFILL, False
        x = st.forward(tokens, start, local, logits_for)
        cancel, demote = d.experts.pending()
        d.wire.send_header(1, STEP, T, start, flags=flags | cancel, demote=demote, x=x)
        return T, start, flags

    def receive(self, sent: tuple[int, int, int]) -> torch.Tensor:
        """The last stage's logits of the step `send` sent, and every later rank's K/V rows into rank 0's cache."""
        d, st = self.dec, self.dec.stage
        T, start, flags = sent
        w, last = d.wire, self.kv[-1]
        logits, remote, kv = w.recv_result(d.group.world - 1, T if flags & ALL else 1, self.spec.vocab_size, True,
                                           d.device, kv=T * last[2])
        d.experts.remote = remote
        for r, (first, end, n) in enumerate(self.kv[:-1], 1):  # the middle ranks' own sends
            put_kv_rows(st.cache, self.spec, first, end, start, T, w.recv_bytes(r, T * n))
        put_kv_rows(st.cache, self.spec, last[0], last[1], start, T, kv)
        return logits


class PipelineSpeculativeDecoder(SpeculativeDecoder):
    """Rank 0's decoder for spec-lru and specter: SpeculativeDecoder's run and cycle over PipeModel and
    PipeExperts; BEGIN before and END after each generation, as PipelineDecoder does."""

    def __init__(self, stage: StageModel, group: Group, stages: list[Stage], *, planner: bool, k_max: int,
                 all_resident: bool):
        self.stage, self.group, self.stages = stage, group, stages
        self.wire = Wire(group, stage.model.spec.hidden, stage.dtype, inline_rows(k_max))
        self._closed = False
        self.lock = threading.Lock()  # held by a generation, from BEGIN to END (decoder.keep_alive)
        self.k = 0  # the running cycle's K (the remote planners begin their cycles with it)
        self.remote_plans = planner and group.world > 1  # the other ranks' planners read ROWS
        self.rows_sent = 0  # the running cycle's lookahead rows sent down the chain so far
        self.prompt = False  # the next target step is a generation's prompt (PREFILL)
        # optimistic drafting (greedy, no penalties): while the later stages verify a cycle, rank 0 drafts
        # the next one on the guess that all K are accepted (`pre`; kept when the guess held)
        self.optimistic = os.environ.get("SPECTER_PIPELINE_OPTIMISTIC", "1") != "0"
        self.pre: PreDraft | None = None
        self.need = 0  # the running generation's positions
        plan = _PlanRelay(stage.planner or _NoPlanner(), self) if planner else None
        fallback = object() if planner else None  # a K = 0 step guesses: each stage its own (GUESS)
        super().__init__(PipeModel(self), PipeExperts(stage, all_resident), _Draft(), stage.device, stage.dtype,
                         governor=Governor(k_max), planner=plan, fallback=fallback)

    def run(self, prompt, params, max_new):
        return self._generation(prompt, params, max_new)

    @property
    def broken(self) -> str | None:
        """Why the pipeline cannot go on (a failed exchange), or None."""
        return self.wire.broken

    def _generation(self, prompt, params, max_new):
        need = len(prompt) + max_new
        with self.lock:
            self.experts.per_rank = None
            self.stage.begin(need)
            self.wire.trips, self.wire.wait_s, self.stage.step_s = 0, 0.0, 0.0
            self.prompt, self.need, self.pre = True, need, None
            self.wire.send_header(1, BEGIN, max_len=need)
            try:
                yield from super().run(prompt, params, max_new)
            finally:
                self.drop_pre()
                if not self.wire.broken:
                    cancel, demote = self.experts.pending()
                    self.wire.send_header(1, END, flags=cancel, demote=demote)
                    self.experts.per_rank = self.wire.gather_stats(dict(self.stage.stats(), wire_s=self.wire.wait_s))

    def _kv_cache(self, need: int):
        return self.stage.cache  # each rank's own stage cache, made at BEGIN

    def send_rows(self, upto: int) -> None:
        """Lookahead rows [rows_sent, upto) of the running cycle down the chain (ROWS, not waited for)."""
        first = self.rows_sent
        if not self.remote_plans or upto <= first:
            return
        cancel, demote = self.experts.pending()
        ids = self.stage.whole_lookahead.ids[first:upto].reshape(-1).view(torch.uint8)
        self.wire.send_header(1, ROWS, ids.numel(), flags=cancel, row=first, k=self.k,
                              draft_us=int((self.governor.draft_s or 0.0) * 1e6), demote=demote, payload=ids,
                              wait=False)
        self.rows_sent = upto

    def _cycle(self, t, n, k, cache, params, gen, hist):
        self.k, self.rows_sent = k, 0
        if self.optimistic and params.greedy and hist is None:
            return self._optimistic_cycle(t, n, k, cache, params)
        self.drop_pre()
        return super()._cycle(t, n, k, cache, params, gen, hist)

    def _optimistic_cycle(self, t: int, n: int, k: int, cache, params) -> list[int]:
        """One greedy cycle as SpeculativeDecoder._cycle runs it, except that rank 0 drafts the next
        cycle while the later stages verify this one (`_pre_draft`), and drafts this one only past what
        the last cycle pre-drafted for it. The committed tokens are the target's, whatever was drafted."""
        st, mgr, planner, clock = self._stats, self.experts, self.planner, time.perf_counter
        st["k_histogram"][k] += 1
        st["cycles"] += 1
        o = self.opt
        m0 = clock()
        pre, self.pre = self.pre, None
        if pre is not None and (pre.t, pre.n) != (t, n):  # not what it was kept for (cannot happen: safety)
            self._discard(pre)
            pre = None
        drafted, draft_s = [], 0.0
        if pre is not None:  # rows 0 .. len(pre) are in the lookahead: rank 0 planned them, the others get them now
            drafted, draft_s = pre.drafted[:k], pre.seconds * min(k, len(pre.drafted)) / len(pre.drafted)
            o["used_tokens"] += len(drafted)
            if len(drafted) == k and planner is not None:
                self.send_rows(k)
        if len(drafted) < k:
            c0, i0 = clock(), len(drafted)
            drafted, _ = self._draft_on(t, n, k, drafted, params, planner,
                                        pre.chunk if pre is not None else None)
            draft_s += clock() - c0
            o["steps"] += k - i0  # drafted while no verification ran (their time: draft_s)
            o["draft_s"] += clock() - c0
        m1 = clock()
        before = mgr.stats()
        tokens = torch.tensor([t] + drafted, device=self.device)
        later = mgr.remote[4]  # the later stages' step seconds since BEGIN, summed
        sent = self.model.send(tokens, n, mgr)
        m_sent = clock()
        if self.cancel_leftovers:  # rank 0's stage has verified: its leftovers (the others' after their step)
            mgr.cancel_prefetches()
        if planner is not None:
            planner.end_cycle()
        nxt_pre = self._pre_draft(drafted[-1], n + k, k, cache, params)
        logits = self.model.receive(sent)
        m2 = clock()
        m, nxt = accept_greedy(drafted, logits)
        mgr.demote_rejected(m + 1)
        if nxt_pre is not None:
            o["pre_drafted"] += 1
            o["pre_draft_s"] += nxt_pre.seconds + nxt_pre.guess_s
            o["pre_steps"] += len(nxt_pre.drafted) + 1
            if m == k and nxt == nxt_pre.guess:
                o["kept"] += 1
                nxt_pre.t, nxt_pre.n = nxt, n + k + 1
                self.pre = nxt_pre
            else:
                self._discard(nxt_pre)
        after = mgr.stats()
        stall = after["stall_s"] - before["stall_s"]
        hits = after["expert_hits"] - before["expert_hits"]
        st["recall_hits"] += hits
        st["recall_total"] += hits + after["expert_misses"] - before["expert_misses"]
        st["drafted_tokens"] += k
        st["accepted_tokens"] += m
        st["rejections"] += m < k
        # the governor sees what drafting and verifying cost as if they ran one after the other (as in one
        # process): this cycle's drafts, pre-drafted or not, and its verification: rank 0's stage and the
        # later stages' steps (their seconds come back with the logits), or the wall time less the
        # pre-draft inside it where that is longer (the hand-offs). (Given the wall times instead, a kept
        # pre-draft's cycle looks like free drafts and a slow verification, and it chose K = 0 for most
        # steps; given the wall less the pre-draft alone, verification looks as short as the wait after
        # the pre-draft, and it chose half one process's K.)
        pre_s = (nxt_pre.seconds + nxt_pre.guess_s) if nxt_pre is not None else 0.0
        verify_s = (m_sent - m1) + (mgr.remote[4] - later)
        self._observe_cycle(k, m, stall, (m1 - m0) if pre is None else draft_s, max(m2 - m1 - pre_s, verify_s))
        return drafted[:m] + [nxt]

    def _draft_on(self, t: int, n: int, k: int, drafted: list[int], params, planner, chunk: int | None
                  ) -> tuple[list[int], int | None]:
        """Draft steps len(drafted) .. k-1 of the cycle whose token t sits at n (greedy), planning through
        `planner` as _draft does: a fresh cycle (chunk None) begins the planner's cycle; one that goes on
        from pre-drafted rows plans from there on. -> (drafted, chunk)."""
        link, st = self.experts.link, self.stage
        if planner is not None and chunk is None:
            chunk = planner.begin_cycle(k, self.governor.draft_s or 0.0)
        tok = drafted[-1] if drafted else t
        for i in range(len(drafted), k):
            st.draft.row = i
            logits = st.draft_forward(torch.tensor([tok], device=self.device), n + i)
            tok = int(sample(logits, params, None, None, drafted))
            drafted.append(tok)
            if planner is not None and (i == 0 or ((i + 1) % chunk == 0 and link.pending() <= self.plan_backlog)):
                planner.plan(i + 1)
        st.draft.row = None
        if planner is not None:
            planner.plan(k)
        return drafted, chunk

    def _pre_draft(self, last: int, pos: int, k: int, cache, params) -> PreDraft | None:
        """While the later stages verify: the draft's step on the last drafted token `last` (position
        `pos` = n+K) gives its guess of the target's next token; then up to K steps on that guess from
        pos + 1, rank 0's own planner prefetching from their rows (the other ranks get the rows if the
        guess holds, in the next cycle). Positions past pos + 1 are scratch (rolled back by position);
        rank 0's own layers' target K/V at pos, which the draft's step overwrites, is put back."""
        j = min(k, self.need - 3 - pos)  # the next cycle drafts at most to need - 2 (SpeculativeDecoder.run)
        if j < 1:
            return None
        t0 = time.perf_counter()
        st, spec, own = self.stage, self.stage.model.spec, self.stages[0].last
        saved = kv_rows(cache, spec, 0, own, pos, 1)
        st.draft.row = None
        guess = int(sample(st.draft_forward(torch.tensor([last], device=self.device), pos), params, None))
        put_kv_rows(cache, spec, 0, own, pos, 1, saved)
        t1 = time.perf_counter()  # rank 0's own planner: the other ranks get the rows if the guess holds
        drafted, chunk = self._draft_on(guess, pos + 1, j, [], params,
                                        self.planner.inner if self.planner is not None else None, None)
        return PreDraft(guess, drafted, time.perf_counter() - t1, t1 - t0, chunk)

    def _discard(self, pre: PreDraft) -> None:
        """A pre-draft not used: rank 0's prefetches for it withdrawn, its planner's cycle ended (the
        other ranks never saw its rows)."""
        if self.experts.local is not None:
            self.experts.local.cancel_prefetches()
        if self.planner is not None:
            self.planner.inner.end_cycle()

    def drop_pre(self) -> None:
        """A kept pre-draft that will not be used (a K = 0 step, sampling, the generation's end)."""
        if self.pre is not None:
            self._discard(self.pre)
            self.pre = None

    def reset_stats(self) -> None:
        super().reset_stats()
        # pre-drafts made, kept, their tokens verified, their steps and seconds (the guess's step included);
        # the steps drafted while no verification ran, and their seconds
        self.opt = dict(pre_drafted=0, kept=0, used_tokens=0, pre_steps=0, pre_draft_s=0.0, steps=0, draft_s=0.0)

    def stats(self) -> dict:
        s = super().stats()
        per = self.experts.per_rank
        if per and self.planner is not None:  # coverage over every rank's planner
            s["cover_hits"] = sum(r.get("cover_hits", 0) for r in per)
            s["cover_total"] = sum(r.get("cover_total", 0) for r in per)
            s["route_coverage"] = s["cover_hits"] / s["cover_total"] if s["cover_total"] else None
        s["pipeline"] = dict(pipeline_info(self.group, self.stages, self.wire), per_rank=per,
                             optimistic=dict(self.opt) if self.optimistic else None)
        return s

    def close(self) -> None:
        """The Engine's close: nothing here; the launcher ends the pipeline (`finish`)."""

    def finish(self, abort: bool = False) -> None:
        finish(self, abort)
