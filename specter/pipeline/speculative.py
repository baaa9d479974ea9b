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

import threading
from functools import partial

import torch

from ..speculative.decoder import SpeculativeDecoder
from ..speculative.governor import Governor
from .decoder import (ALL, BEGIN, CANCEL, CYCLE, END, GUESS, KV, PREFILL, ROWS, SIDE, STATS, STEP, Wire,
                      finish, inline_rows, pipeline_info, summed)
from .group import Group
from .stage import StageModel, kv_row_bytes, put_kv_rows
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
        for k, v in zip(SIDE[:3], self.remote):
            s[k] = s.get(k, 0) + (int(v) if k != "stall_s" else v)
        return s

    @property
    def offloaded_bytes(self) -> int:
        return (self.local.offloaded_bytes if self.local is not None else 0) + int(self.remote[3])

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
        w = d.wire
        cancel, demote = d.experts.pending()
        w.send_header(1, STEP, T, start, flags=flags | cancel, demote=demote, x=x)
        last = self.kv[-1]
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
            self.prompt = True
            self.wire.send_header(1, BEGIN, max_len=need)
            try:
                yield from super().run(prompt, params, max_new)
            finally:
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

    def _cycle(self, t, n, k, *rest):
        self.k, self.rows_sent = k, 0
        return super()._cycle(t, n, k, *rest)

    def stats(self) -> dict:
        s = super().stats()
        per = self.experts.per_rank
        if per and self.planner is not None:  # coverage over every rank's planner
            s["cover_hits"] = sum(r.get("cover_hits", 0) for r in per)
            s["cover_total"] = sum(r.get("cover_total", 0) for r in per)
            s["route_coverage"] = s["cover_hits"] / s["cover_total"] if s["cover_total"] else None
        s["pipeline"] = dict(pipeline_info(self.group, self.stages, self.wire), per_rank=per)
        return s

    def close(self) -> None:
        """The Engine's close: nothing here; the launcher ends the pipeline (`finish`)."""

    def finish(self, abort: bool = False) -> None:
        finish(self, abort)
