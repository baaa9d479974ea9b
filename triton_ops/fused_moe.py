"""fused_moe: a layer's routed experts in one grouped computation.

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

Backends: "triton" (kernels.py; CUDA, or CPU tensors under TRITON_INTERPRET=1) and "torch"
(reference.py; the CPU default). Routing is read on the device only.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from specter.errors import ConfigError

from .int4 import Int4Experts
from .reference import combine_torch, moe_rows_torch

BACKENDS = ("torch", "triton")


def default_backend(x: torch.Tensor) -> str:
    return "triton" if x.is_cuda else "torch"


def _check_backend(backend: str, x: torch.Tensor) -> None:
    if backend not in BACKENDS:
        raise ConfigError(f"unknown fused_moe backend {backend!r}; expected one of {BACKENDS}")
    if backend == "triton" and not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("the triton backend needs CUDA tensors, or TRITON_INTERPRET=1 set before triton "
                          "is imported for CPU tensors; use backend='torch' on CPU")


def _check(x, ids, weights, w13, w2, remap) -> None:
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
    return combine_torch(rows)


_combine_rows_op = torch.library.custom_op("specter::combine_rows", _combine_rows_impl, mutates_args=())


@_combine_rows_op.register_fake
def _(rows, backend):
    return rows.new_empty(rows.shape[0], rows.shape[2])


# --------------------------------------------------------------------------------- public API
def expert_rows(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13, w2, *,
                remap: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """[T, k, H]: weights[t, j] * expert(x[t]) per (token, position); zero where remap gives -1."""
    backend = backend or default_backend(x)
    _check_backend(backend, x)
    _check(x, ids, weights, w13, w2, remap)
    op = _expert_rows_op if torch.compiler.is_compiling() else _expert_rows_impl  # eager: skip the dispatcher
    if isinstance(w13, Int4Experts):
        return op(x, ids, weights, w13.qweight, w2.qweight, w13.scale, w13.shift, w2.scale, w2.shift, remap, backend)
    return op(x, ids, weights, w13, w2, None, None, None, None, remap, backend)


def combine_rows(rows: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """[T, k, H] -> [T, H], positions added left to right in fp32 and rounded once."""
    backend = backend or default_backend(rows)
    _check_backend(backend, rows)
    return (_combine_rows_op if torch.compiler.is_compiling() else _combine_rows_impl)(rows, backend)


def merge_rows(rows: torch.Tensor, late: torch.Tensor, ids: torch.Tensor, late_remap: torch.Tensor) -> torch.Tensor:
    """`rows` with the rows a second call computed (those whose expert `late_remap` maps) taken
    from `late`: exactly the rows one call over both sets of experts gives."""
    took = late_remap[ids] >= 0  # [T, k]
    return torch.where(took[..., None], late, rows)


def fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13, w2, *,
              remap: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """y [T, H]: the routed experts of every token, combined (see the module docstring)."""
    backend = backend or default_backend(x)
    rows = expert_rows(x, ids, weights, w13, w2, remap=remap, backend=backend)
    if torch.compiler.is_compiling():
        return _combine_rows_op(rows, backend)
    return _combine_rows_impl(rows, backend)  # eager: the backend is checked already
