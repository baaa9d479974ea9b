"""The torch backend of fused_moe: the CPU default, and the reference the kernels are tested against.

Rows are grouped by expert on the host (one read of the routing: free on a CPU; on CUDA this
backend is only a reference and pays one sync): one gather puts every (token, position) row in
expert order, each expert runs once over its contiguous run of rows, one scatter puts them back.

Why a row's bits do not depend on T or on its neighbours (measured with MKL on AVX-512 at 1-4
threads, for the bundled and test models' shapes and Qwen3-30B's; the batch-invariance tests in
tests/test_triton_ops.py check it wherever the suite runs):
  * fp32 matmuls: MKL picks its kernel by the row count M, and its kernels add the K products in
    different orders: M=1 (a dot-product GEMV), M=2-3, and M>=4 (packed GEMM; with several
    threads a thread's share of 2-3 rows falls back to the small kernel) give the same row three
    different bit patterns. Every fp32 row therefore goes through the GEMV: a run of one row as a
    plain linear, a longer run as a bmm of one-row entries against the expert, broadcast without
    a copy (each entry is a GEMV, so it has the bits of the row alone). Padding every run to a
    fixed block of 4 or 8 rows (the packed GEMM's bits) is invariant too, but one padded block
    costs 2.6-3.7x a GEMV on the bundled model's experts, and T=1 is the decode step; the GEMV
    costs 1.4-1.8x a GEMM at 4-8 rows instead, only where an expert has that many rows.
  * 16-bit matmuls (oneDNN) give every row the same bits whatever M: plain linears.
  * SiLU: in fp32, ATen's vectorized exp and the scalar one it uses for a loop's tail differ in the
    last bit. The activation reads [n, I] views with a row stride of 2I, which TensorIterator cannot
    coalesce, so every row is its own inner loop with the same vector/tail split; and it runs in
    chunks small enough that ATen never splits them between threads (a split can cut a row).
  * Routing weights multiply, rows scatter and top-k positions add: exact IEEE operations.
"""
from __future__ import annotations

import itertools
import math
import threading

import torch
import torch.nn.functional as F

from .int4 import Int4Experts

_SERIAL = 32768  # at::internal::GRAIN_SIZE: ATen runs elementwise ops on fewer elements on one thread


_scratch = threading.local()


def _buffer(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This thread's reusable CPU buffer for one converted expert weight: fresh memory for each one
    costs page faults (an upcast of a Mixtral w13 took 270 ms that way, 45 ms into a reused buffer,
    against 22 ms for its fp32 GEMV). Grown to the largest weight converted, never shrunk."""
    bufs = _scratch.__dict__.setdefault("bufs", {})
    n = math.prod(shape)
    key = (dtype, torch.is_inference_mode_enabled())  # an inference tensor cannot be written outside that mode
    buf = bufs.get(key)
    if buf is None or buf.numel() < n:
        buf = bufs[key] = torch.empty(n, dtype=dtype, device=device)
    return buf[:n].view(shape)


def _dense(w, r: int, dtype: torch.dtype) -> torch.Tensor:
    """Weight row r as [N, K] in `dtype` (INT4 dequantized as quanto does). A converted weight lives in
    a reused buffer on CPU, valid until the next call."""
    q = w[r]  # Int4Experts [1, N, K // 2] (it keeps the expert axis), a tensor [N, K]
    cpu = q.device.type == "cpu"
    if isinstance(w, Int4Experts):
        if cpu and q.dtype == dtype:
            return q.dequantize(out=_buffer(q.shape, dtype, q.device))[0]
        return q.dequantize()[0].to(dtype)
    if w.dtype == dtype:
        return q
    return _buffer(q.shape, dtype, q.device).copy_(q) if cpu else q.to(dtype)


def _transposed(w, dtype: torch.dtype):
    """r -> weight row r as [K, N] in `dtype`: a view of dense weights, INT4 dequantized on demand."""
    if isinstance(w, Int4Experts) or w.dtype != dtype:
        return lambda r: _dense(w, r, dtype).t()
    return w.transpose(1, 2).__getitem__


def grouped_linear(a: torch.Tensor, w, runs: list[tuple[int, int, int]]) -> torch.Tensor:
    """a [n, K], rows grouped in runs (weight row r, first, end) -> [n, N]: a[first:end] @ w[r].T per
    run, every row computed as if alone (see the module docstring)."""
    if a.dtype != torch.float32:  # 16-bit: plain linears, whose rows do not depend on M
        parts = [F.linear(a[s:e], _dense(w, r, a.dtype)) for r, s, e in runs]
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    # fp32: one row, a GEMV; several, a bmm of one-row entries (each a GEMV) against the expert
    a3 = a.unsqueeze(1)  # [n, 1, K]
    wt = _transposed(w, a.dtype)
    parts = [torch.matmul(a3[s:e], wt(r)) if e - s == 1 else torch.bmm(a3[s:e], wt(r).expand(e - s, -1, -1))
             for r, s, e in runs]
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).view(a.shape[0], -1)


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """[n, 2I] gate|up -> [n, I] silu(gate) * up, every row computed alike (see the module docstring)."""
    n, two_i = h.shape
    i = two_i // 2
    step = max(1, (_SERIAL - 1) // i)  # rows per chunk: under the grain, so one thread each
    if n <= step:
        return F.silu(h[:, :i]) * h[:, i:]
    return torch.cat([F.silu(c[:, :i]) * c[:, i:] for c in h.split(step)])


def expert_mlp(x: torch.Tensor, w13, w2, r: int) -> torch.Tensor:
    """x [1, H] through expert row r, unweighted: two GEMVs."""
    return F.linear(silu_mul(F.linear(x, _dense(w13, r, x.dtype))), _dense(w2, r, x.dtype))


def _weighted(ys: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """ys [n, H] * w [n, 1] in fp32, rounded once for 16-bit rows."""
    return ys.mul_(w) if ys.dtype == torch.float32 else (ys.float() * w.float()).to(ys.dtype)


def moe_rows_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13, w2,
                   remap: torch.Tensor | None) -> torch.Tensor:
    """[T, k, H]: row (t, j) = weights[t, j] * expert(x[t]), zero where remap sends the expert to -1."""
    T, k = ids.shape
    H = x.shape[1]
    flat = ids.reshape(-1)
    wrow = (remap[flat] if remap is not None else flat).tolist()  # weight row of each (t, j); host read
    if T == 1:  # a decode step: the top-k experts are distinct, each row its own run, already in order
        if min(wrow) >= 0:
            ys = torch.cat([expert_mlp(x, w13, w2, r) for r in wrow])  # [k, H]
            return _weighted(ys, weights.view(k, 1)).view(1, k, H)
        zero = x.new_zeros(1, H)
        return torch.cat([_weighted(expert_mlp(x, w13, w2, r), weights[:, j:j + 1]) if r >= 0 else zero
                          for j, r in enumerate(wrow)]).view(1, k, H)
    order = sorted((r, i) for i, r in enumerate(wrow) if r >= 0)  # by weight row, token order within
    n = len(order)
    if n == 0:
        return x.new_zeros(T, k, H)
    runs, start = [], 0  # (weight row, first, end): each expert's run of rows
    for r, run in itertools.groupby(order, key=lambda o: o[0]):
        runs.append((r, start, start := start + sum(1 for _ in run)))
    slot = torch.tensor([[i for _, i in order], [i // k for _, i in order]], device=x.device)  # [2, n]
    xs, w = x.index_select(0, slot[1]), weights.reshape(-1).index_select(0, slot[0])[:, None]
    ys = _weighted(grouped_linear(silu_mul(grouped_linear(xs, w13, runs)), w2, runs), w)  # [n, H]
    out = x.new_empty(T * k, H) if n == T * k else x.new_zeros(T * k, H)
    return out.index_copy_(0, slot[0], ys).view(T, k, H)


def combine_torch(rows: torch.Tensor) -> torch.Tensor:
    """[T, k, H] -> [T, H]: positions added left to right in fp32, rounded once."""
    if rows.shape[1] == 1:
        return rows[:, 0].clone()
    fp32 = rows.dtype == torch.float32
    acc = rows[:, 0] + rows[:, 1] if fp32 else rows[:, 0].float() + rows[:, 1].float()
    for j in range(2, rows.shape[1]):
        acc += rows[:, j] if fp32 else rows[:, j].float()
    return acc if fp32 else acc.to(rows.dtype)
