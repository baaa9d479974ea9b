"""Group the (token, top-k position) rows of a routing by expert, on the device.

The Triton kernels compute experts over blocks of BLOCK_M rows that all use one expert (vLLM's
`moe_align_block_size` idea): rows are sorted by expert (stably, so each expert's rows keep token
order) and each expert's run is padded to a multiple of BLOCK_M. Every block therefore reads its
expert's weights once for up to BLOCK_M tokens, and every matmul has exactly BLOCK_M rows whatever
T is, which is what makes a token's result independent of the batch around it.

kernels.align_rows_triton does the same in one launch (tested equal); this is its reference.
No host sync: the number of blocks is a static upper bound (`max_blocks`); blocks past the real
end carry expert -1 and are skipped. Rows whose expert maps to -1 through `remap` are left out.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

BLOCK_M = 16  # rows per block: tl.dot's minimum


class Alignment(NamedTuple):
    slot_row: torch.Tensor     # int32 [NB * BLOCK_M]: the flat row (token * k + j) in each slot, M = padding
    block_expert: torch.Tensor  # int32 [NB]: the weight row each block uses, -1 = past the end
    row_slot: torch.Tensor     # int64 [M]: the slot holding each row, NB * BLOCK_M = skipped (remap -1)
    n_padded: torch.Tensor     # int32 [1]: slots in use (a multiple of BLOCK_M)


def max_blocks(n_rows: int, n_weight_rows: int, block_m: int = BLOCK_M) -> int:
    """Most blocks `n_rows` rows can need over `n_weight_rows` experts: each touched expert pads
    fewer than block_m slots, and at most min(n_rows, n_weight_rows) experts are touched."""
    return (n_rows + min(n_rows, n_weight_rows) * (block_m - 1)) // block_m


def align_rows(ids: torch.Tensor, n_weight_rows: int, remap: torch.Tensor | None = None,
               block_m: int = BLOCK_M) -> Alignment:
    """ids [T, k] expert ids; remap [E] expert -> weight row (-1 = skip) or None (identity)."""
    dev = ids.device
    flat = ids.reshape(-1).long()                                        # [M]
    M, R = flat.numel(), n_weight_rows
    rows = remap.long()[flat] if remap is not None else flat             # [M] weight row, -1 = skip
    key = torch.where(rows >= 0, rows, R)                                # skipped rows sort last
    counts = torch.zeros(R + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))
    counts[R] = 0
    padded = (counts + block_m - 1) // block_m * block_m                 # [R + 1]
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    run_start = counts.cumsum(0) - counts
    order = torch.sort(key, stable=True).indices                         # [M] rows, grouped by expert
    e = key[order]
    nb = max_blocks(M, R, block_m)
    trash = nb * block_m
    dest = torch.where(e < R, pad_start[e] + torch.arange(M, device=dev) - run_start[e], trash)
    slot_row = torch.full((trash + 1,), M, dtype=torch.int32, device=dev)
    slot_row.scatter_(0, dest, order.int())                              # only `trash` sees duplicates
    row_slot = torch.empty_like(dest).scatter_(0, order, dest)
    starts = torch.arange(nb, device=dev) * block_m
    block_expert = torch.searchsorted(pad_end, starts, right=True)       # first expert ending past start
    block_expert = torch.where(block_expert < R, block_expert, -1).int()
    return Alignment(slot_row[:trash], block_expert, row_slot, pad_end[R - 1:R].int())
