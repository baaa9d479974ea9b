"""The messages between the stages and the wire that carries them (decoder.py describes the protocol).

Every send and receive goes through `Wire`, on the group's wire device, with errors that name the
rank, the peer and what failed (group.comm)."""
from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from .group import Group, PipelineError, comm, recv_object, send_object

BEGIN, STEP, END, STOP, ABORT, PING, ROWS = 1, 2, 3, 4, 5, 6, 7
ALL, GUESS, CYCLE, STATS, CANCEL, KV, PREFILL = 1, 4, 8, 16, 32, 64, 128
HEADER = 9
SIDE = ("stall_s", "expert_hits", "expert_misses", "offloaded_bytes", "step_s")  # a STATS step's counters
PER_RANK_ONLY = ("step_s", "wire_s")  # each rank's own: its stage's target steps, its blocked exchanges
NAMES = {BEGIN: "begin", STEP: "step", END: "end", STOP: "stop", ABORT: "abort", PING: "ping", ROWS: "rows"}
SUMMED = ("expert_hits", "expert_misses", "h2d_bytes", "stall_s", "prefetch_issued", "prefetch_used",
          "prefetch_cancelled", "host_experts", "host_bytes", "host_stall_s", "host_busy_s", "offloaded_bytes",
          "tier_hits", "tier_fills", "tier_evictions", "tier_decoded_bytes", "prefill_stall_s")


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

    def post_result(self, src: int, rows: int, vocab: int, stats: bool, kv: int = 0) -> "Posted":
        """The receive of recv_result's message, posted now (`Posted`: ask ready(), then take())."""
        a = len(SIDE) * 8 if stats else 0
        return Posted(self, src, a, a + rows * vocab * 4, kv, rows, vocab)

    def gather_stats(self, mine: dict) -> list[dict] | None:
        """Every rank's `mine` on rank 0 (None on the others), point to point (group.all_gather_objects
        says why not gloo's gather_object)."""
        g = self.group
        if g.rank != 0:
            self._do("gathering every rank's stats", lambda: send_object(mine, 0, g.wire))
            return None
        return [mine] + [self._do(f"gathering every rank's stats (rank {r}'s)", lambda r=r: recv_object(r, g.wire))
                         for r in range(1, g.world)]


def inline_rows(k_max: int) -> int:
    """The positions a message carries inline: a verification of up to 16 (K <= 15) in one send."""
    return min(k_max, 15) + 1


class Posted:
    """A last stage's result whose receive is posted (irecv) as soon as its step is sent, so the
    last rank's send completes at once (a gloo send otherwise waits for the receiver to post its
    receive) while rank 0 does other work (speculative.py drafts the next cycle); `ready()` says
    whether it has arrived: a thread of its own waits for it (gloo's Work.is_completed() does not
    report a receive done before it is waited for). `take` waits, at most the group's timeout."""

    def __init__(self, wire: Wire, src: int, a: int, b: int, kv: int, rows: int, vocab: int):
        self.wire, self.a, self.b, self.kv, self.rows, self.vocab = wire, a, b, kv, rows, vocab
        self.what = f"receiving the logits from rank {src}"
        self.buf = torch.empty(b + kv, dtype=torch.uint8, device=wire.group.wire)
        self.work = wire._do(self.what, lambda: dist.irecv(self.buf, src))
        self.done, self.error = threading.Event(), None
        self.result = None
        threading.Thread(target=self._wait, name="specter-pipeline-result", daemon=True).start()

    def _wait(self) -> None:
        try:
            self.work.wait()
        except BaseException as e:  # noqa: BLE001 -- raised on the caller's thread by take()
            self.error = e
        finally:
            self.done.set()

    def ready(self) -> bool:
        return self.done.is_set()

    def take(self, device) -> tuple[torch.Tensor, list | None, torch.Tensor | None]:
        """(logits [rows, V] on `device`, the counters or None, the K/V bytes or None), once received."""
        if self.result is None:
            def wait():
                self.done.wait()
                if self.error is not None:
                    raise self.error
            self.wire._do(self.what, wait)
            self.wire.trips += 1
            buf, a, b = self.buf, self.a, self.b
            logits = buf[a:b].view(torch.float32).reshape(self.rows, self.vocab).to(device).clone()
            self.result = (logits, (buf[:a].view(torch.float64).tolist() if a else None), (buf[b:] if self.kv else None))
        return self.result
