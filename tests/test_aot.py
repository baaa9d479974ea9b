"""Every kernel specialization the engine launches compiles for real NVIDIA targets (sm_80, sm_89,
sm_90), without a GPU: the launches are recorded from fused_moe's own launch code on CPU stand-in
tensors of real model shapes and compiled ahead of time (specter.triton_ops.aot). The interpreter
the other kernel tests use runs kernels as Python and cannot see what this sees: type errors of
compiled Triton, register spills, shared memory, and how wide the weight loads are.

Runs against the Triton installed, and against the lowest Triton pyproject.toml allows when
.ci/run has put it in $SPECTER_TRITON_LOWEST (a directory for PYTHONPATH), in a subprocess.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton.backends.nvidia", reason="needs a Triton wheel with its NVIDIA backend")

from specter.triton_ops import aot, kernels  # noqa: E402


@pytest.fixture(scope="module")
def launches():
    return aot.engine_launches()


@pytest.fixture(scope="module")
def reports(launches):
    return [(launch, aot.inspect(launch, cc)) for launch in launches for cc in aot.TARGETS]


def test_recorded_launches_cover_every_kernel_and_variant(launches):
    """The matrix the engine launches: align (with and without a remap row), both expert kernels
    dense and quantized at 4, 3 and 2 bits, with and without masked K tiles, and the combine."""
    names = {launch.kernel.fn.__name__ for launch in launches}
    assert names == set(aot.KERNELS)
    variants = {(launch.kernel.fn.__name__, launch.kwargs.get("BITS"), launch.kwargs.get("HAS_REMAP"))
                for launch in launches}
    assert {(k, b, None) for k in ("_gate_up_kernel", "_down_kernel") for b in (0, 4, 3, 2)} <= variants
    assert {("_align_kernel", None, True), ("_align_kernel", None, False)} <= variants
    for bits in (4, 3, 2):
        assert any(launch.kwargs.get("GROUP_TILE") and launch.kwargs.get("BITS") == bits for launch in launches)


def test_every_specialization_compiles_without_spills_within_shared_memory(reports):
    for launch, r in reports:
        assert r.spill_bytes == 0, (r.kernel, r.cc, r.signature, r.registers)
        assert r.shared_bytes <= aot.SHARED_LIMIT[r.cc], (r.kernel, r.cc, r.shared_bytes)
        assert r.registers <= 255


def test_no_kernel_loads_single_bytes(reports):
    for launch, r in reports:
        assert r.byte_loads == 0, (r.kernel, r.cc, r.loads)


def test_weight_tiles_are_read_with_wide_loads(reports):
    """Dense and quantized weight tiles go through cp.async (or vector loads), 16 bytes a thread
    where a weight row is a multiple of 64 bytes (every real model's), whole int32 words at least
    elsewhere (the bundled model's INT4 w2: 96-byte rows, whose alignment Triton cannot prove). A
    2- or 3-bit plane of a 128-column tile is smaller than 16 bytes for each of the 128 threads
    (32 rows of 8 or 4 words): its floor is the whole tile spread over them, 8 bytes or one word."""
    for launch, r in reports:
        if r.kernel not in ("gate_up_kernel", "down_kernel"):
            continue
        kw = launch.kwargs
        for tile in aot.weight_tiles(launch):
            widths = r.weight_load_bytes({tile})
            if not kw["BITS"] and not widths:
                continue  # a dense tile of another dtype than this launch's
            assert widths, (r.kernel, r.cc, tile, r.tile_loads)
            K = launch.args[8] if r.kernel == "gate_up_kernel" else launch.args[10]  # H, or I
            row_bytes = K * kw["BITS"] // 8 if kw["BITS"] else K * 2  # a weight row's stride in bytes
            floor = min(16, tile[0] * tile[1] * 4 // 128) if row_bytes % 64 == 0 else 4
            assert min(widths) >= floor, (r.kernel, r.cc, kw["BITS"], tile, row_bytes, r.tile_loads)


def test_real_model_shapes_are_recorded_at_their_sizes():
    """Stand-ins are real sizes in untouched memory: Mixtral's w13 is 1.75 GiB of address space."""
    H, I, E, k = aot.MODELS["Mixtral-8x7B"]
    w13, w2 = aot.stand_in_experts(E, H, I, torch.bfloat16, int4=False)
    assert w13.shape == (8, 2 * 14336, 4096) and w13.nbytes == 8 * 2 * 14336 * 4096 * 2
    log = aot.record_moe(H, I, E, k, 1, torch.bfloat16, False, None)
    assert [launch.kernel.fn.__name__ for launch in log] == list(aot.KERNELS)
    assert log[1].grid[1] == -(-I // log[1].kwargs["BLOCK_N"]) and log[2].grid[1] == H // log[2].kwargs["BLOCK_N"]


def test_the_alignment_is_one_kernel_for_every_slot_pool_size():
    """The alignment held a one-hot over every weight row in registers ([R_BLOCK], R_BLOCK the power of
    two above R): at a shared slot pool's 4096+ rows (Qwen3-30B-A3B at 2/3 residency) it spilled 8-16 KB
    on sm_89/90, and engine_launches' per-layer pools never reached such an R. It now works over pairs of
    rows: the launch, and so the kernel the spill test compiles, is the same whatever the pool's size."""
    keys = set()
    for R in (8, 128, 4128, 6144):
        remap = torch.randperm(R)[:128].int()
        with aot.recording() as log:
            kernels.align_rows_triton(torch.randint(0, 128, (1, 8)), R, remap)
        keys |= {aot._key(launch, cc) for launch in log for cc in aot.TARGETS}
    assert len(keys) == len(aot.TARGETS)


def test_float_fusion_is_named_by_every_launch_not_left_to_the_environment(launches, monkeypatch):
    """The INT4 dequantization ((q - shift) * scale into the dot) compiles to fused multiply-adds, one rounding,
    where Triton's default allows it; Triton 3.10 turns that default (TRITON_DEFAULT_FP_FUSION) off. Every
    launch names launch.FP_FUSION, so the draft's kernels round the same under any Triton and environment."""
    import dataclasses

    from specter.triton_ops import launch as launcher

    assert {launch.kwargs.get("enable_fp_fusion") for launch in launches} == {launcher.FP_FUSION} == {True}
    int4 = next(launch for launch in launches
                if launch.kernel.fn.__name__ == "_gate_up_kernel" and launch.kwargs.get("BITS") == 4)
    unnamed = dataclasses.replace(int4, kwargs={k: v for k, v in int4.kwargs.items() if k != "enable_fp_fusion"})
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    fma = re.compile(r"\bfma\.rn")
    assert fma.search(aot.compile_launch(int4, 90).asm["ptx"])
    assert not fma.search(aot.compile_launch(unnamed, 90).asm["ptx"])  # what the environment alone would give


def test_a_kernel_that_only_the_interpreter_accepts_fails_here():
    """The fault class this guards: an `if C: return a` then `return b` of another type runs under
    the interpreter and does not compile."""
    import triton
    import triton.language as tl

    @triton.jit
    def two_returns(x_ptr, C: tl.constexpr):
        if C:
            return tl.load(x_ptr).to(tl.uint8)
        return tl.load(x_ptr)

    @triton.jit
    def kern(x_ptr, y_ptr, C: tl.constexpr):
        tl.store(y_ptr, two_returns(x_ptr, C).to(tl.float32))

    x = torch.zeros(4)
    launch = aot.Launch(kern, (1,), (x, x), {"C": True, "enable_fp_fusion": True})  # as launch() names it
    with pytest.raises(Exception) as failed:
        aot.compile_launch(launch, 90)
    chain, e = [], failed.value
    while e is not None:
        chain.append(str(e))
        e = e.__cause__ or e.__context__
    assert re.search(r"[Ii]nconsistent return types|[Rr]eturn type mismatch", "\n".join(chain))  # 3.6 | 3.9


LOWEST = os.environ.get("SPECTER_TRITON_LOWEST")


@pytest.mark.skipif(not LOWEST, reason="SPECTER_TRITON_LOWEST (a PYTHONPATH with the lowest Triton allowed) "
                                       "is set by .ci/run")
def test_the_lowest_allowed_triton_passes_these_tests_too():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [LOWEST, os.environ.get("PYTHONPATH")])))
    env.pop("SPECTER_TRITON_LOWEST")
    lossless = Path(__file__).with_name("test_lossless.py")  # the decode kernel's compiles (the GPU image has 3.6)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                        f"{lossless}::test_decode_kernel_compiles_for_every_target_without_spills",
                        f"{lossless}::test_decode_kernel_reads_words_never_bytes",
                        str(Path(__file__).with_name("test_launch.py"))],  # its stub driver and direct launches
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    check = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__)"], env=env,
                           capture_output=True, text=True)
    assert check.stdout.strip() != __import__("triton").__version__, "the lowest Triton was not the one imported"
