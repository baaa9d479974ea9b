"""The draft: the same model with only its routed experts in INT4 (group size 128, optimum-quanto's
quantizer, packed by `specter.triton_ops.pack_int4`). Everything else -- attention, norms, routers,
shared experts, embeddings, lm_head and the committed KV cache -- is the target's own, so the draft
costs only its packed experts.

How INT4 is multiplied is a backend choice: `unpacked` dequantises once into the compute dtype
(CPUs have no INT4 GEMV, and the values are exactly the INT4 grid; fp32 on CPU, twice the bf16
checkpoint's experts); `packed` keeps the packed codes (a quarter of bf16) and dequantizes at use:
on CUDA fused_moe's kernels do it tile by tile with scales in the compute dtype; on CPU the torch
backend dequantizes each expert it runs from fp32 scales and rounds once, which is exactly the
unpacked draft's values. Either way the draft computes with the quantised weights.
"""
from __future__ import annotations

import torch

from specter.triton_ops import Int4Experts, fused_moe, pack_int4

from ..moe import ExpertWeights
from .lookahead import Lookahead

# On CPU the draft is dequantised (one GEMV an expert) while that costs at most this much memory,
# and stays packed above it: dequantised at use, a quarter of the bf16 experts instead of twice
# them, for draft steps 2% slower on the bundled model and 32% slower at Qwen3-30B-A3B's shapes
# (measured alternately in one process; the target's verification dominates either way).
DENSE_MAX_BYTES = 256 << 20


def keep_packed(device, n_weights: int, dtype: torch.dtype) -> bool:
    """Whether a draft of `n_weights` routed-expert weights stays packed INT4 on `device`: always
    on CUDA (the kernels dequantize tile by tile); on CPU once dequantising would take more than
    DENSE_MAX_BYTES."""
    return torch.device(device).type == "cuda" or n_weights * dtype.itemsize > DENSE_MAX_BYTES


def _dequantized(q: Int4Experts, dtype) -> torch.Tensor:
    """q.dequantize().to(dtype), one expert at a time: no layer-sized fp32 temporaries beside it."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)  # [E, N, K]
    for e in range(q.n_experts):
        out[e] = q[e].dequantize()[0]
    return out


class DraftExperts:
    """Expert provider of the draft. While `row` is set it records each MoE layer's routing into
    the lookahead buffer; that record is the whole point of drafting with the real routers."""

    def __init__(self, experts: list, lookahead: Lookahead, device, dtype, packed: bool = False):
        """experts: per MoE layer, the host full-precision ExpertWeights (quantised here, layer by layer
        on the device), or its (w13, w2) Int4Experts with fp32 scales (the draft cache's)."""
        self.lookahead, self.row, self.packed = lookahead, None, packed
        self.q13: list[Int4Experts] = []
        self.q2: list[Int4Experts] = []
        self.layers: list[ExpertWeights] = []
        for ew in experts:
            if isinstance(ew, ExpertWeights):
                ew = (pack_int4(ew.w13.to(device), dtype=torch.float32), pack_int4(ew.w2.to(device), dtype=torch.float32))
            q13, q2 = (q.to(device) for q in ew)
            if packed:  # CUDA: scales in the compute dtype (rounded once from fp32), the kernels multiply in it
                sdt = dtype if torch.device(device).type == "cuda" else torch.float32
                self.q13.append(q13.to(device, sdt))
                self.q2.append(q2.to(device, sdt))
            else:       # dequantised in fp32, exactly quanto's values, then rounded once
                self.layers.append(ExpertWeights(_dequantized(q13, dtype), _dequantized(q2, dtype)))

    def __call__(self, layer: int, x, ids, weights):
        if self.row is not None:
            self.lookahead.record(self.row, layer, ids, weights)
        if self.packed:  # INT4 dequantized tile by tile inside the kernels' K loops
            return fused_moe(x, ids, weights, self.q13[layer], self.q2[layer])
        ew = self.layers[layer]
        return fused_moe(x, ids, weights, ew.w13, ew.w2)
