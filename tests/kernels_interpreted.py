"""The Triton kernels under TRITON_INTERPRET=1, against the torch backend. Run through
test_triton_ops.py::test_kernels_under_the_triton_interpreter, which starts a process with the
variable set before triton is imported (the interpreter needs it at import time); collected on its
own (`TRITON_INTERPRET=1 pytest tests/kernels_interpreted.py`) it skips without it.
"""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 from process start", allow_module_level=True)

from specter.triton_ops import combine_rows, expert_rows, fused_moe, merge_rows  # noqa: E402
from specter.triton_ops import kernels  # noqa: E402
from test_triton_ops import moe_case  # noqa: E402


def test_every_dot_block_is_at_least_16():
    from specter.triton_ops.align import BLOCK_M
    assert min(BLOCK_M, kernels.BLOCK_N, kernels.BLOCK_K, kernels.BLOCK_K_INT4) >= 16


KERNEL_SHAPES = dict(H=80, I=40)  # two K-loop steps over H, partial tiles everywhere, INT4 groups of 8
LOW_BIT_SHAPES = dict(H=96, I=96)  # 3 bits need K divisible by 32: masked second K steps in both kernels


def shapes(int4):
    return LOW_BIT_SHAPES if int4 in (3, 2) else KERNEL_SHAPES


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("int4", [False, True, 3, 2])
@pytest.mark.parametrize("R", [None, 3])
def test_kernels_match_the_torch_backend(dtype, int4, R):
    """Every (T, top-k) of the issue's matrix: rows per (token, position), skipped rows zero; dense
    weights and codes of 4, 3 and 2 bits (int4 = True is 4)."""
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=4e-3)
    for T, k in [(1, 1), (5, 2), (33, 8), (65, 2)]:
        x, ids, w, w13, w2, remap = moe_case(T, k, E=10, R=R, dtype=dtype, int4=int4, **shapes(int4))
        rows = expert_rows(x, ids, w, w13, w2, remap=remap, backend="triton")
        ref = expert_rows(x, ids, w, w13, w2, remap=remap, backend="torch")
        torch.testing.assert_close(rows, ref, **tol)
        if remap is not None:
            assert (rows[remap[ids] < 0] == 0).all()
        assert torch.equal(combine_rows(rows, backend="triton"), combine_rows(rows, backend="torch"))


@pytest.mark.parametrize("int4", [False, True, 3, 2])
def test_kernels_are_batch_invariant_and_split_calls_merge_exactly(int4):
    x, ids, w, w13, w2, _ = moe_case(33, 2, E=8, dtype=torch.float16, int4=int4, **shapes(int4))
    full = fused_moe(x, ids, w, w13, w2, backend="triton")
    for t in (0, 32):
        assert torch.equal(fused_moe(x[t:t + 1], ids[t:t + 1], w[t:t + 1], w13, w2, backend="triton")[0], full[t])
    everything = torch.arange(8, dtype=torch.int32)
    first = torch.where(everything % 3 == 0, everything, -1)
    late = torch.where(first < 0, everything, -1)
    merged = merge_rows(expert_rows(x, ids, w, w13, w2, remap=first, backend="triton"),
                        expert_rows(x, ids, w, w13, w2, remap=late, backend="triton"), ids, late)
    assert torch.equal(combine_rows(merged, backend="triton"), full)


@pytest.mark.parametrize("group", [128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bits", [4, 3, 2])
def test_int4_scales_loaded_once_per_tile_give_the_same_bits(group, dtype, bits, monkeypatch):
    """Groups that the quantized block divides (128: a group a tile; 256: two tiles a group, and w2's
    K = 128 gets a group of 128): one scale and shift load per row of a tile gives the bits of
    loading them per element, and the torch backend's values; at every code width (unmasked
    K steps, so the 3-bit high plane's aligned offset is taken)."""
    from specter.triton_ops import pack_experts
    assert kernels.group_tile(group) and not kernels.group_tile(64)
    x, ids, w = moe_case(33, 2, H=256, I=128, dtype=dtype)[:3]
    w13, w2 = moe_case(33, 2, H=256, I=128)[3:5]
    q13, q2 = pack_experts(w13, bits, group, dtype=dtype), pack_experts(w2, bits, group, dtype=dtype)
    per_tile = expert_rows(x, ids, w, q13, q2, backend="triton")
    # K = 256: sums twice as long as KERNEL_SHAPES', and the kernel rounds a dequantized weight once
    # where the reference rounds `scale * q` and then `- shift`
    tol = dict(rtol=1e-5, atol=5e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(per_tile, expert_rows(x, ids, w, q13, q2, backend="torch"), **tol)
    monkeypatch.setattr(kernels, "group_tile", lambda g, block_k: False)
    assert torch.equal(per_tile, expert_rows(x, ids, w, q13, q2, backend="triton"))


def test_one_launch_alignment_equals_the_torch_alignment():
    """align_rows_triton against align.align_rows, every output: top-k 1, 2 and 8, T up to 65 (chunks
    of 32 rows cut through experts' runs), a remap with skipped experts, a routing that skips every
    row, a shared pool's 6144 weight rows, an expert twice in a token, a strided remap."""
    from specter.triton_ops.align import align_rows
    g = torch.Generator().manual_seed(3)
    cases = []
    for T, k, E in [(1, 1, 4), (1, 8, 12), (5, 2, 6), (33, 8, 40), (65, 2, 6), (65, 4, 40)]:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        remap = torch.randperm(E, generator=g).int()
        remap[torch.rand(E, generator=g) < 0.3] = -1
        cases += [(ids, E, None), (ids, E, remap), (ids, E - 1, torch.where(remap == E - 1, -1, remap))]
    cases.append((torch.tensor([[0, 1]]), 2, torch.tensor([-1, -1], dtype=torch.int32)))
    # a shared slot pool's thousands of weight rows; a token naming an expert twice; a remap that is a
    # strided view (it was read as if contiguous)
    pool = torch.randperm(6144, generator=g)[:128].int()
    pool[torch.rand(128, generator=g) < 0.3] = -1
    cases += [(torch.randint(0, 128, (T, 8), generator=g), 6144, pool) for T in (1, 9, 33)]
    cases.append((torch.tensor([[3, 3], [1, 3]]), 4, None))
    cases.append((torch.randint(0, 40, (9, 8), generator=g), 6144, torch.stack([pool, -pool], 1)[:40, 0]))
    for ids, R, remap in cases:
        got, want = kernels.align_rows_triton(ids, R, remap), align_rows(ids, R, remap)
        for name, a, b in zip(want._fields, got, want):
            assert torch.equal(a, b), (name, tuple(ids.shape), R, remap)
