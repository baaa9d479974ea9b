"""The torch backend of fused_moe: the same grouped computation as the Triton kernels, in plain
torch ops (the CPU default, and the reference the kernels are tested against).

Per block of BLOCK_M rows (align.py) it gathers the block's expert and runs two batched matmuls
of exactly BLOCK_M rows, so a token's bits never depend on T (CPU GEMMs pick their reduction
order by the row count: a 1-row and a 4-row fp32 matmul of the same row differ).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .align import BLOCK_M, align_rows
from .int4 import Int4Experts


def _gather(w, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The experts of `blocks` as dense [NB, N, K] in `dtype` (INT4 dequantized as quanto does)."""
    if isinstance(w, Int4Experts):
        return Int4Experts(w.qweight[blocks], w.scale[blocks], w.shift[blocks]).dequantize().to(dtype)
    return w[blocks].to(dtype)


def moe_rows_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13, w2,
                   remap: torch.Tensor | None) -> torch.Tensor:
    """[T, k, H]: row (t, j) = weights[t, j] * expert(x[t]), zero where remap sends the expert to -1."""
    T, k = ids.shape
    H, M = x.shape[1], T * k
    a = align_rows(ids, w13.shape[0] if not isinstance(w13, Int4Experts) else w13.n_experts, remap)
    blocks = a.block_expert
    if x.device.type == "cpu":  # host reads are free here: skip the blocks past the end
        blocks = blocks[: int(a.n_padded) // BLOCK_M]
    nb = blocks.numel()
    slot_row = a.slot_row[: nb * BLOCK_M].long()
    real = slot_row < M
    xs = torch.cat((x, x.new_zeros(1, H)))[torch.where(real, slot_row // k, T)]           # [NB*BM, H]
    w = blocks.clamp(min=0).long()
    h = torch.bmm(xs.view(nb, BLOCK_M, H), _gather(w13, w, x.dtype).transpose(1, 2))      # [NB, BM, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = torch.bmm(F.silu(gate) * up, _gather(w2, w, x.dtype).transpose(1, 2))             # [NB, BM, H]
    rw = torch.cat((weights.reshape(-1).float(), weights.new_zeros(1, dtype=torch.float32)))[slot_row]
    y = (y.view(nb * BLOCK_M, H).float() * rw[:, None]).to(x.dtype)
    y = torch.cat((y, x.new_zeros(1, H)))
    return y[a.row_slot.clamp(max=nb * BLOCK_M)].view(T, k, H)


def combine_torch(rows: torch.Tensor) -> torch.Tensor:
    """[T, k, H] -> [T, H]: positions added left to right in fp32, rounded once."""
    acc = rows[:, 0].to(torch.float32, copy=True)
    for j in range(1, rows.shape[1]):
        acc = acc + rows[:, j].float()
    return acc.to(rows.dtype)
