"""The Triton backend of fused_moe: two grouped kernels and the top-k combine.

    align    grid (1,)                    rows grouped by expert in padded blocks (align.py's, one launch)
    gate_up  grid (NB, cdiv(I, BLOCK_N))  block b, columns n:
             a[slot, n] = silu(x[tok] . W1[e, n]) * (x[tok] . W3[e, n])   for the BLOCK_M slots of b
    down     grid (NB, cdiv(H, BLOCK_N))
             out[row, n] = weights[row] * (a[slot] . W2[e, n])           stored at the slot's (t, j) row
    combine  grid (T, cdiv(H, BLOCK_H))    y[t] = out[t, 0] + out[t, 1] + ... in fp32, rounded once

e = the block's weight row (align.py), tok = row // top_k. A weight tile is [BLOCK_N, BLOCK_K]:
BLOCK_N rows of the expert, each a contiguous run along K (vector loads). Quantized weights at
4, 3 or 2 bits (int4.py's layout: codes in int32 words along K, the constexpr BITS; group-major
scales) are dequantized inside the K loop a tile at a time (`scale * q - shift` in the scales'
dtype), so no whole expert is ever dequantized; when the block divides the group size (128 on
real models) a tile's scales and shifts are one vector load each. Every tl.dot is at least 16 in each dimension (NVIDIA's minimum; the
interpreter would accept less). Block sizes never depend on
T, and each output is one K loop in a fixed order, so a token's bits do not depend on the batch.

CPU tensors run under TRITON_INTERPRET=1 (set before triton is imported), which has no bf16
arithmetic: test there in fp16/fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specter.errors import ConfigError

from .align import BLOCK_M, Alignment, align_rows, max_blocks
from .int4 import Int4Experts
from .launch import launch

BLOCK_N, BLOCK_H = 32, 128
BLOCK_K = 64         # 16-bit weights: a [32, 64] tile is 32 bytes a thread (4 warps), two 16-byte loads
BLOCK_K_INT4 = 128   # INT4: a [32, 128] tile is 16 bytes a thread, one load; and a tile is one group of 128
                     # (64 where K is no multiple of 128: 8 bytes a thread, but no masked columns).
                     # 2 and 3 bits keep the tile one group (one scale load a row): 8 bytes a thread at
                     # 2 bits, 8 + 4 at 3 (its two planes)


@triton.jit
def _tile_mask(row_ok, col_ok, EVEN_K: tl.constexpr):
    """[rows, cols] mask; with EVEN_K the columns need none (a mask varying along K caps vector width)."""
    if EVEN_K:
        mask = row_ok[:, None]
    else:
        mask = row_ok[:, None] & col_ok[None, :]
    return mask


@triton.jit
def _plane(w_ptr, offs_n, n_ok, k0, K, stride_wn, WIDTH: tl.constexpr, EVEN_K: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K] int32 fields of one plane of codes at w_ptr: 32 / WIDTH fields a word along K,
    field i of word j at bits WIDTH * i (int4.py), its K * WIDTH / 32 words a row contiguous."""
    offs_w = tl.multiple_of(k0 * WIDTH // 32, BLOCK_K * WIDTH // 32) + tl.arange(0, BLOCK_K * WIDTH // 32)
    words = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_w[None, :],
                    mask=_tile_mask(n_ok, offs_w < K * WIDTH // 32, EVEN_K), other=0)
    q = (words[:, :, None] >> (tl.arange(0, 32 // WIDTH) * WIDTH)[None, None, :]) & ((1 << WIDTH) - 1)
    return tl.reshape(q, (BLOCK_N, BLOCK_K))  # [BLOCK_N, BLOCK_K / (32 / WIDTH), 32 / WIDTH] -> along K


@triton.jit
def _weight_tile(w_ptr, s_ptr, z_ptr, offs_n, n_ok, k0, K, stride_wn, stride_sg, group_size,
                 BITS: tl.constexpr, GROUP_TILE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K] tile of an expert's weight rows offs_n at columns k0 .. k0 + BLOCK_K, each
    row a contiguous run. BITS = 0: dense weights. BITS = 4, 3, 2: w_ptr is the expert's int32 words
    (int4.py's layout: 4 and 2 bits one plane, 8 or 16 codes a word; 3 bits a 2-bit plane of the low
    bits, then a 1-bit plane of the high bit after the row's K / 16 low words), s_ptr/z_ptr its
    group-major scales/shifts, and the tile is dequantized in the scales' dtype, as
    QuantExperts.dequantize does (in fp32, gate_up's two tiles spilled registers on sm_90 with
    Triton 3.6's ptxas: tests/test_aot.py). GROUP_TILE: BLOCK_K divides the group size, so the tile
    lies in one group and its scales are BLOCK_N adjacent values. EVEN_K: BLOCK_K divides K, so no
    column needs a mask (which would cap the loads' width)."""
    if BITS == 0:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                    mask=_tile_mask(n_ok, offs_k < K, EVEN_K), other=0.0)
    else:
        if BITS == 3:
            high = K // 16                                # the high plane's first word in a row
            if EVEN_K:                                    # K a multiple of BLOCK_K: so is that offset of words
                high = tl.multiple_of(high, BLOCK_K // 16)
            q = _plane(w_ptr, offs_n, n_ok, k0, K, stride_wn, 2, EVEN_K, BLOCK_N, BLOCK_K)
            q = q | (_plane(w_ptr + high, offs_n, n_ok, k0, K, stride_wn, 1, EVEN_K, BLOCK_N, BLOCK_K) << 2)
        else:
            q = _plane(w_ptr, offs_n, n_ok, k0, K, stride_wn, BITS, EVEN_K, BLOCK_N, BLOCK_K)
        q = q.to(s_ptr.dtype.element_ty)
        if GROUP_TILE:
            g = (k0 // group_size) * stride_sg + offs_n                     # [BLOCK_N]
            s = tl.load(s_ptr + g, mask=n_ok, other=0.0)[:, None]
            z = tl.load(z_ptr + g, mask=n_ok, other=0.0)[:, None]
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            g = (offs_k // group_size)[None, :] * stride_sg + offs_n[:, None]  # [BLOCK_N, BLOCK_K]
            mask = n_ok[:, None] & (offs_k < K)[None, :]
            s = tl.load(s_ptr + g, mask=mask, other=0.0)
            z = tl.load(z_ptr + g, mask=mask, other=0.0)
        w = q * s - z
    return w


@triton.jit
def _dot(a, w, acc, IEEE: tl.constexpr):
    """acc + a [M, K] @ w[N, K].T"""
    if IEEE:  # fp32 inputs: full precision, not TF32
        acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc)
    return acc


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, z_ptr, a_ptr, slot_row_ptr, block_expert_ptr, n_padded_ptr,
                    H, I, M, top_k, stride_xt, stride_we, stride_wn, stride_se, stride_sg, group_size,
                    BITS: tl.constexpr, GROUP_TILE: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M < tl.load(n_padded_ptr):           # blocks past the real end do nothing
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.load(slot_row_ptr + offs_m)             # flat (t, j) rows; M = padding
        tok = tl.where(rows < M, rows // top_k, 0)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # intermediate columns
        n_ok = offs_n < I
        w_e, s_e, z_e = w_ptr + e * stride_we, s_ptr + e * stride_se, z_ptr + e * stride_se
        up = I * stride_wn                                # W3 rows follow W1's (rows, and scale columns)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + tok[:, None] * stride_xt + offs_k[None, :],
                        mask=_tile_mask(rows < M, offs_k < H, EVEN_K), other=0.0)
            wg = _weight_tile(w_e, s_e, z_e, offs_n, n_ok, k0, H, stride_wn, stride_sg, group_size,
                              BITS, GROUP_TILE, EVEN_K, BLOCK_N, BLOCK_K)
            wu = _weight_tile(w_e + up, s_e + I, z_e + I, offs_n, n_ok, k0, H, stride_wn, stride_sg, group_size,
                              BITS, GROUP_TILE, EVEN_K, BLOCK_N, BLOCK_K)
            acc_g = _dot(x, wg, acc_g, IEEE)
            acc_u = _dot(x, wu, acc_u, IEEE)
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u      # silu(gate) * up
        tl.store(a_ptr + offs_m[:, None] * I + offs_n[None, :], act.to(a_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit
def _down_kernel(a_ptr, w_ptr, s_ptr, z_ptr, out_ptr, rw_ptr, slot_row_ptr, block_expert_ptr, n_padded_ptr,
                 H, I, M, stride_we, stride_wn, stride_se, stride_sg, group_size,
                 BITS: tl.constexpr, GROUP_TILE: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M < tl.load(n_padded_ptr):
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.load(slot_row_ptr + offs_m)
        real = rows < M
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # hidden columns
        n_ok = offs_n < H
        w_e, s_e, z_e = w_ptr + e * stride_we, s_ptr + e * stride_se, z_ptr + e * stride_se
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + offs_m[:, None] * I + offs_k[None, :], mask=_tile_mask(offs_m >= 0, offs_k < I, EVEN_K),
                        other=0.0)
            w = _weight_tile(w_e, s_e, z_e, offs_n, n_ok, k0, I, stride_wn, stride_sg, group_size,
                             BITS, GROUP_TILE, EVEN_K, BLOCK_N, BLOCK_K)
            acc = _dot(a, w, acc, IEEE)
        rw = tl.load(rw_ptr + rows, mask=real, other=0.0).to(tl.float32)
        acc = acc * rw[:, None]                           # the routing weight, in-kernel
        tl.store(out_ptr + rows[:, None] * H + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=real[:, None] & n_ok[None, :])


@triton.jit
def _combine_kernel(rows_ptr, y_ptr, H, top_k, BLOCK_H: tl.constexpr):
    t, pid_h = tl.program_id(0), tl.program_id(1)
    offs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    base = rows_ptr + t.to(tl.int64) * top_k * H
    acc = tl.load(base + offs, mask=ok, other=0.0).to(tl.float32)
    for j in range(1, top_k):                             # left to right: the order is the contract
        acc += tl.load(base + j * H + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + t.to(tl.int64) * H + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _align_kernel(ids_ptr, remap_ptr, slot_row_ptr, block_expert_ptr, row_slot_ptr, n_padded_ptr,
                  M, NB, HAS_REMAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """align.align_rows in one program, over pairs of rows ([BLOCK, BLOCK] tiles), never over the
    weight rows: its work and registers do not grow with a shared slot pool's thousands of rows. A
    row's slot is its expert's padded start (the padded counts of the experts below it, each counted
    at its first row) plus its rank among the earlier rows of its expert."""
    lanes = tl.arange(0, BLOCK)
    for i0 in range(0, M, BLOCK):                            # 1. each expert's padded count, at its first row
        rows = i0 + lanes                                    # (0 at the others), in slot_row until step 3
        r = _weight_row(ids_ptr, remap_ptr, rows, M, HAS_REMAP)
        count = tl.zeros((BLOCK,), dtype=tl.int32)
        rank = tl.zeros((BLOCK,), dtype=tl.int32)
        for j0 in range(0, M, BLOCK):
            others = j0 + lanes
            same = r[:, None] == _weight_row(ids_ptr, remap_ptr, others, M, HAS_REMAP)[None, :]  # [BLOCK, BLOCK]
            count += tl.sum(same.to(tl.int32), 1)
            rank += tl.sum((same & (others[None, :] < rows[:, None])).to(tl.int32), 1)
        padded = tl.where((r >= 0) & (rank == 0), (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
        tl.store(slot_row_ptr + rows, padded, mask=rows < M)
    for b0 in range(0, NB, BLOCK):                           # blocks no expert fills: -1
        blocks = b0 + lanes
        tl.store(block_expert_ptr + blocks, tl.full((BLOCK,), -1, dtype=tl.int32), mask=blocks < NB)
    tl.debug_barrier()
    total = tl.zeros((BLOCK,), dtype=tl.int32)
    for i0 in range(0, M, BLOCK):                            # 2. each row's slot; each expert's blocks
        rows = i0 + lanes
        r = _weight_row(ids_ptr, remap_ptr, rows, M, HAS_REMAP)
        start = tl.zeros((BLOCK,), dtype=tl.int32)
        rank = tl.zeros((BLOCK,), dtype=tl.int32)
        for j0 in range(0, M, BLOCK):
            others = j0 + lanes
            r_other = _weight_row(ids_ptr, remap_ptr, others, M, HAS_REMAP)
            padded_other = tl.load(slot_row_ptr + others, mask=others < M, other=0)
            start += tl.sum(tl.where(r_other[None, :] < r[:, None], padded_other[None, :], 0), 1)
            rank += tl.sum(((r[:, None] == r_other[None, :]) & (others[None, :] < rows[:, None])).to(tl.int32), 1)
        tl.store(row_slot_ptr + rows, tl.where(r >= 0, start + rank, NB * BLOCK_M).to(tl.int64), mask=rows < M)
        padded = tl.load(slot_row_ptr + rows, mask=rows < M, other=0)  # > 0 at an expert's first row only
        total += padded
        for t in range(0, tl.cdiv(M, BLOCK_M)):
            tl.store(block_expert_ptr + start // BLOCK_M + t, r, mask=t * BLOCK_M < padded)
    tl.store(n_padded_ptr, tl.sum(total, 0))
    tl.debug_barrier()
    for s0 in range(0, NB * BLOCK_M, BLOCK):                 # 3. every slot padding ...
        slots = s0 + lanes
        tl.store(slot_row_ptr + slots, tl.zeros((BLOCK,), dtype=tl.int32) + M, mask=slots < NB * BLOCK_M)
    tl.debug_barrier()
    for i0 in range(0, M, BLOCK):                            # ... before rows land in some
        rows = i0 + lanes
        dest = tl.load(row_slot_ptr + rows, mask=rows < M, other=0)
        tl.store(slot_row_ptr + dest, rows, mask=(rows < M) & (dest < NB * BLOCK_M))


@triton.jit
def _weight_row(ids_ptr, remap_ptr, offs, M, HAS_REMAP: tl.constexpr):
    """[BLOCK] weight row of flat rows offs: remap[ids] (or ids), -1 = skipped or past M."""
    ok = offs < M
    e = tl.load(ids_ptr + offs, mask=ok, other=0)
    if HAS_REMAP:
        e = tl.load(remap_ptr + e, mask=ok, other=-1)
    return tl.where(ok, e.to(tl.int32), -1)


# CPU tensors can be launched on: the interpreter runs the kernels (or aot.record takes the launches)
LAUNCHES_ON_CPU = type(_gate_up_kernel).__name__ == "InterpretedFunction"
ALIGN_ONE_PROGRAM_ROWS = 1024  # more (T, j) rows (a long prefill) than one program should walk alone


def align_rows_triton(ids: torch.Tensor, n_weight_rows: int, remap: torch.Tensor | None = None) -> Alignment:
    """align.align_rows (the reference, equal output) in one launch instead of ~15 small torch ops.
    One program walks the rows in order: made for decode and verification widths; past
    ALIGN_ONE_PROGRAM_ROWS rows the torch version's parallel ops are used (the same alignment)."""
    M, R = ids.numel(), n_weight_rows
    if M > ALIGN_ONE_PROGRAM_ROWS:
        return align_rows(ids, R, remap)
    nb = max_blocks(M, R)
    dev = ids.device
    slot_row = torch.empty(nb * BLOCK_M, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nb, dtype=torch.int32, device=dev)
    row_slot = torch.empty(M, dtype=torch.int64, device=dev)
    n_padded = torch.empty(1, dtype=torch.int32, device=dev)
    ids = ids.reshape(-1).contiguous()
    launch(_align_kernel, (1,), ids, ids if remap is None else remap.contiguous(), slot_row, block_expert, row_slot,
           n_padded, M, nb, HAS_REMAP=remap is not None, BLOCK_M=BLOCK_M, BLOCK=32)
    return Alignment(slot_row, block_expert, row_slot, n_padded)


def int4_block_k(K: int) -> int:
    return BLOCK_K_INT4 if K % BLOCK_K_INT4 == 0 else BLOCK_K


def group_tile(group_size: int, block_k: int = BLOCK_K_INT4) -> bool:
    """Whether each [block_k] step of the K loop lies in one INT4 group (then one scale load a row)."""
    return group_size % block_k == 0


def _tiles(w, K: int) -> dict:
    """The launch constants of a weight's K loop: the code width (0: dense), its block sizes, whether
    tiles lie in one group and whether the block divides K. They depend on the weights only, never on T."""
    quant = isinstance(w, Int4Experts)
    block_k = int4_block_k(K) if quant else BLOCK_K
    return dict(BITS=w.bits if quant else 0, GROUP_TILE=quant and group_tile(w.group_size, block_k),
                EVEN_K=K % block_k == 0, BLOCK_N=BLOCK_N, BLOCK_K=block_k)


def _parts(w, dtype):
    """(int32 words or dense weights, scales, shifts, stride_e of scales, stride_g of scales, group size)."""
    if isinstance(w, Int4Experts):
        q, s, z = w.qweight.contiguous(), w.scale.contiguous(), w.shift.contiguous()
        return q, s, z, s.stride(0), s.stride(1), w.group_size
    if w.dtype != dtype:  # a same-dtype .to() returns w, but still costs a dispatch a call
        w = w.to(dtype)
    w = w.contiguous()
    return w, w, w, 0, 0, 1  # scales unused: any pointer will do


def moe_rows_triton(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13, w2,
                    remap: torch.Tensor | None) -> torch.Tensor:
    """[T, k, H]: the Triton version of reference.moe_rows_torch."""
    if not x.is_cuda and not LAUNCHES_ON_CPU:
        raise ConfigError("the triton backend on CPU tensors needs TRITON_INTERPRET=1 in the environment "
                          "before triton is first imported (optimum-quanto imports it)")
    T, k = ids.shape
    H, M = x.shape[1], T * k
    R = w13.n_experts if isinstance(w13, Int4Experts) else w13.shape[0]
    I = w2.shape[2]
    x = x.contiguous()
    a = align_rows_triton(ids, R, remap)
    nb = a.block_expert.numel()
    act = x.new_empty(nb * BLOCK_M, I)
    out = x.new_zeros(M, H)
    if nb == 0:
        return out.view(T, k, H)
    rw = weights.reshape(-1).contiguous()
    ieee = x.dtype == torch.float32
    q13, s13, z13, se13, sn13, g13 = _parts(w13, x.dtype)
    tiles = _tiles(w13, H)
    launch(_gate_up_kernel, (nb, -(-I // tiles["BLOCK_N"])),
           x, q13, s13, z13, act, a.slot_row, a.block_expert, a.n_padded,
           H, I, M, k, x.stride(0), q13.stride(0), q13.stride(1), se13, sn13, g13,
           IEEE=ieee, BLOCK_M=BLOCK_M, **tiles)
    q2, s2, z2, se2, sn2, g2 = _parts(w2, x.dtype)
    tiles = _tiles(w2, I)
    launch(_down_kernel, (nb, -(-H // tiles["BLOCK_N"])),
           act, q2, s2, z2, out, rw, a.slot_row, a.block_expert, a.n_padded,
           H, I, M, q2.stride(0), q2.stride(1), se2, sn2, g2,
           IEEE=ieee, BLOCK_M=BLOCK_M, **tiles)
    return out.view(T, k, H)


def combine_triton(rows: torch.Tensor) -> torch.Tensor:
    T, k, H = rows.shape
    rows = rows.contiguous()
    y = rows.new_empty(T, H)
    launch(_combine_kernel, (T, -(-H // BLOCK_H)), rows, y, H, k, BLOCK_H=BLOCK_H)
    return y
