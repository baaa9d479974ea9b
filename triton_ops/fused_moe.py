"""fused_moe: a layer's routed experts in one grouped computation, and its torch backend.

    y[t] = sum_j weights[t, j] * W2[r] (silu(W1[r] x[t]) * W3[r] x[t]),   r = remap[ids[t, j]]

    x [T, H], ids [T, k], weights [T, k]; w13 [R, 2I, H] (gate rows, then up rows), w2 [R, H, I],
    each dense or Int4Experts; remap [E] int32 expert -> row of w13/w2, -1 = not resident.

Two steps, both torch.library custom ops (with fake implementations, so torch.compile traces
through them with fullgraph=True; eager calls skip the dispatcher):

    rows = expert_rows(...)   [T, k, H]  row (t, j) weighted; rows whose expert maps to -1 are zero
    y = combine_rows(rows)    [T, H]     top-k positions added left to right in fp32

Rows are combined by (token, top-k position), never by the order experts ran, so a caller may
compute the resident experts in one call and the late ones in a second (`merge_rows`) and get the
very bits one call would give. Every matmul is over blocks of exactly BLOCK_M rows of one expert
(align.py), so a token's output does not depend on T or on the other tokens in the batch.

Backends: "triton" (kernels.py; CUDA, or CPU tensors under TRITON_INTERPRET=1) and "torch" (below;
the CPU default, and the reference the kernels are tested against). Routing is read on the device
only by the triton backend.

The torch backend groups rows by expert on the host (one read of the routing: free on a CPU; on
CUDA this backend is only a reference and pays one sync): one gather puts every (token, position)
row in expert order, each expert runs once over its contiguous run of rows, one scatter puts them
back. Why a row's bits do not depend on T or on its neighbours (the batch-invariance tests in
tests/test_triton_ops.py check it wherever the suite runs; what was measured is in docs/RESULTS.md):
  * fp32 matmuls: MKL picks its kernel by the row count M, and its kernels add the K products in
    different orders: M=1 (a dot-product GEMV), M=2-3, and M>=4 (packed GEMM; with several
    threads a thread's share of 2-3 rows falls back to the small kernel) give the same row three
    different bit patterns. Every fp32 row therefore goes through the GEMV: a run of one row as a
    plain linear, a longer run as a bmm of one-row entries against the expert, broadcast without
    a copy (each entry is a GEMV, so it has the bits of the row alone). Padding every run to a
    fixed block (the packed GEMM's bits) is invariant too, but costs several GEMVs at T = 1, the
    decode step.
  * 16-bit matmuls (oneDNN) give every row the same bits whatever M: plain linears.
  * SiLU: in fp32, ATen's vectorized exp and the scalar one it uses for a loop's tail differ in the
    last bit. The activation reads [n, I] views with a row stride of 2I, which TensorIterator cannot
    coalesce, so every row is its own inner loop with the same vector/tail split; and it runs in
    chunks small enough that ATen never splits them between threads (a split can cut a row).
  * Routing weights multiply, rows scatter and top-k positions add: exact IEEE operations.
"""
from __future__ import annotations

import math
import os
import threading
from typing import Optional

import torch
import torch.nn.functional as F

from specter.errors import ConfigError

from .int4 import Int4Experts

BACKENDS = ("torch", "triton")
_SERIAL = 32768  # at::internal::GRAIN_SIZE: ATen runs elementwise ops on fewer elements on one thread


def default_backend(x: torch.Tensor) -> str:
    return "triton" if x.is_cuda else "torch"


def _check_backend(backend: str, x: torch.Tensor) -> None:
    if backend not in BACKENDS:
        raise ConfigError(f"unknown fused_moe backend {backend!r}; expected one of {BACKENDS}")
    if backend == "triton" and not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("the triton backend needs CUDA tensors, or TRITON_INTERPRET=1 set before triton "
                          "is imported for CPU tensors; use backend='torch' on CPU")


# --------------------------------------------------------------------------------- custom ops
def _expert_rows_impl(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor, s13: Optional[torch.Tensor], z13: Optional[torch.Tensor],
                      s2: Optional[torch.Tensor], z2: Optional[torch.Tensor], remap: Optional[torch.Tensor],
                      backend: str) -> torch.Tensor:
    if s13 is not None:  # quantized: w13/w2 are the packed codes, their width fixed by K (H and I)
        w13, w2 = Int4Experts.for_k(w13, s13, z13, x.shape[1]), Int4Experts.for_k(w2, s2, z2, s13.shape[2] // 2)
    if backend == "triton":
        from .kernels import moe_rows_triton
        return moe_rows_triton(x, ids, weights, w13, w2, remap)
    return moe_rows_torch(x, ids, weights, w13, w2, remap)


_expert_rows_op = torch.library.custom_op("specter::expert_rows", _expert_rows_impl, mutates_args=())


@_expert_rows_op.register_fake
def _(x, ids, weights, w13, w2, s13, z13, s2, z2, remap, backend):
    return x.new_empty(ids.shape[0], ids.shape[1], x.shape[1])


def _combine_rows_impl(rows: torch.Tensor, backend: str) -> torch.Tensor:
    if backend == "triton":
        from .kernels import combine_triton
        return combine_triton(rows)
    return combine_rows(rows, backend="torch")


_combine_rows_op = torch.library.custom_op("specter::combine_rows", _combine_rows_impl, mutates_args=())


@_combine_rows_op.register_fake
def _(rows, backend):
    return rows.new_empty(rows.shape[0], rows.shape[2])


# --------------------------------------------------------------------------------- public API
def expert_rows(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13, w2, *,
                remap: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """[T, k, H]: weights[t, j] * expert(x[t]) per (token, position); zero where remap gives -1."""
    backend = backend or ("triton" if x.is_cuda else "torch")
    if backend != "torch":
        _check_backend(backend, x)
    T, H = x.shape
    R, two_i, h13 = w13.shape
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != T:
        raise ConfigError(f"fused_moe: ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be "
                          f"[T={T}, k]")
    if h13 != H or tuple(w2.shape) != (R, H, two_i // 2):
        raise ConfigError(f"fused_moe: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x [T, {H}]: "
                          f"expected [R, 2I, {H}] and [R, {H}, I]")
    if type(w13) is not type(w2):
        raise ConfigError("fused_moe: w13 and w2 must both be dense or both Int4Experts")
    if remap is not None and (remap.dim() != 1 or remap.dtype not in (torch.int32, torch.int64)):
        raise ConfigError(f"fused_moe: remap must be a 1-D int32 table expert -> row; got {remap.dtype} "
                          f"{tuple(remap.shape)}")
    if not torch.compiler.is_compiling():  # eager: skip the dispatcher
        if backend == "torch":
            return moe_rows_torch(x, ids, weights, w13, w2, remap)
        from .kernels import moe_rows_triton
        return moe_rows_triton(x, ids, weights, w13, w2, remap)
    if isinstance(w13, Int4Experts):
        return _expert_rows_op(x, ids, weights, w13.qweight, w2.qweight, w13.scale, w13.shift, w2.scale, w2.shift,
                               remap, backend)
    return _expert_rows_op(x, ids, weights, w13, w2, None, None, None, None, remap, backend)


def combine_rows(rows: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """[T, k, H] -> [T, H], positions added left to right in fp32 and rounded once. The torch backend
    is this function's own body (the reference combine_triton is tested against)."""
    backend = backend or ("triton" if rows.is_cuda else "torch")
    if torch.compiler.is_compiling():
        return _combine_rows_op(rows, backend)
    if backend != "torch":
        _check_backend(backend, rows)
        return _combine_rows_impl(rows, backend)
    if rows.shape[1] == 1:
        return rows[:, 0].clone()
    fp32 = rows.dtype == torch.float32
    acc = rows[:, 0] + rows[:, 1] if fp32 else rows[:, 0].float() + rows[:, 1].float()
    for j in range(2, rows.shape[1]):
        acc += rows[:, j] if fp32 else rows[:, j].float()
    return acc if fp32 else acc.to(rows.dtype)


def merge_rows(rows: torch.Tensor, late: torch.Tensor, ids: torch.Tensor, late_remap: torch.Tensor) -> torch.Tensor:
    """`rows` with the rows a second call computed (those whose expert `late_remap` maps) taken
    from `late`: exactly the rows one call over both sets of experts gives."""
    took = late_remap[ids] >= 0  # [T, k]
    return torch.where(took[..., None], late, rows)


def fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13, w2, *,
              remap: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """y [T, H]: the routed experts of every token, combined (see the module docstring)."""
    backend = backend or ("triton" if x.is_cuda else "torch")
    return combine_rows(expert_rows(x, ids, weights, w13, w2, remap=remap, backend=backend), backend=backend)


# ------------------------------------------------------------------------------ torch backend
_scratch = threading.local()


def _buffer(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This thread's reusable CPU buffer for one converted expert weight: fresh memory for each one
    costs page faults, several times the GEMV it feeds. Grown to the largest weight converted, never
    shrunk."""
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


def grouped_linear(a: torch.Tensor, w, runs: list[tuple[int, int, int]]) -> torch.Tensor:
    """a [n, K], rows grouped in runs (weight row r, first, end) -> [n, N]: a[first:end] @ w[r].T per
    run, every row computed as if alone (see the module docstring)."""
    parts = []
    if a.dtype != torch.float32:  # 16-bit: plain linears, whose rows do not depend on M
        for r, s, e in runs:
            parts.append(F.linear(a[s:e], _dense(w, r, a.dtype)))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    # fp32: one row, a GEMV; several, a bmm of one-row entries (each a GEMV) against the expert
    a3 = a.unsqueeze(1)  # [n, 1, K]
    view = not isinstance(w, Int4Experts) and w.dtype == a.dtype  # else converted per run
    for r, s, e in runs:
        wt = (w[r] if view else _dense(w, r, a.dtype)).t()  # [K, N]
        parts.append(torch.matmul(a3[s:e], wt) if e - s == 1 else torch.bmm(a3[s:e], wt.expand(e - s, -1, -1)))
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).view(a.shape[0], -1)


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """[n, 2I] gate|up -> [n, I] silu(gate) * up, every row computed alike (see the module docstring)."""
    n, two_i = h.shape
    i = two_i // 2
    step = max(1, (_SERIAL - 1) // i)  # rows per chunk: under the grain, so one thread each
    if n <= step:
        return F.silu(h[:, :i]) * h[:, i:]
    out = []
    for c in h.split(step):
        out.append(F.silu(c[:, :i]) * c[:, i:])
    return torch.cat(out)


def moe_rows_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13, w2,
                   remap: torch.Tensor | None) -> torch.Tensor:
    """[T, k, H]: row (t, j) = weights[t, j] * expert(x[t]), zero where remap sends the expert to -1."""
    T, k = ids.shape
    H = x.shape[1]
    flat = ids.reshape(-1)
    wrow = (remap[flat] if remap is not None else flat).tolist()  # weight row of each (t, j); host read
    if T == 1:  # a decode step: each of the k distinct experts runs on x alone (two GEMVs), in order
        ys = x.new_zeros(k, H)
        dt, I = x.dtype, w2.shape[2]
        view = not isinstance(w13, Int4Experts) and w13.dtype == dt  # else converted per expert
        for j, r in enumerate(wrow):
            if r >= 0:  # silu(gate) * up on one row: one thread, as silu_mul
                h = F.linear(x, w13[r] if view else _dense(w13, r, dt))  # [1, 2I]
                ys[j] = F.linear(F.silu(h[:, :I]) * h[:, I:], w2[r] if view else _dense(w2, r, dt))[0]
        w = weights.view(k, 1)  # weighted in fp32, rounded once for 16-bit rows
        return (ys.mul_(w) if dt == torch.float32 else (ys.float() * w.float()).to(dt)).view(1, k, H)
    by_row: dict[int, list[int]] = {}  # weight row -> its (t, j) flat indices, in token order
    for i, r in enumerate(wrow):
        if r >= 0:
            by_row.setdefault(r, []).append(i)
    if not by_row:
        return x.new_zeros(T, k, H)
    runs, order = [], []  # (weight row, first, end): each expert's run of rows, by weight row
    for r in sorted(by_row):
        runs.append((r, len(order), len(order) + len(by_row[r])))
        order += by_row[r]
    n = len(order)
    slot = torch.tensor(order, device=x.device)  # [n] flat (t, j) index of each grouped row
    xs, w = x.index_select(0, slot // k), weights.reshape(-1).index_select(0, slot)[:, None]
    ys = grouped_linear(silu_mul(grouped_linear(xs, w13, runs)), w2, runs)  # [n, H], then weighted in fp32
    ys = ys.mul_(w) if ys.dtype == torch.float32 else (ys.float() * w.float()).to(ys.dtype)
    out = x.new_empty(T * k, H) if n == T * k else x.new_zeros(T * k, H)
    return out.index_copy_(0, slot, ys).view(T, k, H)

