"""specter.triton_ops: INT4 packing against quanto, the grouped MoE against the per-expert loop."""
from __future__ import annotations

import inspect
import warnings

import pytest
import torch

from specter.errors import ConfigError
from specter.triton_ops import (Int4Experts, QuantExperts, combine_rows, expert_rows, fused_moe, merge_rows,
                                pack_experts, pack_int4, packed_nbytes, quantize_int4)
from specter.triton_ops.align import BLOCK_M, align_rows, max_blocks


# quanto registers its own CPU `unpack` from Python where it loads its extensions (on CUDA machines):
# replacing it needs allow_override (its default is False in torch 2.11, True in 2.13)
OVERRIDE = {"allow_override": True} if "allow_override" in inspect.signature(torch.library.Library.impl).parameters else {}


@pytest.fixture(scope="module", autouse=True)
def quanto_in_python():
    """quanto's dequantization, the reference here, without the C++ extension quanto compiles on
    first use for its CPU `unpack` (a minute of CI for one op): the op on CPU runs the same
    nibble unpacking in torch (quanto's own default kernel's algorithm: value i of a byte is
    bits 4i .. 4i+3, values concatenated along the first axis)."""
    pytest.importorskip("optimum.quanto")
    import optimum.quanto  # noqa: F401  (registers quanto::unpack and its C++ CPU kernel)

    def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
        per_byte = 8 // bits
        mask = 2 ** bits - 1
        return torch.cat([(packed >> (bits * i)) & mask for i in range(per_byte)]).to(torch.uint8)

    lib = torch.library.Library("quanto", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Oo]verrid")  # replacing quanto's CPU kernel is the point
        lib.impl("unpack", unpack, "CPU", **OVERRIDE)
    yield
    lib._destroy()


def _weights(E=3, N=48, K=256, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, N, K, generator=g) * 0.05
    w[0, 0, :64] = 0.0       # a constant group (scale 0)
    w[1, 2, 128:] = 0.25     # another, not at zero
    return w.to(dtype)


# ------------------------------------------------------------------------------------ INT4 packing
@pytest.mark.parametrize("K,group_size", [(256, 128), (96, 128), (64, 32)])
def test_int4_dequantize_equals_quanto_bit_for_bit(K, group_size):
    w = _weights(K=K)
    packed = pack_int4(w, group_size)
    ref = torch.stack([quantize_int4(w[e], group_size).dequantize() for e in range(w.shape[0])])
    assert packed.dtype == torch.float32 and packed.shape == tuple(w.shape)
    assert torch.equal(packed.dequantize(), ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_scales_follow_the_compute_dtype(dtype):
    """Quantized in fp32 either way; scales in the compute dtype, dequantized as quanto does it."""
    from optimum.quanto import qint4
    from optimum.quanto.tensor.weights.qbits import WeightQBitsTensor

    w = _weights(dtype=dtype)
    packed = pack_int4(w)
    assert packed.scale.dtype == packed.shift.dtype == dtype and packed.dequantize().dtype == dtype
    for e in range(w.shape[0]):
        q = quantize_int4(w[e])
        ref = WeightQBitsTensor(qint4, 0, q._group_size, q.size(), q.stride(), q._data.unpack(),
                                q._scale.to(dtype), q._shift.to(dtype)).dequantize()
        assert torch.equal(packed.dequantize()[e], ref)


def test_int4_layout_is_plain_tensors_and_round_trips():
    w = _weights()
    packed = pack_int4(w, 64)
    assert packed.qweight.shape == (3, 48, 32) and packed.qweight.dtype == torch.int32
    assert packed.scale.shape == packed.shift.shape == (3, 4, 48) and packed.group_size == 64
    # the documented order: code k = 8j + i in bits 4i .. 4i+3 of word j
    codes = packed.codes()
    words = sum(codes[..., i::8].to(torch.int64) << (4 * i) for i in range(8))  # [E, N, K // 8] as unsigned
    assert torch.equal(packed.qweight, (words - (words >= 2**31).long() * 2**32).to(torch.int32))
    assert codes.max() <= 15
    # group-major scales: scale[e, g, n] serves row n, columns g * 64 .. g * 64 + 63
    dq = packed.dequantize()
    assert torch.equal(dq[1, 5, 64:128], packed.scale[1, 1, 5] * codes[1, 5, 64:128].float() - packed.shift[1, 1, 5])
    again = Int4Experts(**packed.tensors())
    assert torch.equal(again.dequantize(), packed.dequantize())
    assert torch.equal(packed[1].dequantize(), packed.dequantize()[1:2])
    assert packed.to(dtype=torch.float16).dequantize().dtype == torch.float16
    assert packed.expert_nbytes() == 48 * 128 + 2 * 48 * 4 * 4  # bytes: K / 2 a row, fp32 scales


def test_int4_chunking_does_not_change_the_result():
    w = _weights(E=5)
    assert torch.equal(pack_int4(w, chunk_bytes=1).qweight, pack_int4(w).qweight)


def test_int4_bad_input_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"\[E, N, K\]"):
        pack_int4(torch.randn(4, 8))
    with pytest.raises(ConfigError, match="divisible by 8"):
        pack_int4(torch.randn(2, 4, 12))
    packed = pack_int4(_weights())
    with pytest.raises(ConfigError, match="int32"):
        Int4Experts(packed.qweight.view(torch.uint8), packed.scale, packed.shift)  # the old byte layout
    with pytest.raises(ConfigError, match="scale and .shift"):
        Int4Experts(packed.qweight, packed.scale, packed.shift[:, :1])
    with pytest.raises(ConfigError, match="scale and .shift"):  # [E, N, G]: not group-major
        Int4Experts(packed.qweight, packed.scale.transpose(1, 2), packed.shift.transpose(1, 2))


# ------------------------------------------------------------------------- 2- and 3-bit packing
def _correctly_rounded_scale(groups, bits):
    """(max - min) / (2^bits - 1), correctly rounded to fp32 (fp64 holds the quotient exactly enough)."""
    span = groups.amax(1, keepdim=True).double() - groups.amin(1, keepdim=True).double()
    return (span.float().double() / (2 ** bits - 1)).float()


@pytest.mark.parametrize("bits", [4, 2])
def test_torch_affine_quantizer_is_quantos_op_for_op(bits):
    """The 3-bit quantizer is quanto's scheme written in torch: at the widths quanto has, it gives
    quanto's scales, shifts and codes bit for bit (constant groups, scale 0, included)."""
    from optimum.quanto import MaxOptimizer, qint2, qint4

    from specter.triton_ops.int4 import affine_params, affine_quantize
    groups = _weights(E=2, N=16, K=128).reshape(-1, 32)
    s, z = affine_params(groups, bits)
    qs, qz = MaxOptimizer().optimize(groups, {4: qint4, 2: qint2}[bits], axis=0)
    assert torch.equal(s, qs) and torch.equal(z, qz)
    assert torch.equal(s, _correctly_rounded_scale(groups, bits))
    q = torch.ops.quanto.quantize_affine(groups, bits=bits, axis=0, group_size=32, scale=qs, shift=qz)
    assert torch.equal(affine_quantize(groups, bits, s, z), q)


def test_2bit_dequantize_equals_quanto_qint2_bit_for_bit():
    w = _weights(K=256)
    packed = pack_experts(w, 2, 64)
    ref = torch.stack([quantize_int4(w[e], 64, bits=2).dequantize() for e in range(w.shape[0])])
    assert packed.bits == 2 and packed.shape == tuple(w.shape) and packed.codes().max() <= 3
    assert torch.equal(packed.dequantize(), ref)


def test_3bit_values_are_the_affine_scheme_per_group():
    """Every group: scale (max - min) / 7, shift -min, codes round((w + shift) / scale) in 0..7,
    computed here one group at a time in float64 (then rounded to fp32 as the packer's fp32 ops)."""
    w = _weights(E=2, N=8, K=128)
    packed = pack_experts(w, 3, 32)
    codes, dq = packed.codes(), packed.dequantize()
    for e, n, g in [(0, 0, 0), (0, 0, 1), (1, 2, 3), (1, 7, 2), (0, 5, 2)]:
        grp = w[e, n, 32 * g:32 * g + 32]
        lo, hi = grp.min(), grp.max()
        scale, shift = (hi - lo) / 7, -lo
        assert packed.scale[e, g, n] == scale and packed.shift[e, g, n] == shift
        want = torch.clamp(torch.round((grp + shift) / scale), 0, 7) if scale > 0 else torch.zeros(32)
        if scale > 0:
            assert torch.equal(codes[e, n, 32 * g:32 * g + 32].float(), want)
            assert torch.equal(dq[e, n, 32 * g:32 * g + 32], scale * want - shift)
    err = (dq - w).abs().reshape(2, 8, 4, 32).amax(-1)
    assert (err <= packed.scale.transpose(1, 2) / 2 * 1.0001 + 1e-7).all()  # within half a step everywhere


@pytest.mark.parametrize("bits", [3, 2])
def test_low_bit_layout_is_the_documented_one(bits):
    """2 bits: code 16j + i in bits 2i of word j. 3 bits: the low two bits so, in the first K / 16
    words; bit 2 of code 32j + i is bit i of word K / 16 + j. Round trips through plain tensors."""
    w = _weights()
    packed = pack_experts(w, bits, 64)
    K = 256
    assert packed.qweight.shape == (3, 48, K * bits // 32) and packed.group_size == 64
    codes = packed.codes().to(torch.int64)
    as_words = lambda v, per, width: sum(v[..., i::per] << (width * i) for i in range(per))  # noqa: E731
    signed = lambda x: (x - (x >= 2**31).long() * 2**32).to(torch.int32)  # noqa: E731
    want = as_words(codes & 3, 16, 2)
    if bits == 3:
        want = torch.cat([want, as_words(codes >> 2, 32, 1)], dim=2)
    assert torch.equal(packed.qweight, signed(want))
    again = QuantExperts(**packed.tensors(), bits=bits)
    assert torch.equal(again.dequantize(), packed.dequantize())
    assert torch.equal(QuantExperts.for_k(*packed.tensors().values(), K).dequantize(), packed.dequantize())
    assert torch.equal(packed[1].dequantize(), packed.dequantize()[1:2]) and packed[1].bits == bits
    assert packed.to(dtype=torch.float16).bits == bits
    assert packed.expert_nbytes() == packed_nbytes(48, K, bits, 64, scale_bytes=4)
    assert torch.equal(pack_experts(w, bits, 64, chunk_bytes=1).qweight, packed.qweight)


def test_fewer_bits_cost_accuracy_in_order():
    w = _weights(K=256)
    err = {b: (pack_experts(w, b).dequantize() - w).pow(2).mean().item() for b in (4, 3, 2)}
    assert err[4] < err[3] < err[2]


def test_low_bit_bad_input_is_a_clear_error():
    with pytest.raises(ConfigError, match="divisible by 32"):
        pack_experts(torch.randn(2, 4, 48), 3)
    with pytest.raises(ConfigError, match="divisible by 16"):
        pack_experts(torch.randn(2, 4, 24), 2)
    with pytest.raises(ConfigError, match="one of 4, 3, 2"):
        pack_experts(torch.randn(2, 4, 64), 5)
    packed = pack_experts(_weights(), 3)
    with pytest.raises(ConfigError, match="no whole row"):
        QuantExperts(packed.qweight[..., :5], packed.scale, packed.shift, 3)


def test_draft_expert_nbytes_is_what_the_packer_makes():
    """The planner's figure (speculative.draft_cache.draft_expert_nbytes) against real packed experts
    of a spec's shapes, fp32 scales (4 bytes) as a CPU draft keeps them, and bf16 on the device."""
    from types import SimpleNamespace

    from specter.speculative.draft_cache import draft_expert_nbytes
    spec = SimpleNamespace(hidden=256, expert_inter=192)
    for bits in (4, 3, 2):
        q13 = pack_experts(torch.randn(1, 384, 256), bits, dtype=torch.float32)
        q2 = pack_experts(torch.randn(1, 256, 192), bits, dtype=torch.float32)
        assert draft_expert_nbytes(spec, bits, scale_bytes=4) == q13.expert_nbytes() + q2.expert_nbytes()
        assert draft_expert_nbytes(spec, bits) == q13.to(dtype=torch.bfloat16).expert_nbytes() + \
            q2.to(dtype=torch.bfloat16).expert_nbytes()
    assert draft_expert_nbytes(spec, 2) < draft_expert_nbytes(spec, 3) < draft_expert_nbytes(spec, 4)


# --------------------------------------------------------------------------------- the packed draft
def draft_pair(device: str, dtype: torch.dtype):
    """A packed and an unpacked DraftExperts over the same random layer (4 experts, H 64, I 32,
    top-2), and one routed batch of 5 tokens for them: (packed, plain, (x, ids, w))."""
    from specter.moe import ExpertWeights
    from specter.speculative.draft import DraftExperts
    from specter.speculative.draft import Lookahead

    E, H, I, T, k = 4, 64, 32, 5, 2
    g = torch.Generator().manual_seed(1)
    experts = [ExpertWeights(torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1)]
    look = Lookahead(4, 1, k, device)
    packed = DraftExperts(experts, look, device, dtype, packed=True)
    plain = DraftExperts(experts, look, device, dtype, packed=False)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 1], [0, 3]], device=device)
    w = torch.rand(T, k, generator=g).to(device, dtype)
    return packed, plain, (x, ids, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_packed_cpu_draft_is_the_dense_draft(dtype):
    """The packed draft on CPU (what a big checkpoint's draft is) keeps fp32 scales and dequantizes
    each expert it runs as the unpacked draft did once: the very same outputs, in every dtype."""
    packed, plain, (x, ids, w) = draft_pair("cpu", dtype)
    assert packed.layers == [] and packed.q13[0].qweight.dtype == torch.int32
    assert packed.q13[0].dtype == torch.float32 and plain.layers[0].w13.dtype == dtype
    y = packed(0, x, ids, w)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, plain(0, x, ids, w))


def test_draft_stays_packed_when_dense_would_be_large(monkeypatch):
    from specter.speculative import draft

    assert draft.keep_packed("cuda", 10, torch.bfloat16)  # CUDA: always (the kernels dequantize)
    assert not draft.keep_packed("cpu", draft.DENSE_MAX_BYTES // 4, torch.float32)
    assert draft.keep_packed("cpu", draft.DENSE_MAX_BYTES // 4 + 1, torch.float32)


# ------------------------------------------------------------------------------ fused_moe (torch)
def moe_case(T, k, E=6, H=32, I=32, R=None, dtype=torch.float32, int4=False, seed=0):
    """x, ids, weights, w13, w2 and a remap over R < E rows when R is given. Token 0 routes to expert
    0 at every position it can, every token uses expert 1 (position 0), experts E-1, E-2 are unused."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    if dtype == torch.float16:
        x = x * 0.5
    scores = torch.rand(T, E - 2, generator=g)
    scores[:, 1] = 2.0  # every token uses expert 1
    ids = scores.topk(k, dim=1).indices
    weights = torch.rand(T, k, generator=g).to(dtype)
    rows = R or E
    w13 = torch.randn(rows, 2 * I, H, generator=g) * 0.2
    w2 = torch.randn(rows, H, I, generator=g) * 0.2
    if int4:  # True: 4 bits; or the width (4, 3, 2)
        bits = 4 if int4 is True else int4
        w13, w2 = pack_experts(w13, bits, 16, dtype=dtype), pack_experts(w2, bits, 16, dtype=dtype)
    else:
        w13, w2 = w13.to(dtype), w2.to(dtype)
    remap = None
    if R is not None:  # experts 0 and 3 not resident; the others in scrambled rows
        perm = torch.randperm(R, generator=g).tolist()
        remap = torch.full((E,), -1, dtype=torch.int32)
        for e in [e for e in range(E) if e not in (0, 3)][:R]:
            remap[e] = perm.pop()
    return x, ids, weights, w13, w2, remap


def naive_rows(x, ids, weights, w13, w2, remap=None):
    """[T, k, H] fp64, one (token, position) at a time; zero where the expert maps to -1."""
    dense = lambda w: (w.dequantize() if isinstance(w, Int4Experts) else w).double()
    w13, w2, x = dense(w13), dense(w2), x.double()
    y = x.new_zeros(ids.shape[0], ids.shape[1], x.shape[1])
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            r = int(ids[t, j]) if remap is None else int(remap[ids[t, j]])
            if r >= 0:
                gate, up = (w13[r] @ x[t]).chunk(2)
                y[t, j] = float(weights[t, j]) * (w2[r] @ (torch.nn.functional.silu(gate) * up))
    return y


def naive_moe(x, ids, weights, w13, w2, remap=None):
    """fp64, positions summed: naive_rows' [T, H]."""
    return naive_rows(x, ids, weights, w13, w2, remap).sum(1)


@pytest.mark.parametrize("T", [1, 5, 33, 65])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("int4", [False, True, 3, 2])
@pytest.mark.parametrize("R", [None, 3])
def test_torch_backend_matches_the_naive_loop(T, k, int4, R):
    x, ids, w, w13, w2, remap = moe_case(T, k, int4=int4, R=R)
    y = fused_moe(x, ids, w, w13, w2, remap=remap, backend="torch")
    torch.testing.assert_close(y.double(), naive_moe(x, ids, w, w13, w2, remap), rtol=1e-5, atol=1e-5)


def test_top8_and_more_experts_than_one_block():
    x, ids, w, w13, w2, _ = moe_case(33, 8, E=12)
    torch.testing.assert_close(fused_moe(x, ids, w, w13, w2).double(), naive_moe(x, ids, w, w13, w2),
                               rtol=1e-5, atol=1e-5)


def test_alignment_groups_rows_by_expert_in_padded_blocks():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    remap = torch.tensor([1, -1, 0], dtype=torch.int32)  # expert 1 not resident
    a = align_rows(ids, 2, remap)
    nb = max_blocks(6, 2)
    assert a.block_expert.tolist() == [0, 1] + [-1] * (nb - 2)   # row 0 = expert 2 (3 rows), row 1 = expert 0
    assert int(a.n_padded) == 2 * BLOCK_M
    slots = a.slot_row.tolist()
    assert slots[:4] == [0, 2, 5, 6] and slots[BLOCK_M:BLOCK_M + 3] == [1, 4, 6]  # stable: token order
    assert a.row_slot.tolist() == [0, BLOCK_M, 1, nb * BLOCK_M, BLOCK_M + 1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("int4", [False, True])
def test_batch_invariance_bit_for_bit(dtype, int4):
    """A token's output is the same bits alone, in a batch of 65, or among other tokens."""
    x, ids, w, w13, w2, _ = moe_case(65, 2, dtype=dtype, int4=int4)
    full = fused_moe(x, ids, w, w13, w2)
    others = moe_case(9, 2, dtype=dtype, seed=5)[0]
    for t in (0, 17, 64):
        assert torch.equal(fused_moe(x[t:t + 1], ids[t:t + 1], w[t:t + 1], w13, w2)[0], full[t])
        mixed = torch.cat((others[:4], x[t:t + 1], others[4:]))
        mids = torch.cat((ids[:4], ids[t:t + 1], ids[4:9]))
        mw = torch.cat((w[:4], w[t:t + 1], w[4:9]))
        assert torch.equal(fused_moe(mixed, mids, mw, w13, w2)[4], full[t])


def _positions_off_alone(threads, int4=False):
    """Token 0 of one batch, alone and then at every position p of a 33-token batch of other tokens
    (new neighbours for each p). Every token uses expert 1, so p is also its place in that expert's
    run of 33 rows. Returns the positions whose output differs from the token's own, bit for bit."""
    x, ids, w, w13, w2, _ = moe_case(33, 2, int4=int4)
    ox, oids, ow = moe_case(64, 2, seed=7)[:3]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = fused_moe(x[:1], ids[:1], w[:1], w13, w2, backend="torch")[0]
        off = []
        for p in range(33):
            pick = torch.arange(p, p + 32)  # other neighbours at every p
            cat = lambda a, b: torch.cat((b[pick[:p]], a[:1], b[pick[p:]]))  # noqa: E731
            y = fused_moe(cat(x, ox), cat(ids, oids), cat(w, ow), w13, w2, backend="torch")
            if not torch.equal(y[p], alone):
                off.append(p)
        return off
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("int4", [False, True])
def test_a_row_has_the_same_bits_at_every_position_of_its_expert_run(threads, int4):
    assert _positions_off_alone(threads, int4) == []


def test_the_position_check_catches_plain_cpu_gemms(monkeypatch):
    """Multiplying each expert's run with one plain matmul (what the per-expert loop did) changes
    the bits with the run's length: the check above must see it."""
    import importlib
    ref = importlib.import_module("specter.triton_ops.fused_moe")  # the module (the package exports a function of that name)
    monkeypatch.setattr(ref, "grouped_linear", lambda a, w, runs: torch.cat(
        [torch.nn.functional.linear(a[s:e], ref._dense(w, r, a.dtype)) for r, s, e in runs]))
    assert len(_positions_off_alone(1)) > 16


def test_silu_mul_rows_do_not_depend_on_the_thread_split():
    """fp32 SiLU differs in the last bit between ATen's vector body and its scalar tail; an
    elementwise op over more than 32768 elements is split between threads anywhere, even within a
    row, so silu_mul works in chunks that stay on one thread."""
    from specter.triton_ops.reference import silu_mul
    h = torch.randn(401, 400, generator=torch.Generator().manual_seed(0)) * 4  # 401 rows, I = 200
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        plain = torch.nn.functional.silu(h[:, :200]) * h[:, 200:]
        ours = silu_mul(h)
        alone = torch.cat([silu_mul(h[r:r + 1]) for r in range(401)])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(ours, alone)
    assert not torch.equal(plain, alone)  # the split this guards against (row 200 is cut in two)


@pytest.mark.parametrize("int4", [False, True, 3, 2])
def test_two_calls_give_the_bits_of_one(int4):
    """Resident experts first, late arrivals second, merged: the very bits of one call over all."""
    x, ids, w, w13, w2, _ = moe_case(33, 2, E=8, int4=int4)
    everything = torch.arange(8, dtype=torch.int32)
    first = torch.where(torch.tensor([1, 0, 1, 1, 0, 1, 0, 1], dtype=torch.bool), everything, -1)
    late = torch.where(first < 0, everything, -1)
    rows = expert_rows(x, ids, w, w13, w2, remap=first)
    assert (rows[first[ids] < 0] == 0).all()  # skipped rows are left (zero) for the caller
    merged = merge_rows(rows, expert_rows(x, ids, w, w13, w2, remap=late), ids, late)
    one = expert_rows(x, ids, w, w13, w2, remap=everything)
    assert torch.equal(merged, one)
    assert torch.equal(combine_rows(merged), fused_moe(x, ids, w, w13, w2))


def test_all_rows_skipped_gives_zeros():
    x, ids, w, w13, w2, _ = moe_case(5, 2)
    nothing = torch.full((6,), -1, dtype=torch.int32)
    assert torch.equal(fused_moe(x, ids, w, w13, w2, remap=nothing), torch.zeros_like(x))


@pytest.mark.parametrize("int4", [False, True])
def test_compiles_fullgraph_through_the_custom_ops(int4):
    x, ids, w, w13, w2, remap = moe_case(5, 2, R=3, int4=int4)

    def layer(x, ids, w, remap):  # exact ops around it: Inductor's tanh is not eager's on every CPU (AVX-512)
        return torch.relu(fused_moe(x * 2, ids, w, w13, w2, remap=remap)) * 4 + 1

    compiled = torch.compile(layer, fullgraph=True)
    assert torch.equal(compiled(x, ids, w, remap), layer(x, ids, w, remap))


def test_fused_moe_bad_input_is_a_clear_error():
    x, ids, w, w13, w2, _ = moe_case(5, 2)
    with pytest.raises(ConfigError, match="backend"):
        fused_moe(x, ids, w, w13, w2, backend="cuda")
    with pytest.raises(ConfigError, match="do not fit"):
        fused_moe(x[:, :16], ids, w, w13, w2)
    with pytest.raises(ConfigError, match=r"\[T=5, k\]"):
        fused_moe(x, ids, w[:, :1], w13, w2)
    with pytest.raises(ConfigError, match="remap"):
        fused_moe(x, ids, w, w13, w2, remap=torch.zeros(6))


# ------------------------------------------------------------------- Triton kernels (interpreter)
def test_kernels_under_the_triton_interpreter():
    """kernels_interpreted.py in a fresh process: TRITON_INTERPRET=1 must be set before anything
    imports triton.language (quanto does), or its library functions stay compiled-only."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).with_name("kernels_interpreted.py")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
                       env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, ids, w, w13, w2, _ = moe_case(2, 1)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET"):
        fused_moe(x, ids, w, w13, w2, backend="triton")


# ------------------------------------------------------------------------------ on a GPU (compiled)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("int4", [False, True, 3, 2])
def test_compiled_kernels_on_cuda(dtype, int4):
    """The kernels compiled for the GPU: as accurate as the torch backend against fp64, skipped rows,
    batch invariance and split calls merging exactly, at the shapes a real layer has (tiles full and
    partial); dense and codes of 4, 3 and 2 bits.

    Accuracy is judged against fp64, not as closeness to the torch backend: at 16 bits the two round
    different intermediates (torch rounds gate, up and silu(gate) * up to the dtype; the kernel keeps
    them in fp32), and at these magnitudes (outputs ~10) that parts them by a few units in the last
    place, ~0.1, failing any fixed atol on the outputs near zero (the first GPU run to reach this test)."""
    for T, k, R in [(1, 2, None), (33, 8, 6), (65, 2, None)]:
        case = moe_case(T, k, E=12, H=256, I=160, R=R, dtype=dtype, int4=int4)
        x, ids, w = (t.cuda() for t in case[:3])
        w13, w2 = (t.to("cuda") for t in case[3:5])
        remap = None if case[5] is None else case[5].cuda()
        rows = expert_rows(x, ids, w, w13, w2, remap=remap)  # triton: the CUDA default
        ref = expert_rows(x, ids, w, w13, w2, remap=remap, backend="torch")
        exact = naive_rows(x, ids, w, w13, w2, remap)  # fp64, the same (dequantized) weights
        scale = float(exact.abs().max())
        err = lambda a: float((a.double() - exact).abs().max()) / scale  # noqa: E731
        assert not rows[(exact == 0).all(-1)].any()  # the skipped (token, position) rows are zero
        assert err(rows) <= 2 * err(ref) + torch.finfo(dtype).eps, (T, k, err(rows), err(ref))
        full = fused_moe(x, ids, w, w13, w2, remap=remap)
        assert torch.equal(fused_moe(x[-1:], ids[-1:], w[-1:], w13, w2, remap=remap)[0], full[-1])
    everything = torch.arange(12, dtype=torch.int32, device="cuda")
    first = torch.where(everything % 2 == 0, everything, -1)
    late = torch.where(first < 0, everything, -1)
    merged = merge_rows(expert_rows(x, ids, w, w13, w2, remap=first), expert_rows(x, ids, w, w13, w2, remap=late),
                        ids, late)
    assert torch.equal(combine_rows(merged), fused_moe(x, ids, w, w13, w2, remap=everything))


@cuda
def test_alignment_kernel_on_cuda_equals_the_torch_alignment():
    """The one-launch alignment compiled for the GPU (its barrier between padding and scatter is a
    no-op under the interpreter), against align_rows, with and without skipped experts."""
    from specter.triton_ops.kernels import align_rows_triton
    g = torch.Generator().manual_seed(4)
    for T, k, E in [(1, 8, 128), (33, 8, 128), (65, 2, 16), (128, 8, 64)]:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).cuda()
        remap = torch.randperm(E, generator=g).int()
        remap[torch.rand(E, generator=g) < 0.3] = -1
        for rm in (None, remap.cuda()):
            got, want = align_rows_triton(ids, E, rm), align_rows(ids, E, rm)
            assert all(torch.equal(a, b) for a, b in zip(got, want))


@cuda
@pytest.mark.parametrize("bits", [4, 3, 2])
def test_packing_on_cuda_equals_packing_on_cpu(bits):
    w = _weights(E=4, N=64, K=512, dtype=torch.bfloat16)
    on_gpu, on_cpu = pack_experts(w.cuda(), bits), pack_experts(w, bits)
    assert on_gpu.device.type == "cuda"
    from specter.triton_ops.int4 import affine_params
    groups = w.float().reshape(-1, 128).cuda()
    assert torch.equal(affine_params(groups, bits)[0].cpu(), _correctly_rounded_scale(groups.cpu(), bits))
    assert torch.equal(on_gpu.qweight.cpu(), on_cpu.qweight) and torch.equal(on_gpu.scale.cpu(), on_cpu.scale)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_cuda_draft_runs_in_the_compute_dtype(dtype):
    """On CUDA the packed draft's scales follow the compute dtype (the kernels multiply in it), and
    it computes what the unpacked draft computes up to that rounding."""
    packed, plain, (x, ids, w) = draft_pair("cuda", dtype)
    assert packed.q13[0].dtype == dtype
    torch.testing.assert_close(packed(0, x, ids, w), plain(0, x, ids, w), rtol=0.05, atol=0.02)


def test_cpu_upcast_and_dequant_at_use_are_exact_in_and_out_of_inference_mode():
    """A bf16 pool (a big checkpoint's on CPU) and a packed draft convert each expert into a reused
    buffer as it runs: the same rows as fp32 weights / the dequantised draft, whichever mode ran first."""
    g = torch.Generator().manual_seed(3)
    E, H, I, T, k = 4, 64, 32, 3, 2
    w13, w2 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).bfloat16(), (torch.randn(E, H, I, generator=g) * 0.1).bfloat16()
    x, w = torch.randn(T, H, generator=g), torch.rand(T, k, generator=g)
    ids = torch.tensor([[0, 1], [2, 1], [3, 0]])
    q13, q2 = pack_int4(w13, dtype=torch.float32), pack_int4(w2, dtype=torch.float32)
    want = fused_moe(x, ids, w, w13.float(), w2.float())
    want_q = fused_moe(x, ids, w, q13.dequantize(), q2.dequantize())
    with torch.inference_mode():
        assert torch.equal(fused_moe(x, ids, w, w13, w2), want)
        assert torch.equal(fused_moe(x, ids, w, q13, q2), want_q)
    assert torch.equal(fused_moe(x, ids, w, w13, w2), want)
    assert torch.equal(fused_moe(x, ids, w, q13, q2), want_q)
