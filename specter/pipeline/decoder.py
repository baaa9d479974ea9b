"""Decoding across the stages.

Rank 0 runs the Engine (tokenizer, sampling, stop strings, stats) with `PipelineDecoder` (plain
policies) or speculative.PipelineSpeculativeDecoder (spec-lru, specter) as its decoder; every other
rank runs `serve_stage`. Messages go down the chain 0 -> 1 -> ... -> N-1, each a header [command,
T, start, max_len, flags, row, k, draft_us, demote] (int64) and, for a step, the hidden state [T, H]:

    BEGIN   a generation of at most max_len positions: each rank makes its stage's KV cache
    STEP    T positions from `start`: each rank runs its layers on the hidden state it receives and
            sends the result on; the last stage sends the fp32 logits back to rank 0 ([1, V] of the
            last position, or [T, V] with ALL), which samples exactly as one process does (same
            generator, history). `flags` say which experts run and what follows (below)
    END     the generation is over: every rank's expert stats are gathered on rank 0
    STOP    no more generations: every rank leaves its loop
    ABORT   rank 0 failed (its error says why) or was interrupted: the other ranks leave with an error
    PING    nothing (passed on): an idle server's rank 0 sends it every quarter of the timeout, so
            the other ranks' waits between generations never time out (`keep_alive`)

    ROWS    (specter) lookahead rows from `row` on: rank 0 runs the whole draft itself
            (stage.StageModel.whole) and, wherever its decoder plans (after row 0, at chunk
            boundaries while rank 0's link is not backlogged, after row k-1), sends the router
            choices drafted since for every MoE layer ([rows, L_moe, top_k] int32, `T` bytes) down
            the chain without waiting; each rank copies its own layers' columns into its lookahead
            and its planner reads them and prefetches. Row 0 begins the cycle (of `k` drafted
            tokens) on the rank's planner (`draft_us`: the governor's draft time a token)

Flags of a step (the speculative decoder's; 0 for plain decoding):
    GUESS   a K = 0 step with next-layer guesses within each stage
    CYCLE   a cycle's verification: after it each stage withdraws its leftover prefetches and ends
            its planner's cycle
    STATS   each rank adds its expert counters since BEGIN (stall_s, hits, misses, bytes off the
            device) and its stage's step seconds to a float64 [5] that follows the hidden state; the
            last rank returns the sums with the logits: what the governor and the recall stats read
            each cycle
    KV      (every target step where rank 0 holds the whole draft: a drafting policy, k_max > 0) each rank
            after the first returns its layers' K/V at the step's positions to rank 0, whose whole draft
            reads them as the single-process draft reads the target's: the last rank after its logits,
            the others in a send of their own
    PREFILL (specter) the prompt: each rank's planner begins it first (PrefetchPlanner.begin_prefill),
            as rank 0's decoder does
`demote` (> 0): rank 0's acceptance kept that many verified rows; each rank demotes the experts
only the rejected rows used (OffloadedExperts.demote_rejected) before anything else. CANCEL (on
any header): rank 0's decoder withdrew its leftover prefetches since the last message (after a run
of K = 0 steps with guesses); each rank withdraws its own first. KV caches roll back by position:
the next step writes from its smaller `start`.

Every receive is bounded by the group's timeout, and a peer that dies closes its connections; the
exchange then raises a PipelineError on the rank that saw it (group.comm).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch

from ..sampling import History, SamplingParams, sample
from .group import Group, PipelineError
from .stage import StageModel
from .stages import Stage
from .wire import (ABORT, ALL, BEGIN, CANCEL, CYCLE, END, GUESS, KV, PER_RANK_ONLY, PING, PREFILL, ROWS, STATS, STEP,
                   STOP, SUMMED, Wire, inline_rows)


def pipeline_info(group: Group, stages: list[Stage], wire: Wire) -> dict:
    """stats["pipeline"] less per_rank; round_trips: the steps that went through every stage and back
    (prefill, each verification or plain step; draft steps run on rank 0 alone)."""
    return {"ranks": group.world, "layers": [[s.first, s.last] for s in stages], "backend": group.backend,
            "round_trips": wire.trips}


class PipelineDecoder:
    """Rank 0's decoder (the Engine's): prefill, then one step per token, through every stage."""

    def __init__(self, stage: StageModel, group: Group, stages: list[Stage]):
        spec = stage.model.spec
        self.stage, self.group, self.stages = stage, group, stages
        self.wire = Wire(group, spec.hidden, stage.dtype)
        self.device, self.dtype = stage.device, stage.dtype
        self.model = stage.model
        self._per_rank: list[dict] | None = None
        self._closed = False
        self.lock = threading.Lock()  # held by a generation, from BEGIN to END (keep_alive's pings wait)

    @property
    def broken(self) -> str | None:
        """Why the pipeline cannot go on (a failed exchange), or None."""
        return self.wire.broken

    def run(self, prompt: list[int], params: SamplingParams, max_new: int) -> Iterator[list[int]]:
        return self._steps(prompt, params, max_new)

    def _steps(self, prompt, params, max_new):
        with self.lock:
            yield from self._locked(prompt, params, max_new)

    def _locked(self, prompt, params, max_new):
        self._per_rank = None
        max_len = len(prompt) + max_new
        self.stage.begin(max_len)
        self.wire.trips, self.wire.wait_s, self.stage.step_s = 0, 0.0, 0.0
        self.wire.send_header(1, BEGIN, max_len=max_len)
        interrupted = False
        try:
            draws = params.draws(self.device)
            hist = History(prompt, self.device) if params.penalized else None  # what penalties look at
            logits = self._forward(torch.tensor(prompt, device=self.device), 0)  # [1, V]
            pos = len(prompt)
            for _ in range(max_new):
                tok = sample(logits, params, draws, hist, pos=pos)  # [1]: the token at position pos
                if hist is not None:
                    hist.commit([int(tok)])
                yield [int(tok)]
                logits = self._forward(tok.reshape(1), pos)
                pos += 1
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            with after_interrupt(interrupted):
                if not self.wire.broken:
                    self.wire.send_header(1, END)
                    self._per_rank = self.wire.gather_stats(dict(self.stage.stats(), wire_s=self.wire.wait_s))

    def _forward(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        x = self.stage.forward(tokens, start)  # [T, H]
        T = tokens.shape[0]
        self.wire.send_header(1, STEP, T, start, x=x)
        last = self.group.world - 1
        return self.wire.recv_result(last, 1, self.model.spec.vocab_size, False, self.device)[0]

    def stats(self) -> dict:
        """Rank 0's expert stats until the generation ends; then the sum over the ranks, each rank's own
        under pipeline.per_rank."""
        out = summed(self._per_rank or [self.stage.stats()])
        if self._per_rank:  # every rank's stalls after its own prompt step (the engine knows only rank 0's)
            out["decode_stall_s"] = out.get("stall_s", 0.0) - out.get("prefill_stall_s", 0.0)
        out["pipeline"] = dict(pipeline_info(self.group, self.stages, self.wire), per_rank=self._per_rank)
        return out

    def reset_stats(self) -> None:
        self.stage.reset_stats()

    def close(self) -> None:
        """The Engine's close: nothing here; the launcher ends the pipeline (`finish`)."""

    def finish(self, abort: bool = False, interrupted: bool = False) -> None:
        """Ends every rank's loop (abort: with an error there). Idempotent; nothing is sent on a
        broken pipeline."""
        finish(self, abort, interrupted)


def finish(dec, abort: bool, interrupted: bool = False) -> None:
    """Rank 0's decoder `dec` (wire, stage, lock, _closed) ends every rank's loop, then closes its stage;
    it waits (at most the group's timeout) for a generation still running on another thread. `interrupted`
    (a Ctrl-C): a generation left suspended holds the lock (its stream was being printed), so nothing is
    waited for; with the lock held elsewhere, nothing more is sent at all (the peers were interrupted
    too, and the suspended generation's own end, at exit, must not be sent either)."""
    if dec._closed:
        return
    dec._closed = True
    held = dec.lock.acquire(timeout=0 if interrupted else dec.group.timeout_s)
    if interrupted and not held:
        dec.wire.broken = dec.wire.broken or "interrupted (Ctrl-C)"
    try:
        if not dec.wire.broken:
            dec.wire.send_header(1, ABORT if abort else STOP)
    finally:
        if held:
            dec.lock.release()
        dec.stage.close()


@contextmanager
def after_interrupt(interrupted: bool):
    """Around what rank 0 sends as a Ctrl-C unwinds: a failed exchange is not reported (Ctrl-C reaches
    every rank, so the peers are gone), the interrupt is."""
    try:
        yield
    except PipelineError:
        if not interrupted:
            raise


@contextmanager
def keep_alive(dec, every: float | None = None):
    """While the body runs (a server waiting for requests), rank 0's decoder `dec` sends PING down the
    chain every `every` seconds (default a quarter of the group's timeout) when no generation holds
    its lock, so the other ranks' waits never time out; a PING that fails marks the pipeline broken
    (`dec.broken`), which a server answers with 503."""
    every = dec.group.timeout_s / 4 if every is None else every
    stop = threading.Event()

    def beat():
        while not stop.wait(every) and not dec.wire.broken and not dec._closed:
            if dec.lock.acquire(blocking=False):
                try:
                    dec.wire.send_header(1, PING)
                except PipelineError:
                    return  # dec.wire.broken says why
                finally:
                    dec.lock.release()

    t = threading.Thread(target=beat, name="specter-pipeline-ping", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def summed(per: list[dict]) -> dict:
    """Rank 0's stats with the SUMMED counters (and cover_hits/cover_total) added over every rank's."""
    out = {k: v for k, v in per[0].items() if k not in PER_RANK_ONLY}
    for s in per[1:]:
        for k in SUMMED + ("cover_hits", "cover_total"):
            if k in s:
                out[k] = out.get(k, 0) + s[k]
        for k in ("h2d_path", "time_scale", "host_threads"):  # rank 0's, or the first rank's that copies (has a lane)
            if out.get(k) is None and s.get(k) is not None:
                out[k] = s[k]
    return out


def serve_stage(stage: StageModel, group: Group) -> None:
    """Every rank but 0: runs its stage for each message from the previous rank until STOP."""
    from .stage import kv_rows

    spec, r = stage.model.spec, group.rank
    wire = Wire(group, spec.hidden, stage.dtype, inline_rows(stage.k_max))
    prev, nxt, last = r - 1, r + 1, r == group.world - 1
    mgr, planner = stage.mgr, stage.planner
    try:
        while True:
            h, side, x = wire.receive(prev, stage.device)
            cmd, T, start, max_len, flags, row, k, draft_us, demote = h
            if demote and mgr is not None:
                mgr.demote_rejected(demote)
            if flags & CANCEL and mgr is not None:
                mgr.cancel_prefetches()
            if cmd == ROWS:
                if not last:
                    wire.forward(nxt, h, payload=x)
                if planner is not None:  # rank 0 planned here: this rank plans from its own columns
                    if row == 0:
                        planner.begin_cycle(k, draft_us / 1e6)
                    ids = x.view(torch.int32).view(-1, spec.n_moe_layers, spec.top_k)
                    end = row + ids.shape[0]
                    stage.lookahead.ids[row:end].copy_(ids[:, stage.stage.moe_first:stage.stage.moe_last])
                    planner.plan(end)
                continue
            if cmd == STEP:
                if flags & PREFILL and planner is not None:
                    planner.begin_prefill(T)
                experts = stage.guessing if flags & GUESS else None  # None: the target's
                y = stage.forward(x, start, experts, "all" if flags & ALL else "last")
                if flags & STATS:  # this rank's counters since BEGIN, added on
                    s = mgr.stats() if mgr is not None else {}
                    side += torch.tensor([s.get("stall_s", 0.0), s.get("expert_hits", 0), s.get("expert_misses", 0),
                                          s.get("offloaded_bytes", 0), stage.step_s],
                                         dtype=torch.float64)
                kv = kv_rows(stage.cache, spec, stage.stage.first, stage.stage.last, start, T) if flags & KV else None
                if last:
                    wire.send_result(y, side if flags & STATS else None, kv)
                else:
                    wire.forward(nxt, h, y, side)
                    if kv is not None:  # straight to rank 0, which takes it after the logits
                        wire.send_bytes(0, kv, wait=False)
                if mgr is not None and flags & CYCLE:
                    mgr.cancel_prefetches()  # what verification did not wait for, it did not need
                if planner is not None and flags & CYCLE:
                    planner.end_cycle()
                continue
            if not last:
                wire.forward(nxt, h)
            if cmd == PING:
                continue
            if cmd == BEGIN:
                stage.reset_stats()
                stage.begin(max_len)
                wire.wait_s = 0.0
            elif cmd == END:
                wire.drain()
                wire.gather_stats(dict(stage.stats(), wire_s=wire.wait_s))
            elif cmd == STOP:
                wire.drain()
                return
            elif cmd == ABORT:
                raise PipelineError(f"rank {r} of {group.world}: rank 0 stopped the pipeline after an error (rank "
                                    "0's message says what) or an interrupt (Ctrl-C)")
            else:
                raise PipelineError(f"rank {r} of {group.world}: unknown message {cmd} from rank {prev}")
    finally:
        stage.close()
