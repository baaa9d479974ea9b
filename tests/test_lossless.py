"""specter.triton_ops.lossless: bit-exact round trips of the lossless expert format (torch decode),
the decode kernel under the Triton interpreter (lossless_interpreted.py, in a subprocess), and the
kernel compiled ahead of time for sm_80/89/90 (no spills, no byte loads, wide loads)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specter.errors import ConfigError
from specter.triton_ops import lossless
from specter.triton_ops.lossless import LosslessExperts, encode


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _from_bits(bits, shape) -> torch.Tensor:
    """bf16 tensor of these 16-bit patterns (ints 0 .. 0xFFFF)."""
    b = torch.as_tensor(bits, dtype=torch.int32)
    return (b - (b >= 0x8000).int() * 0x10000).to(torch.int16).view(torch.bfloat16).reshape(shape)


def special_weights() -> dict[str, torch.Tensor]:
    """The cases the format must survive, each bf16 [E, N, K]."""
    g = torch.Generator().manual_seed(0)
    cases = {f"normal*{s:g}": (torch.randn(3, 40, 48, generator=g) * s).bfloat16() for s in (1e-30, 1e-3, 0.02, 1, 1e30)}
    every = torch.arange(0x10000)                                    # every bf16 bit pattern, once
    cases["every bit pattern"] = _from_bits(every[torch.randperm(0x10000, generator=g)], (2, 256, 128))
    # each exponent once per row of 256 (all distinct: 249 of them escape at any width)
    exps = torch.stack([torch.randperm(256, generator=g) for _ in range(8)])
    mant = torch.randint(0, 0x100, (8, 256), generator=g)
    cases["all exponents distinct"] = _from_bits((mant & 0x80) << 8 | exps << 7 | (mant & 0x7F), (2, 4, 256))
    special = [0x0000, 0x8000, 0x0001, 0x807F, 0x0040, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x7FA5, 0x0080]
    zeros_and_more = torch.zeros(2, 32, 33, dtype=torch.bfloat16)    # numel no multiple of 32
    flat = zeros_and_more.view(-1).view(torch.int16)
    flat[:len(special) * 40] = _from_bits(special * 40, (-1,)).view(torch.int16)
    cases["±0, subnormals, inf, NaN payloads, odd numel"] = zeros_and_more
    cases["one expert, all zero"] = torch.zeros(1, 8, 32, dtype=torch.bfloat16)
    return cases


@pytest.mark.parametrize("bits", [None, 2, 3, 4])
def test_round_trip_is_bit_exact(bits):
    for name, w in special_weights().items():
        packed = encode(w, bits)
        assert _bits(packed.decode()).equal(_bits(w)), (name, packed.bits)
        out = torch.full(w.shape[1:], float("nan"), dtype=torch.bfloat16)
        for e in range(w.shape[0]):
            assert _bits(packed.decode_into(out, e)).equal(_bits(w[e])), (name, e, packed.bits)


def test_bundled_model_experts_round_trip_and_shrink():
    """Every routed expert tensor of the bundled model: bit exact, and at most 0.72x the bf16 bytes."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from lossless_ratio import bundled_experts

    packed_bytes = raw_bytes = 0
    for w in bundled_experts():
        packed = encode(w)
        assert _bits(packed.decode()).equal(_bits(w))
        packed_bytes += packed.nbytes
        raw_bytes += packed.raw_nbytes
    assert packed_bytes <= 0.72 * raw_bytes


def test_width_is_the_smallest_encoding():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(2, 64, 64, generator=g) * 0.02).bfloat16()
    sizes = {b: encode(w, b).nbytes for b in lossless.WIDTHS}
    assert encode(w).bits == min(sizes, key=sizes.get)
    # a tensor of two exponents fits a 2-bit code with no escapes
    two = torch.where(torch.rand(2, 64, 64, generator=g) < 0.5, 1.0, 2.0).bfloat16() * torch.randn(1).sign().bfloat16()
    assert encode(two).bits == 2 and encode(two).escapes.numel() == 0


def test_layout_is_the_documented_one():
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(2, 32, 64, generator=g) * 0.1).bfloat16()
    packed = encode(w, 3)
    P = 32 * 64
    assert packed.signman.shape == (2, P) and packed.signman.dtype == torch.uint8
    assert packed.planes.shape == (2, 3, P // 32) and packed.planes.dtype == torch.int32
    assert packed.table.shape == (2, 8) and packed.esc_off.shape == (2, 2) and packed.esc_start.shape == (3,)
    bits = _bits(w).view(2, -1).int() & 0xFFFF
    assert packed.signman.int().equal(((bits >> 8) & 0x80) | (bits & 0x7F))
    codes = torch.stack([lossless.codes_of(packed, e) for e in range(2)]).long()
    # bit i of word j of plane p is bit p of element 32j + i's code
    words = packed.planes.long() & 0xFFFFFFFF
    assert (((words[:, 1, 5] >> 7) & 1) == ((codes[:, 32 * 5 + 7] >> 1) & 1)).all()
    exp = (bits >> 7) & 0xFF
    table = torch.gather(packed.table.long(), 1, codes)
    esc = codes == 7
    assert table[~esc].equal(exp[~esc].long())
    for e in range(2):
        assert packed.expert_escapes(e)[:int(esc[e].sum())].long().equal(exp[e][esc[e]].long())
        assert packed.esc_off[e, 1] == esc[e, :lossless.BLOCK].sum()
    assert packed.nbytes == sum(t.numel() * t.element_size() for t in packed.tensors())
    assert packed.expert_nbytes(0) + packed.expert_nbytes(1) + 3 * 8 == packed.nbytes
    moved = packed.to("cpu")
    assert moved.esc_start is packed.esc_start and _bits(moved.decode()).equal(_bits(w))


class _Copies(TorchDispatchMode):
    """Counts the copies (aten.copy_) run inside the block."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops.aten.copy_.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_one_tensors_copy_from_a_laid_out_layer_is_its_row_and_run(bits):
    """A tensor of a layer laid out for copies (layer_major, here paired with itself): the same format and
    bits, its row at most the rows' alignment above its bytes; a copy of one of its experts alone (stage,
    the path for slots of another dtype) is one copy of its row and one of its escape run (none without
    escapes)."""
    for name, w in special_weights().items():
        packed = encode(w, bits)
        pair = lossless.layer_major(packed, packed)
        for em in (pair.a, pair.b):
            assert em.nbytes == packed.nbytes and _bits(em.decode()).equal(_bits(w)), name
            R = lossless.row_layout(em)[1]
            fixed = packed.expert_nbytes(0) - packed.expert_escapes(0).numel()
            assert em.by_expert.shape == (w.shape[0], R) and fixed <= R < fixed + 4 * lossless.ALIGN + 64
            for e in range(w.shape[0]):
                with _Copies() as copies:
                    staged = lossless.stage(em, e, "cpu")
                run = packed.expert_escapes(e)
                assert copies.n == 1 + (run.numel() > 0), name
                assert staged[:R].equal(em.by_expert[e]) and staged[R:].equal(run), name


@pytest.mark.parametrize("slack", [None, 0.0, float("inf")])
def test_layer_major_lays_an_experts_two_tensors_side_by_side(slack, monkeypatch):
    """layer_major (a CUDA store's layout, a layer's w13 and w2 together): each tensor keeps its format
    and bits (by_expert a strided view, its fields at row_layout's offsets), expert e's rows of both
    are one contiguous run (a's then b's), and a copy of the expert (stage_pair) puts [a's row | b's row |
    a's run | b's run] on the device: one copy where the layer is laid out inline (each record's runs
    right after its rows), else one of the rows and one of each run it has. slack 0 puts the runs after
    all rows wherever records would pad; inf, and the default here, lay records (the next test: the choice)."""
    if slack is not None:
        monkeypatch.setattr(lossless, "INLINE_SLACK", slack)
    weights = special_weights()
    layouts = set()
    for (na, wa), (nb, wb) in zip(weights.items(), list(weights.items())[1:] + list(weights.items())[:1]):
        if wa.shape[0] != wb.shape[0]:
            continue
        a, b = encode(wa), encode(wb)
        pair = lossless.layer_major(a, b)
        (off_a, Ra), (off_b, Rb) = lossless.row_layout(a), lossless.row_layout(b)
        inline = lossless._arena(a, b)[0] is not None
        layouts.add(inline)
        stride = pair.rows.stride(0)
        assert pair.rows.shape == (wa.shape[0], Ra + Rb) and pair.rows.stride(1) == 1, (na, nb)
        assert (stride % 64 == 0 and stride >= Ra + Rb) if inline else stride == Ra + Rb, (na, nb)
        assert pair.words.numel() * 4 == lossless.layer_major_nbytes(a, b), (na, nb)
        assert _bits(pair.a.decode()).equal(_bits(wa)) and _bits(pair.b.decode()).equal(_bits(wb)), (na, nb)
        assert pair.a.nbytes == a.nbytes and pair.b.nbytes == b.nbytes
        for mine, theirs in ((pair.a.compact(), a), (pair.b.compact(), b)):
            assert all(x.equal(y) for x, y in zip(mine.tensors(), theirs.tensors())), (na, nb)
        for e in range(wa.shape[0]):
            row = pair.rows[e]
            for mine, theirs, at in zip(pair.a.tensors()[:4], a.tensors()[:4], off_a):
                assert mine[e].data_ptr() == row.data_ptr() + at and mine[e].equal(theirs[e]), (na, e)
            for mine, theirs, at in zip(pair.b.tensors()[:4], b.tensors()[:4], off_b):
                assert mine[e].data_ptr() == row.data_ptr() + Ra + at and mine[e].equal(theirs[e]), (nb, e)
            with _Copies() as copies:
                staged = lossless.stage_pair(pair, e, "cpu")
            runs = [a.expert_escapes(e), b.expert_escapes(e)]
            assert copies.n == (1 if inline else 1 + sum(r.numel() > 0 for r in runs)), (na, nb, e)
            assert staged.numel() == pair.staged_nbytes(e) and staged.equal(torch.cat([row] + runs)), (na, nb, e)
            if inline:
                assert pair.a.expert_escapes(e).data_ptr() == row.data_ptr() + Ra + Rb, (na, nb, e)
    assert (False in layouts) if slack == 0 else layouts == {True}, layouts  # these weights pad little
    with pytest.raises(ConfigError, match="experts"):
        lossless.layer_major(encode(weights["normal*1"]), encode(weights["one expert, all zero"]))


def test_records_are_inline_unless_one_expert_would_pad_them_all():
    """Trained-like experts escape alike, so padding each record to the longest costs a fraction of a
    percent: laid out inline. One expert escaping far more than the rest would pad every record to its
    run: its layer keeps the runs after the rows, within INLINE_SLACK of the compact bytes either way."""
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(8, 64, 96, generator=g) * 0.02).bfloat16()
    a = encode(w, 3)
    compact = 8 * (2 * lossless.row_layout(a)[1]) + 2 * a._starts[-1]
    assert lossless._arena(a, a)[0] is not None
    assert compact <= lossless.layer_major_nbytes(a, a) <= compact * (1 + lossless.INLINE_SLACK)
    odd = w.clone()
    odd[3].view(-1)[::2] = torch.logspace(-30, 30, odd[3].numel() // 2).bfloat16()  # many exponents: escapes
    o = encode(odd, 3)
    assert o.expert_escapes(3).numel() > 8 * max(o.expert_escapes(e).numel() for e in range(8) if e != 3)
    assert lossless._arena(o, o)[0] is None
    assert lossless.layer_major_nbytes(o, o) == 8 * (2 * lossless.row_layout(o)[1]) + 2 * o._starts[-1]
    assert _bits(lossless.layer_major(o, o).a.decode()).equal(_bits(odd))


def test_encoding_in_chunks_gives_the_same_tensors(monkeypatch):
    """encode works CHUNK elements at a time (bounded temporaries on real experts): chunks that cut
    through blocks' escape counts and a partial last chunk give the tensors of one chunk, and
    esc_off counts each block's escapes."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(2, 97, 131, generator=g) * 0.02).bfloat16()           # 12707 elements: 13 blocks
    w.view(-1)[::37] = 1e30
    whole = encode(w, 2)
    monkeypatch.setattr(lossless, "CHUNK", 2 * lossless.BLOCK)
    chunked = encode(w, 2)
    for a, b in zip(whole.tensors(), chunked.tensors()):
        assert a.equal(b)
    codes = torch.stack([lossless.codes_of(chunked, e) for e in range(2)])
    flags = torch.nn.functional.pad(codes == 3, (0, -codes.shape[1] % lossless.BLOCK)).view(2, -1, lossless.BLOCK)
    per_block = flags.sum(-1)
    assert chunked.esc_off.long().equal(per_block.cumsum(1) - per_block)
    assert _bits(chunked.decode()).equal(_bits(w))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes_are_refused(dtype):
    with pytest.raises(ConfigError, match="bf16"):
        encode(torch.zeros(2, 4, 32, dtype=dtype))


def test_an_expert_is_indexed_from_the_end_as_a_tensor_is():
    """A negative index read the escape run as empty: expert -1's escapes dropped, its bytes undercounted."""
    from specter.offload.coded import CodedTensor

    torch.manual_seed(0)
    w = (torch.randn(4, 8, 32) * 0.02).bfloat16()
    w[-1, 0, 0], w[-1, 1, 1] = 1e30, -1e-30  # escapes (at width 2) in the last expert only
    packed, out = encode(w, bits=2), torch.empty(8, 32, dtype=torch.bfloat16)
    assert packed.expert_escapes(-1).numel() > 0
    for e in (-1, 3):
        assert packed.expert_nbytes(e) == packed.expert_nbytes(3)
        assert torch.equal(packed.decode_into(out, e).view(torch.int16), w[3].view(torch.int16))
        assert torch.equal(CodedTensor(packed)[e].decode_into(out).view(torch.int16), w[3].view(torch.int16))
    for e in (4, -5):
        with pytest.raises(IndexError):
            packed.expert_nbytes(e)


def test_bad_shapes_and_outputs_are_refused():
    with pytest.raises(ConfigError, match=r"\[E, N, K\]"):
        encode(torch.zeros(4, 32, dtype=torch.bfloat16))
    packed = encode(torch.zeros(2, 4, 32, dtype=torch.bfloat16))
    with pytest.raises(ConfigError, match="contiguous bf16"):
        packed.decode_into(torch.empty(4, 32, dtype=torch.float32), 0)
    with pytest.raises(ConfigError, match="on meta"):
        packed.decode_into(torch.empty(4, 32, dtype=torch.bfloat16, device="meta"), 0)
    for bits in (5, 0):  # 0 is no width (it chose one)
        with pytest.raises(ConfigError, match="width"):
            encode(torch.zeros(2, 4, 32, dtype=torch.bfloat16), bits=bits)
    for shape in ((0, 4, 32), (2, 0, 32)):  # (a RuntimeError from deep inside)
        with pytest.raises(ConfigError, match="none of them 0"):
            encode(torch.zeros(shape, dtype=torch.bfloat16))
    with pytest.raises(ConfigError):
        LosslessExperts((2, 4, 32), *packed.tensors()[:-1], packed.esc_start[:2])
    em = lossless.layer_major(packed, packed).a
    staged = lossless.stage(em, 0, "cpu")
    for out in (torch.empty(4, 32), torch.empty(32, 4, dtype=torch.bfloat16).t(), torch.empty(4, 16, dtype=torch.bfloat16)):
        with pytest.raises(ConfigError, match="contiguous bf16"):  # fp32, strided, short: int16 views would lie
            lossless.decode_staged(em, staged, out)


def test_the_kernel_without_a_gpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    packed = encode(torch.zeros(1, 4, 32, dtype=torch.bfloat16))
    with pytest.raises(ConfigError, match="TRITON_INTERPRET"):
        lossless.decode_triton(packed, 0, torch.empty(4, 32, dtype=torch.bfloat16))


# ---------------------------------------------------------------------- the kernel, interpreted
def test_decode_kernel_under_the_triton_interpreter():
    """lossless_interpreted.py in a fresh process with TRITON_INTERPRET=1 from the start."""
    path = Path(__file__).with_name("lossless_interpreted.py")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
                       env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]


# ------------------------------------------------------------------------- the kernel, compiled
@pytest.fixture(scope="module")
def decode_reports():
    pytest.importorskip("triton.backends.nvidia", reason="needs a Triton wheel with its NVIDIA backend")
    from specter.triton_ops import aot
    launches = aot.lossless_launches()
    return [(launch, aot.inspect(launch, cc)) for launch in launches for cc in aot.TARGETS]


def test_decode_kernel_compiles_for_every_target_without_spills(decode_reports):
    from specter.triton_ops import aot
    assert {r.cc for _, r in decode_reports} == set(aot.TARGETS)
    kinds = {launch.kernel.fn.__name__ for launch, _ in decode_reports}
    assert kinds == {"_decode_kernel", "_decode_pair_kernel", "_decode_pairs_kernel"}, kinds
    for side in ("BITS", "A_BITS", "B_BITS"):  # every width, alone and on each side of a pair
        assert {launch.kwargs[side] for launch, _ in decode_reports if side in launch.kwargs} == set(lossless.WIDTHS)
    for launch, r in decode_reports:
        spill = BATCH_SPILL if launch.kernel.fn.__name__ == "_decode_pairs_kernel" else 0
        assert r.spill_bytes <= spill and r.registers <= 255, (r.cc, launch.kwargs, r.registers, r.spill_bytes)
        assert r.shared_bytes <= aot.SHARED_LIMIT[r.cc]


# The batch kernel holds its expert's address, loaded from the job table, where the single kernels read a
# parameter: Triton 3.6's ptxas (the GPU image's) then keeps 56-72 registers and spills one 4-byte word
# (a store and a load, L1-resident) in 3 of its 36 specializations; Triton 3.9's in none. No more than that.
BATCH_SPILL = 8


def test_decode_kernel_reads_words_never_bytes(decode_reports):
    """The sign/mantissa bytes are read as 16 bytes a thread (one v4 load), the planes, the table and
    the escapes as 32-bit words: no load narrower than a word."""
    for launch, r in decode_reports:
        assert r.byte_loads == 0, (r.cc, r.loads)
        widths = {int(re.search(r"(\d+)$", kind).group(1)) for kind in r.loads if kind.startswith("ld")}
        assert min(widths) >= 32, (r.cc, r.loads)
        assert r.loads.get("ld.v4.b32", 0) >= 1, (r.cc, launch.kwargs, r.loads)


def test_one_pair_compile_serves_every_expert_of_a_layer():
    """The pair kernel's arguments that vary by expert are not specialized (the table and escape offsets)
    or always specialize alike (the row offset, a multiple of 16 words): Triton's own binder gives every
    expert of a layer one compile, staged and in place, so the one warm_decode makes at load is the one
    the copies use (an expert whose offsets specialized otherwise would compile on the copy thread)."""
    pytest.importorskip("triton.backends.nvidia", reason="needs a Triton wheel with its NVIDIA backend")
    from specter.triton_ops import aot
    g = torch.Generator().manual_seed(0)
    w13, w2 = ((torch.randn(16, n, k, generator=g) * 0.02).bfloat16() for n, k in ((48, 32), (32, 24)))
    w13.view(16, -1)[::3, ::7] = 1e30                                  # escape runs of several lengths
    pair = lossless.layer_major(encode(w13), encode(w2)).with_tables("cpu")
    slots = torch.empty(48, 32, dtype=torch.bfloat16), torch.empty(32, 24, dtype=torch.bfloat16)
    for in_place in (False, True):
        pair.in_place = in_place
        with aot.recording(lossless, ("_decode_pair_kernel",)) as log:
            for e in range(16):
                pair.decode_into(e, *slots)
        assert len(log) == 16 and len({str(aot._key(launch, 90)) for launch in log}) == 1, in_place


# ------------------------------------------------------------------------------ on a GPU (compiled)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits", [None, 2, 3, 4])
def test_compiled_decode_on_cuda(bits):
    """The compiled kernel, every special case, encoded on the GPU and on the host: bit exact."""
    for name, w in special_weights().items():
        for packed in (encode(w.cuda(), bits), encode(w, bits).to("cuda")):
            slot = torch.full(w.shape[1:], float("nan"), dtype=torch.bfloat16, device="cuda")
            for e in range(w.shape[0]):
                assert _bits(packed.decode_into(slot, e)).cpu().equal(_bits(w[e])), (name, e, packed.bits)
            assert _bits(packed.decode()).cpu().equal(_bits(w)), name



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("in_place", [False, True], ids=["staged", "in-place"])
def test_compiled_pair_decode_on_cuda(in_place):
    """The pair kernel compiled (a CUDA store's copy: stage_pair from the host then one launch, or one
    launch reading the page-locked arena in place), every special case beside a normal tensor of the
    same experts, at each pair of widths: bit exact."""
    from specter.offload.store import page_aligned, register

    g = torch.Generator().manual_seed(1)
    for name, w in special_weights().items():
        other = (torch.randn(w.shape[0], 24, 40, generator=g) * 0.02).bfloat16()
        for ba, bb in zip(lossless.WIDTHS, lossless.WIDTHS[1:] + lossless.WIDTHS[:1]):
            a, b = encode(w, ba), encode(other, bb)
            arena = page_aligned(lossless.layer_major_nbytes(a, b), torch.uint8)
            assert register(arena) is None
            pair = lossless.layer_major(a, b, arena).with_tables("cuda")
            pair.in_place = in_place
            for e in range(w.shape[0]):
                out_a = torch.full(w.shape[1:], float("nan"), dtype=torch.bfloat16, device="cuda")
                out_b = torch.full(other.shape[1:], float("nan"), dtype=torch.bfloat16, device="cuda")
                pair.decode_into(e, out_a, out_b)
                assert _bits(out_a).cpu().equal(_bits(w[e])) and _bits(out_b).cpu().equal(_bits(other[e])), (name, e)
            torch.cuda.synchronize()  # the arena is read until the kernels end


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_batch_decode_on_cuda():
    """The batch kernel compiled (a CUDA tier's hits of one layer call: decode_staged_pairs), every
    special case's experts, twice each in a shuffled order, from buffers staged on the device into rows
    of two slot pools: one launch, bit exact."""
    g = torch.Generator().manual_seed(2)
    for name, w in special_weights().items():
        E, other = w.shape[0], (torch.randn(w.shape[0], 24, 40, generator=g) * 0.02).bfloat16()
        pair = lossless.layer_major(encode(w), encode(other))
        pools = [torch.full((2 * E, *t.shape[1:]), float("nan"), dtype=torch.bfloat16, device="cuda")
                 for t in (w, other)]
        order = torch.randperm(2 * E, generator=g).tolist()
        lossless.decode_staged_pairs(pair, [(i % E, lossless.stage_pair(pair, i % E, "cuda"), pools[0][i], pools[1][i])
                                            for i in order])
        for i in range(2 * E):
            assert _bits(pools[0][i]).cpu().equal(_bits(w[i % E])), (name, i)
            assert _bits(pools[1][i]).cpu().equal(_bits(other[i % E])), (name, i)
