"""The lookahead buffer: what the draft's routers chose, one row per drafted token.

A static device tensor (graph safe: fixed address, written in place). The draft writes rows on the
device; the planner reads a range of rows back with one device-to-host copy per chunk, never one
per token.
"""
from __future__ import annotations

import torch


class Lookahead:
    def __init__(self, k_max: int, n_layers: int, top_k: int, device):
        self.ids = torch.full((k_max, n_layers, top_k), -1, dtype=torch.int32, device=device)  # [K_max, L, k]
        self.weights = torch.zeros((k_max, n_layers, top_k), dtype=torch.float32, device=device)
        self.k_max, self.n_layers = k_max, n_layers

    def record(self, row: int, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        # ids, weights: [1, k] -- the router's choice for the token being drafted
        self.ids[row, layer].copy_(ids[0])
        self.weights[row, layer].copy_(weights[0])

    def read(self, start: int, end: int) -> list[list[list[int]]]:
        """Rows [start, end) on the host: [rows][layer][k]. One device-to-host transfer."""
        if end <= start:
            return []
        return self.ids[start:end].cpu().tolist()
