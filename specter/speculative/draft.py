"""The draft: the same model with only its routed experts in INT4 (group size 128, optimum-quanto's
quantizer). Everything else -- attention, norms, routers, shared experts, embeddings, lm_head and
the committed KV cache -- is the target's own, so the draft costs only its packed experts.

How INT4 is multiplied is a backend choice: `unpacked` dequantises once into the compute dtype
(CPUs have no INT4 GEMV, and the values are exactly the INT4 grid); `packed` keeps only quanto's
packed tensors and lets its kernels multiply (CUDA). Either way the draft computes with the
quantised weights.
"""
from __future__ import annotations

import torch

from ..moe import ExpertWeights, run_experts
from .lookahead import Lookahead


def group_size_for(in_features: int, preferred: int = 128) -> int:
    """128 where it divides the row; else the largest power of two that does (tiny test models)."""
    g = preferred
    while g > 1 and in_features % g:
        g //= 2
    return g


def quantize_int4(w: torch.Tensor, group_size: int = 128):
    """w [out, in] -> optimum-quanto WeightQBitsTensor (qint4, per-group scale and shift)."""
    from optimum.quanto import MaxOptimizer, qint4, quantize_weight

    g = group_size_for(w.shape[1], group_size)
    wf = w.float()
    scale, shift = MaxOptimizer()(wf, qtype=qint4, axis=0, group_size=g)
    return quantize_weight(wf, qtype=qint4, axis=0, scale=scale, shift=shift, group_size=g, optimized=False)


class DraftExperts:
    """Expert provider of the draft. While `row` is set it records each MoE layer's routing into
    the lookahead buffer; that record is the whole point of drafting with the real routers."""

    def __init__(self, experts: list[ExpertWeights], lookahead: Lookahead, device, dtype, packed: bool = False):
        self.lookahead, self.row, self.packed = lookahead, None, packed
        self.q13, self.q2, self.layers = [], [], []
        for ew in experts:  # experts: host full-precision weights, quantised once here
            q13 = [quantize_int4(ew.w13[e]) for e in range(ew.n_experts)]
            q2 = [quantize_int4(ew.w2[e]) for e in range(ew.n_experts)]
            if packed:
                self.q13.append([q.to(device) for q in q13])
                self.q2.append([q.to(device) for q in q2])
            else:
                self.layers.append(ExpertWeights(
                    torch.stack([q.dequantize() for q in q13]).to(device=device, dtype=dtype),
                    torch.stack([q.dequantize() for q in q2]).to(device=device, dtype=dtype)))

    def __call__(self, layer: int, x, ids, weights):
        if self.row is not None:
            self.lookahead.record(self.row, layer, ids, weights)
        if self.packed:
            return run_experts(x, ids, weights, lambda e: (self.q13[layer][e], self.q2[layer][e]))
        ew = self.layers[layer]
        return run_experts(x, ids, weights, lambda e: (ew.w13[e], ew.w2[e]))
