"""The lookahead buffer: what the draft's routers chose, one row per drafted token.

A static device tensor (graph safe: fixed address, written in place). The draft writes rows on the
device; the planner reads a range of rows back with one device-to-host copy per chunk, never one
per token.

The sync-free draft (compiled/draft_step.py) instead `publish`es each row as it is written: a
non-blocking copy into a host mirror (pinned on CUDA) and an event, so the host learns a row
when its event has fired and never waits on the draft (`ready` / `read_host`).
"""
from __future__ import annotations

import torch


class Lookahead:
    def __init__(self, k_max: int, n_layers: int, top_k: int, device):
        self.ids = torch.full((k_max, n_layers, top_k), -1, dtype=torch.int32, device=device)  # [K_max, L, k]
        self.weights = torch.zeros((k_max, n_layers, top_k), dtype=torch.float32, device=device)
        self.k_max, self.n_layers = k_max, n_layers
        cuda = self.ids.is_cuda
        self.host = torch.full_like(self.ids, -1, device="cpu", pin_memory=cuda)  # [K_max, L, k]
        self._events: list = [None] * k_max  # CUDA: one per published row
        self._published = 0

    def record(self, row: int, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        # ids, weights: [1, k] -- the router's choice for the token being drafted
        self.ids[row, layer].copy_(ids[0])
        self.weights[row, layer].copy_(weights[0])

    def read(self, start: int, end: int) -> list[list[list[int]]]:
        """Rows [start, end) on the host: [rows][layer][k]. One device-to-host transfer."""
        if end <= start:
            return []
        return self.ids[start:end].cpu().tolist()

    # ------------------------------------------------------------- sync-free publication
    def begin(self) -> None:
        self._published = 0

    def publish(self, row: int) -> None:
        """Start copying row `row` to the host mirror; never waits (CUDA: after the work queued so far)."""
        if self.ids.is_cuda:
            self.host[row].copy_(self.ids[row], non_blocking=True)
            ev = self._events[row] = self._events[row] or torch.cuda.Event()
            ev.record()
        else:
            self.host[row].copy_(self.ids[row])
        self._published = row + 1

    def ready(self) -> int:
        """How many published rows, from row 0, the host may read now (events queried, not waited on)."""
        n = 0
        while n < self._published and (self._events[n] is None or self._events[n].query()):
            n += 1
        return n

    def read_host(self, start: int, end: int) -> list[list[list[int]]]:
        """Published rows [start, end) from the host mirror (a host read, no device sync)."""
        if end <= start:
            return []
        return self.host.numpy()[start:end].tolist()
