"""Rank 0's stand-ins for the model and the offload manager that reach every stage (speculative.py
says how the decoder uses them): PipeModel, PipeExperts, PlanRelay and the little ones."""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import torch

from .stage import StageModel, kv_row_bytes, put_kv_rows
from .decoder import summed
from .wire import ALL, CANCEL, CYCLE, GUESS, KV, PREFILL, SIDE, STATS, STEP, Posted


class NoLink:
    """Rank 0's link when its stage copies nothing."""

    @staticmethod
    def pending() -> int:
        return 0


class NoPlanner:
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


class PlanRelay:
    """Rank 0's planner as the decoder sees it: each `plan(upto)` (the decoder's planning points: row 0,
    chunk boundaries while rank 0's link is not backlogged, the last row) also sends the lookahead
    rows drafted since the last one down the chain (ROWS), so the other ranks' planners read rows
    where one process's planner would, and no rank wakes for a row it would not plan from."""

    def __init__(self, inner, dec):
        self.inner, self.dec = inner, dec

    def plan(self, upto: int, host: bool = False) -> int:
        issued = self.inner.plan(upto, host)
        self.dec.send_rows(upto)
        return issued

    def __getattr__(self, name):
        return getattr(self.inner, name)


class DraftSlot:
    """What the decoder calls its draft: it sets `row` on it; PipeModel reads it."""

    row = None


class PipeExperts:
    """The decoder's offload manager on rank 0 (see the module docstring)."""

    def __init__(self, stage: StageModel, all_resident: bool):
        self.local, self.all_resident = stage.mgr, all_resident
        self.link = stage.mgr.link if stage.mgr is not None else NoLink()
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
class Step:
    """Rank 0's stage of a target step, computed and not sent yet (PipeModel.step)."""
    x: torch.Tensor      # its hidden state [T, H]
    start: int
    flags: int
    seconds: float       # rank 0's stage took

    @property
    def T(self) -> int:
        return self.x.shape[0]

    def first(self, rows: int) -> "Step":
        """The step over its first `rows` positions (rows >= 2: still a cycle's verification). Each
        row of a causal stage reads only the positions up to its own, so these are the rows a step
        over those positions alone gives."""
        return Step(self.x[:rows], self.start, self.flags, self.seconds * rows / self.T)


@dataclass
class Sent:
    """A target step sent down the chain (PipeModel.send): what `receive` needs."""
    T: int
    start: int
    flags: int
    posted: Posted | None  # its result's receive, posted (post=True), else received when asked


class PipeModel:
    """The decoder's model on rank 0 (see the module docstring of speculative.py)."""

    def __init__(self, dec):
        self.dec, self.spec = dec, dec.stage.model.spec
        stages = dec.stages
        row = kv_row_bytes(self.spec, dec.stage.dtype)  # what each rank returns: the whole draft reads every
        self.kv = [(s.first, s.last, (s.last - s.first) * row) for s in stages[1:]] if dec.stage.whole else []
        # layer's K/V; without one (k_max 0) no rank returns any

    def __call__(self, tokens: torch.Tensor, start: int, cache, experts, logits_for: str = "all") -> torch.Tensor:
        d, st = self.dec, self.dec.stage
        if experts is d.draft:  # the whole draft, here (its rows go down the chain as rank 0 plans)
            st.draft.row = d.draft.row
            return st.draft_forward(tokens, start, logits_for)
        if d.pre is not None:  # a K = 0 step after a kept pre-draft (verifications call step, send, receive)
            d.drop_pre()
        return self.receive(self.send(self.step(tokens, start, experts, logits_for)))

    def step(self, tokens: torch.Tensor, start: int, experts, logits_for: str = "all") -> Step:
        """Rank 0's stage of a target step (its K/V written into rank 0's cache), not sent yet."""
        d, st = self.dec, self.dec.stage
        T = tokens.shape[0]
        flags, local = (ALL if logits_for == "all" else 0) | STATS | (KV if self.kv else 0), None
        if isinstance(experts, partial):  # the decoder's next-layer fallback (K = 0 steps)
            flags |= GUESS
            local = st.guessing
        elif flags & ALL and T > 1:
            flags |= CYCLE
        if d.prompt:  # the generation's first step: each rank's planner begins it as the decoder's does
            flags, d.prompt = flags | PREFILL, False
        t0 = time.perf_counter()
        x = st.forward(tokens, start, local, logits_for)
        return Step(x, start, flags, time.perf_counter() - t0)

    def send(self, step: Step, post: bool = False) -> Sent:
        """The STEP down the chain (with the acceptance's demotions and withdrawals since the last
        header); `post`: the result's receive is posted now (Sent.posted), so the last rank's send of
        it never waits for rank 0, and rank 0 can ask whether it has arrived."""
        d = self.dec
        cancel, demote = d.experts.pending()
        d.wire.send_header(1, STEP, step.T, step.start, flags=step.flags | cancel, demote=demote, x=step.x)
        posted = None
        if post:
            posted = d.wire.post_result(d.group.world - 1, step.T if step.flags & ALL else 1, self.spec.vocab_size,
                                        True, kv=step.T * self.kv[-1][2] if self.kv else 0)
        return Sent(step.T, step.start, step.flags, posted)

    def logits(self, sent: Sent) -> torch.Tensor | None:
        """A posted result's logits if it has arrived (its K/V rows not put yet), else None."""
        if sent.posted is None or not sent.posted.ready():
            return None
        return sent.posted.take(self.dec.device)[0]

    def receive(self, sent: Sent) -> torch.Tensor:
        """The last stage's logits of the step `send` sent, and every later rank's K/V rows into rank 0's cache."""
        d, st = self.dec, self.dec.stage
        T, start, flags = sent.T, sent.start, sent.flags
        w = d.wire
        if sent.posted is not None:
            logits, remote, kv = sent.posted.take(d.device)
        else:
            logits, remote, kv = w.recv_result(d.group.world - 1, T if flags & ALL else 1, self.spec.vocab_size, True,
                                               d.device, kv=T * self.kv[-1][2] if self.kv else 0)
        d.experts.remote = remote
        for r, (first, end, n) in enumerate(self.kv[:-1], 1):  # the middle ranks' own sends
            put_kv_rows(st.cache, self.spec, first, end, start, T, w.recv_bytes(r, T * n))
        if self.kv:
            put_kv_rows(st.cache, self.spec, self.kv[-1][0], self.kv[-1][1], start, T, kv)
        return logits
