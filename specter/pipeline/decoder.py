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
    ABORT   rank 0 failed (its error says why): the other ranks leave with an error
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
    KV      (every target step of a drafting policy) each rank after the first returns its layers'
            K/V at the step's positions to rank 0, whose whole draft reads them as the single-process
            draft reads the target's: the last rank after its logits, the others in a send of their own
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
import time
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

from ..sampling import History, SamplingParams, sample
from .group import Group, PipelineError, comm
from .stage import StageModel
from .stages import Stage

BEGIN, STEP, END, STOP, ABORT, PING, ROWS = 1, 2, 3, 4, 5, 6, 7
ALL, GUESS, CYCLE, STATS, CANCEL, KV, PREFILL = 1, 4, 8, 16, 32, 64, 128
HEADER = 9
SIDE = ("stall_s", "expert_hits", "expert_misses", "offloaded_bytes", "step_s")  # a STATS step's counters
PER_RANK_ONLY = ("step_s", "wire_s")  # each rank's own: its stage's target steps, its blocked exchanges
NAMES = {BEGIN: "begin", STEP: "step", END: "end", STOP: "stop", ABORT: "abort", PING: "ping", ROWS: "rows"}
SUMMED = ("expert_hits", "expert_misses", "h2d_bytes", "stall_s", "prefetch_issued", "prefetch_used",
          "prefetch_cancelled", "host_experts", "host_bytes", "host_stall_s")


class Wire:
    """This rank's sends and receives, on the group's wire device, with errors that say what failed.

    A message is one send: the header, a STATS step's counters (float64 [5]) and, for a step of up
    to `rows` positions (1; a drafting policy's verification width, `inline_rows`), its hidden state
    [T, H] (for ROWS, its rows when they fit there), as bytes; a wider hidden state (or payload)
    follows as a second send. The result a last stage returns to
    rank 0 is one send too: the counters, the logits and (KV) its K/V rows. Each send is a hand-off
    the receiving process must wake up for, and on a loaded machine a wake-up can cost more than
    the send (docs/RESULTS.md), so a token's step crosses each boundary once. Sends made with
    `wait=False` (ROWS, a middle rank's K/V) return at once; they complete in order before this
    rank's next blocking send (`drain`)."""

    def __init__(self, group: Group, hidden: int, dtype: torch.dtype, rows: int = 1):
        self.group, self.hidden, self.dtype, self.rows = group, hidden, dtype, rows
        self.broken: str | None = None  # an exchange failed (its error): nothing more is sent
        self.slot = rows * hidden * dtype.itemsize  # a message's bytes after its header and counters:
        self.size = (HEADER + len(SIDE)) * 8 + self.slot  # up to `rows` positions' hidden state inline
        self.trips = 0  # rank 0: results received (round trips through every stage) since BEGIN
        self.inflight: list = []  # (work, buffer, what) of the sends not waited for
        self.wait_s = 0.0  # seconds blocked in this rank's exchanges since BEGIN (stats: wire_s)

    def drain(self) -> None:
        """Waits for the sends made with wait=False (each completes once its receiver took it)."""
        while self.inflight:
            work, _, what = self.inflight.pop(0)
            self._do(what, work.wait)

    def _send(self, buf: torch.Tensor, dst: int, what: str, wait: bool = True) -> None:
        if wait:
            self.drain()
            self._do(what, lambda: dist.send(buf, dst))
        else:
            self.inflight.append((self._do(what, lambda: dist.isend(buf, dst)), buf, what))

    def _do(self, what: str, fn):
        t = time.perf_counter()
        try:
            with comm(self.group, what):
                return fn()
        except PipelineError as e:
            self.broken = str(e)
            raise
        finally:
            self.wait_s += time.perf_counter() - t

    def send_header(self, dst: int, cmd: int, T: int = 0, start: int = 0, max_len: int = 0, flags: int = 0,
                    row: int = 0, k: int = 0, draft_us: int = 0, demote: int = 0, x: torch.Tensor | None = None,
                    side: torch.Tensor | None = None, payload: torch.Tensor | None = None, wait: bool = True) -> None:
        self.forward(dst, [cmd, T, start, max_len, flags, row, k, draft_us, demote], x, side, payload, wait)

    def forward(self, dst: int, header: list[int], x: torch.Tensor | None = None,
                side: torch.Tensor | None = None, payload: torch.Tensor | None = None, wait: bool = True) -> None:
        """Sends a message (`x`: a step's hidden state [T, H], `side`: its counters; `payload`: ROWS'
        bytes, header[1] of them)."""
        wire = self.group.wire
        parts = [torch.tensor(header, dtype=torch.int64, device=wire).view(torch.uint8),
                 (side.to(wire, torch.float64) if side is not None
                  else torch.zeros(len(SIDE), dtype=torch.float64, device=wire)).view(torch.uint8)]
        more = None  # what follows in a second send
        if x is not None:
            x = x.to(wire, self.dtype).reshape(-1).view(torch.uint8)
            more = x if header[1] > self.rows else None
        elif payload is not None:
            x = payload.to(wire).reshape(-1).view(torch.uint8)
            more = x if x.numel() > self.slot else None
        if x is None or more is not None:
            parts.append(torch.zeros(self.slot, dtype=torch.uint8, device=wire))
        else:
            parts.append(x)
            if x.numel() < self.slot:
                parts.append(torch.zeros(self.slot - x.numel(), dtype=torch.uint8, device=wire))
        name = NAMES[header[0]]
        self._send(torch.cat(parts), dst, f"sending '{name}' to rank {dst}", wait)
        if more is not None:
            self._send(more.contiguous(), dst, f"sending the {name}'s data to rank {dst}", wait)

    def send_bytes(self, dst: int, data: torch.Tensor, wait: bool = True) -> None:
        self._send(data.to(self.group.wire).contiguous(), dst, f"sending K/V rows to rank {dst}", wait)

    def recv_bytes(self, src: int, n: int) -> torch.Tensor:
        buf = torch.empty(n, dtype=torch.uint8, device=self.group.wire)
        self._do(f"receiving K/V rows from rank {src}", lambda: dist.recv(buf, src))
        return buf

    def receive(self, src: int, device) -> tuple[list[int], torch.Tensor, torch.Tensor | None]:
        """The next message: (header, counters float64 [5] on the CPU, a step's hidden state [T, H] on
        `device` or None)."""
        buf = torch.empty(self.size, dtype=torch.uint8, device=self.group.wire)
        self._do(f"waiting for rank {src}'s next message", lambda: dist.recv(buf, src))
        a, b = HEADER * 8, (HEADER + len(SIDE)) * 8
        header = buf[:a].view(torch.int64).tolist()
        side = buf[a:b].view(torch.float64).cpu().clone()
        x = None
        if header[0] == STEP:
            if header[1] <= self.rows:
                n = header[1] * self.hidden * self.dtype.itemsize
                x = buf[b:b + n].view(self.dtype).reshape(header[1], self.hidden).to(device).clone()
            else:
                x = torch.empty((header[1], self.hidden), dtype=self.dtype, device=self.group.wire)
                self._do(f"receiving the hidden state from rank {src}", lambda: dist.recv(x, src))
                x = x.to(device)
        elif header[0] == ROWS:  # bytes: on the wire's device, as received
            n = header[1]
            if n <= self.slot:
                x = buf[b:b + n].clone()
            else:
                x = torch.empty(n, dtype=torch.uint8, device=self.group.wire)
                self._do(f"receiving the rows from rank {src}", lambda: dist.recv(x, src))
        return header, side, x

    def send_result(self, logits: torch.Tensor, side: torch.Tensor | None, kv: torch.Tensor | None = None) -> None:
        """The last stage's fp32 logits [rows, V] (after a STATS step's counters; then a KV step's K/V
        rows, as bytes) to rank 0, in one send."""
        wire = self.group.wire
        parts = [logits.to(wire, torch.float32).reshape(-1).view(torch.uint8)]
        if side is not None:  # first: its float64 stays 8-byte aligned whatever the vocabulary's size
            parts.insert(0, side.to(wire, torch.float64).view(torch.uint8))
        if kv is not None:
            parts.append(kv.to(wire))
        self._send(torch.cat(parts), 0, "sending the logits to rank 0")

    def recv_result(self, src: int, rows: int, vocab: int, stats: bool, device,
                    kv: int = 0) -> tuple[torch.Tensor, list | None, torch.Tensor | None]:
        """(logits [rows, V] on `device`, the counters or None, `kv` bytes of K/V rows or None)."""
        a = len(SIDE) * 8 if stats else 0
        b = a + rows * vocab * 4
        buf = torch.empty(b + kv, dtype=torch.uint8, device=self.group.wire)
        self._do(f"receiving the logits from rank {src}", lambda: dist.recv(buf, src))
        self.trips += 1
        logits = buf[a:b].view(torch.float32).reshape(rows, vocab).to(device).clone()
        return logits, (buf[:a].view(torch.float64).tolist() if stats else None), (buf[b:] if kv else None)

    def gather_stats(self, mine: dict) -> list[dict] | None:
        out = [None] * self.group.world if self.group.rank == 0 else None
        self._do("gathering every rank's stats", lambda: dist.gather_object(mine, out, dst=0))
        return out


def inline_rows(k_max: int) -> int:
    """The positions a message carries inline: a verification of up to 16 (K <= 15) in one send."""
    return min(k_max, 15) + 1


def pipeline_info(group: Group, stages: list[Stage], wire: Wire) -> dict:
    """stats["pipeline"] less per_rank; round_trips: the steps that went through every stage and back
    (prefill, each draft step, each verification or plain step)."""
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
        try:
            gen = params.generator(self.device)
            hist = History(prompt, self.device) if params.penalized else None  # what penalties look at
            logits = self._forward(torch.tensor(prompt, device=self.device), 0)  # [1, V]
            pos = len(prompt)
            for _ in range(max_new):
                tok = sample(logits, params, gen, hist)  # [1]
                if hist is not None:
                    hist.commit([int(tok)])
                yield [int(tok)]
                logits = self._forward(tok.reshape(1), pos)
                pos += 1
        finally:
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
        out["pipeline"] = dict(pipeline_info(self.group, self.stages, self.wire), per_rank=self._per_rank)
        return out

    def reset_stats(self) -> None:
        self.stage.reset_stats()

    def close(self) -> None:
        """The Engine's close: nothing here; the launcher ends the pipeline (`finish`)."""

    def finish(self, abort: bool = False) -> None:
        """Ends every rank's loop (abort: with an error there). Idempotent; nothing is sent on a
        broken pipeline."""
        finish(self, abort)


def finish(dec, abort: bool) -> None:
    """Rank 0's decoder `dec` (wire, stage, lock, _closed) ends every rank's loop, then closes its stage;
    it waits (at most the group's timeout) for a generation still running on another thread."""
    if dec._closed:
        return
    dec._closed = True
    held = dec.lock.acquire(timeout=dec.group.timeout_s)
    try:
        if not dec.wire.broken:
            dec.wire.send_header(1, ABORT if abort else STOP)
    finally:
        if held:
            dec.lock.release()
        dec.stage.close()


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
        if out.get("h2d_path") is None and s.get("h2d_path") is not None:
            out["h2d_path"] = s["h2d_path"]
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
                                          mgr.offloaded_bytes if mgr is not None else 0, stage.step_s],
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
                raise PipelineError(f"rank {r} of {group.world}: rank 0 stopped the pipeline after an error "
                                    "(rank 0's message says what)")
            else:
                raise PipelineError(f"rank {r} of {group.world}: unknown message {cmd} from rank {prev}")
    finally:
        stage.close()
