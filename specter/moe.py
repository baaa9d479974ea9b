"""Routed experts: their weights and the expert-provider seam (routers and the MoE block live in
model.py).

Every architecture's routed experts live in one representation, `ExpertWeights` (per MoE layer:
w13 = gate and up rows stacked, w2 = down), and are reached through an *expert provider*: a
callable `provider(moe_layer, x, ids, weights) -> y`. The model never knows where an expert's
bytes are; resident weights, an offloaded slot pool or an INT4 draft are just other providers.

Providers compute through `specter.triton_ops.fused_moe`: one grouped call per layer (Triton on
CUDA, its torch reference on CPU), combined by top-k position, never by the order experts ran or
arrived, so a provider that computes experts in several calls gives identical bits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from specter.triton_ops import fused_moe



@dataclass
class ExpertWeights:
    """One MoE layer's routed experts."""

    w13: torch.Tensor  # [E, 2*I, H]: gate rows [0, I), up rows [I, 2I)
    w2: torch.Tensor   # [E, H, I]

    @property
    def n_experts(self) -> int:
        return self.w13.shape[0]

    def expert_nbytes(self) -> int:
        return (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size()


class ExpertProvider(Protocol):
    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor: ...


class ResidentExperts:
    """Every expert on the device: the `resident` policy and the upper bound of all others."""

    def __init__(self, layers: list[ExpertWeights], fused=fused_moe):
        self.layers = layers
        self.fused_moe = fused  # or GraphedRows.fused_moe (triton_ops/graphed.py): the same output

    def __call__(self, layer, x, ids, weights):
        ew = self.layers[layer]
        return self.fused_moe(x, ids, weights, ew.w13, ew.w2)
