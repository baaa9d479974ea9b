"""The torch backend of fused_moe: the CPU default, and the reference the kernels are tested against.

Experts are grouped on the host (one read of the routing: free on a CPU; on CUDA this backend is
only a reference and pays one sync), and each expert runs once over all its rows. CPU GEMMs pick
their reduction order by the row count (a 1-row and a 4-row fp32 matmul of the same row differ in
the last bits), so fp32 rows are multiplied one row per batch entry of a bmm against the expert's
weights, broadcast without a copy: a row's bits never depend on T or on the other rows. 16-bit
CPU matmuls already give every row the same bits whatever the row count (tested), and run as
plain linears.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .int4 import Int4Experts


def _dense(w, r: int, dtype: torch.dtype) -> torch.Tensor:
    """Weight row r as [N, K] in `dtype` (INT4 dequantized as quanto does)."""
    if isinstance(w, Int4Experts):
        return w[r].dequantize()[0].to(dtype)
    return w[r] if w.dtype == dtype else w[r].to(dtype)


def rowwise_linear(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a [n, K] @ w [N, K].T -> [n, N], each row computed as if alone (one row: a plain linear,
    which gives the same bits as a bmm entry)."""
    n, K = a.shape
    if a.dtype != torch.float32 or n == 1:
        return F.linear(a, w)
    return torch.bmm(a.view(n, 1, K), w.t().expand(n, K, w.shape[0])).view(n, -1)


def moe_rows_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13, w2,
                   remap: torch.Tensor | None) -> torch.Tensor:
    """[T, k, H]: row (t, j) = weights[t, j] * expert(x[t]), zero where remap sends the expert to -1."""
    T, k = ids.shape
    H = x.shape[1]
    flat = ids.reshape(-1)
    wrow = (remap[flat] if remap is not None else flat).tolist()  # weight row of each (t, j)
    groups: dict[int, list[int]] = {}
    for row, r in enumerate(wrow):
        if r >= 0:
            groups.setdefault(r, []).append(row)
    out = x.new_zeros(T * k, H)
    wl = weights.reshape(-1).tolist()  # exact in fp32, which is what the products below run in
    fp32 = x.dtype == torch.float32
    for r, rows in sorted(groups.items()):
        if len(rows) == 1:  # a decode step's every expert: plain slices, no index tensors
            row = rows[0]
            idx, xs, w = slice(row, row + 1), x[row // k:row // k + 1], wl[row]
        else:
            idx = torch.tensor(rows, device=x.device)
            xs = x[torch.tensor([row // k for row in rows], device=x.device)]
            w = torch.tensor([wl[row] for row in rows], device=x.device)[:, None]
        gate, up = rowwise_linear(xs, _dense(w13, r, x.dtype)).chunk(2, dim=-1)
        y = rowwise_linear(F.silu(gate) * up, _dense(w2, r, x.dtype))   # [n, H]
        out[idx] = y * w if fp32 else (y.float() * w).to(x.dtype)
    return out.view(T, k, H)


def combine_torch(rows: torch.Tensor) -> torch.Tensor:
    """[T, k, H] -> [T, H]: positions added left to right in fp32, rounded once."""
    if rows.shape[1] == 1:
        return rows[:, 0].clone()
    fp32 = rows.dtype == torch.float32
    acc = rows[:, 0] + rows[:, 1] if fp32 else rows[:, 0].float() + rows[:, 1].float()
    for j in range(2, rows.shape[1]):
        acc += rows[:, j] if fp32 else rows[:, j].float()
    return acc if fp32 else acc.to(rows.dtype)
