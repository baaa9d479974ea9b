"""Routers, the expert computation and the MoE block.

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
import torch.nn.functional as F
from torch import nn

from specter.triton_ops import fused_moe

from .config import ModelSpec
from .layers import MLP


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

    def __init__(self, layers: list[ExpertWeights]):
        self.layers = layers

    def __call__(self, layer, x, ids, weights):
        ew = self.layers[layer]
        return fused_moe(x, ids, weights, ew.w13, ew.w2)


# -------------------------------------------------------------------------------------- routers
def route_softmax(logits: torch.Tensor, k: int, normalize: bool):
    """Mixtral, Qwen2/3-MoE, OLMoE: softmax over all experts, top-k, optional renormalisation."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w.to(logits.dtype)


def route_sparsemixer(logits: torch.Tensor, eps: float):
    """PhiMoE's sparsemixer at inference: the top expert, weighted by a softmax over the experts
    within a relative `2*eps` of it; then the same for the runner-up with the top expert masked."""
    def pick(masked: torch.Tensor):
        top, idx = masked.max(dim=-1, keepdim=True)
        far = (top - logits) / logits.abs().clamp(min=top) > 2 * eps
        w = torch.softmax(masked.masked_fill(far, float("-inf")), dim=-1).gather(-1, idx)
        return idx, w

    id1, w1 = pick(logits)
    id2, w2 = pick(logits.scatter(-1, id1, float("-inf")))
    return torch.cat((id1, id2), dim=-1), torch.cat((w1, w2), dim=-1)


def route_deepseek(logits: torch.Tensor, spec: ModelSpec):
    """DeepSeek-V2: softmax scores in fp32, greedy or group-limited top-k, then either
    renormalise (norm_topk_prob) or scale by routed_scaling_factor, as the original release does."""
    scores = torch.softmax(logits.float(), dim=-1)
    if spec.topk_method == "group_limited_greedy":
        T, E = scores.shape
        group_best = scores.view(T, spec.n_group, E // spec.n_group).max(dim=-1).values  # [T, G]
        keep = torch.topk(group_best, spec.topk_group, dim=-1, sorted=False).indices
        mask = torch.zeros_like(group_best, dtype=torch.bool).scatter_(1, keep, True)
        scores = scores.masked_fill(~mask.repeat_interleave(E // spec.n_group, dim=1), 0.0)
    w, ids = torch.topk(scores, spec.top_k, dim=-1, sorted=False)
    if spec.top_k > 1 and spec.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        w = w * spec.routed_scale
    return ids, w


class MoEBlock(nn.Module):
    """Router + routed experts (through a provider) + optional shared expert (Qwen2-MoE gates it
    with a sigmoid; DeepSeek-V2 adds it plainly). The shared expert runs first, so on an offloading
    provider it overlaps with expert copies still in flight."""

    def __init__(self, spec: ModelSpec, moe_index: int):
        super().__init__()
        self.spec, self.moe_index = spec, moe_index
        self.gate = nn.Linear(spec.hidden, spec.n_experts, bias=False)  # the router
        self.shared = MLP(spec.hidden, spec.shared_inter) if spec.shared_inter else None
        self.shared_gate = nn.Linear(spec.hidden, 1, bias=False) if spec.shared_gate else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] -> ids [T, k] (int64), weights [T, k]
        s = self.spec
        if s.router == "deepseek":
            return route_deepseek(F.linear(x.float(), self.gate.weight.float()), s)
        logits = self.gate(x)  # [T, E]
        if s.router == "sparsemixer":
            return route_sparsemixer(logits, s.router_jitter)
        return route_softmax(logits, s.top_k, s.norm_topk_prob)

    def prepare(self, x: torch.Tensor):
        """Everything before the routed experts: x [T, H] -> shared expert output [T, H] (or None),
        ids [T, k], weights [T, k]. The piecewise verifier captures this part (compiled/verify_step.py)."""
        shared = None
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
        ids, w = self.route(x)
        return shared, ids, w

    def forward(self, x: torch.Tensor, experts: ExpertProvider) -> torch.Tensor:
        shared, ids, w = self.prepare(x)
        return self.combine(experts(self.moe_index, x, ids, w), shared)

    @staticmethod
    def combine(y: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
        """The routed experts' output plus the shared expert's, if any."""
        return y if shared is None else y + shared
