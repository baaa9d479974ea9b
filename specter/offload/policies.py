"""Non-speculative prefetch policies layered on the offload manager."""
from __future__ import annotations

from collections import Counter

import torch

from .manager import OffloadedExperts


class NextLayerPrefetch:
    """`next-layer` (the mixtral-offloading idea): while layer l's experts compute, apply layer l+1's
    router to layer l's MoE input and start copying the experts it picks. The guess is cheap (one
    router matmul) and usually right, because the residual stream changes little between layers."""

    def __init__(self, model, mgr: OffloadedExperts):
        self.blocks = [layer.mlp for layer in model.model.layers if layer.is_moe]
        self.mgr = mgr

    def __call__(self, layer: int, x: torch.Tensor) -> None:
        if layer + 1 >= len(self.blocks):
            return
        ids, _ = self.blocks[layer + 1].route(x)             # [T, k]
        demand = Counter(ids.reshape(-1).tolist())
        want = [e for e, _ in demand.most_common()]          # most demanded first
        self.mgr.prefetch(layer + 1, want, protect=set(want))
