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
    PlanRelay    what it calls its planner: rank 0's own (or `NoPlanner`); each `plan(upto)` also
                 sends the lookahead rows drafted since down the chain (ROWS, not waited for), so
                 every rank's planner reads rows where one process's planner would and starts its
                 own layers' copies while the draft goes on

The governor, acceptance and sampling run on rank 0 only, exactly as in one process (same
generator, history and K choices' rules); each rank's planner prefetches its own layers' experts
from its own columns of the draft's lookahead rows while later draft steps run, and cancels and
demotes as the single-process cycle does. The draft is always the eager one (no compiled steps
under a pipeline).

standins.py holds the stand-ins; optimistic.py the greedy cycles, in which rank 0 drafts the next
cycle while the later stages verify this one.
"""
from __future__ import annotations

import os
import threading

import torch

from ..speculative.decoder import SpeculativeDecoder
from ..speculative.governor import Governor
from .decoder import after_interrupt, finish, pipeline_info
from .group import Group
from .optimistic import OptimisticCycles, PreDraft, optimistic_stats
from .stage import StageModel
from .stages import Stage
from .standins import DraftSlot, NoPlanner, PipeExperts, PipeModel, PlanRelay
from .wire import BEGIN, END, ROWS, Wire, inline_rows


class PipelineSpeculativeDecoder(OptimisticCycles, SpeculativeDecoder):
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
        plan = PlanRelay(stage.planner or NoPlanner(), self) if planner else None
        fallback = object() if planner else None  # a K = 0 step guesses: each stage its own (GUESS)
        super().__init__(PipeModel(self), PipeExperts(stage, all_resident), DraftSlot(), stage.device, stage.dtype,
                         governor=Governor(k_max, spec_probe=3), planner=plan, fallback=fallback)

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
            interrupted = False
            try:
                yield from super().run(prompt, params, max_new)
            except KeyboardInterrupt:
                interrupted = True
                raise
            finally:
                with after_interrupt(interrupted):
                    self.drop_pre()
                    if not self.wire.broken:
                        cancel, demote = self.experts.pending()
                        self.wire.send_header(1, END, flags=cancel, demote=demote)
                        self.experts.per_rank = self.wire.gather_stats(dict(self.stage.stats(),
                                                                            wire_s=self.wire.wait_s))

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
                              draft_us=int(self.draft_step_s() * 1e6), demote=demote, payload=ids,
                              wait=False)
        self.rows_sent = upto

    def _cycle(self, t, n, k, cache, params, draws, hist):
        self.k, self.rows_sent = k, 0
        if self.optimistic and params.greedy and hist is None:
            return self._optimistic_cycle(t, n, k, cache, params)
        self.drop_pre()
        return super()._cycle(t, n, k, cache, params, draws, hist)

    def reset_stats(self) -> None:
        super().reset_stats()
        self.opt = optimistic_stats()

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

    def finish(self, abort: bool = False, interrupted: bool = False) -> None:
        finish(self, abort, interrupted)
