"""The lossless decode kernel under TRITON_INTERPRET=1, against the torch decode. Run through
test_lossless.py::test_decode_kernel_under_the_triton_interpreter, which starts a process with the
variable set before triton is imported; collected on its own it skips without it.
"""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 from process start", allow_module_level=True)

from specter.triton_ops import lossless  # noqa: E402
from test_lossless import _bits, special_weights  # noqa: E402


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_kernel_decodes_every_case_bit_exact(bits):
    """Every special case (escapes everywhere, odd numel, a partial last block, no escapes at all),
    one launch per expert into a slot filled with garbage first."""
    for name, w in special_weights().items():
        packed = lossless.encode(w, bits)
        for e in range(w.shape[0]):
            slot = torch.full(w.shape[1:], float("nan"), dtype=torch.bfloat16)
            lossless.decode_triton(packed, e, slot)
            ref = lossless.decode_torch(packed, e, torch.empty_like(slot))
            assert _bits(slot).equal(_bits(ref)) and _bits(slot).equal(_bits(w[e])), (name, e, bits)


def test_kernel_decodes_across_blocks_with_escapes_in_several():
    """Several BLOCKs of one expert, escapes in the first, a middle and the last block (the per-block
    escape offsets), through decode_into (the kernel under the interpreter) and through a copy's staged
    bytes (a tensor of a laid-out layer: layer_major, stage, decode_staged)."""
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(2, 40, 96, generator=g) * 0.02).bfloat16()           # 3840 elements: 4 blocks
    flat = w.view(2, -1)
    flat[:, [3, 1500, 2049, 3839]] = torch.tensor([1e30, -1e-30, 3e20, float("inf")]).bfloat16()
    packed = lossless.encode(w, 2)
    assert (packed.esc_off[:, 1:] > packed.esc_off[:, :-1]).all()
    em = lossless.layer_major(packed, packed).b
    out = torch.empty(40, 96, dtype=torch.bfloat16)
    for e in range(2):
        assert _bits(packed.decode_into(out, e)).equal(_bits(w[e]))
        out.fill_(float("nan"))
        assert _bits(lossless.decode_staged(em, lossless.stage(em, e, "cpu"), out)).equal(_bits(w[e]))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_a_staged_copy_decodes_every_case_bit_exact(bits):
    """One tensor's copy from a CUDA store (a laid-out layer's tensor, stage, decode_staged: the path for
    slots of another dtype), the CPU as the device: each expert of every case into a slot filled with
    garbage first."""
    for name, w in special_weights().items():
        em = lossless.layer_major(*(lossless.encode(w, bits),) * 2).a
        for e in range(w.shape[0]):
            slot = torch.full(w.shape[1:], float("nan"), dtype=torch.bfloat16)
            lossless.decode_staged(em, lossless.stage(em, e, "cpu"), slot)
            assert _bits(slot).equal(_bits(w[e])), (name, e, bits)


@pytest.mark.parametrize("slack", [None, 0.0])
def test_a_pair_decodes_every_case_bit_exact(slack, monkeypatch):
    """A layer's two tensors laid out together (layer_major), each expert decoded in one launch from its
    copy (stage_pair, decode_staged_pair) and in place from the arena (decode_pair_in_place, the tables
    on the device), the CPU as the device: every special case against every other (the same expert
    count), at every pair of widths, into slots filled with garbage first. Laid out in records (these
    cases pad little) and, slack 0, with the runs after all rows wherever records would pad."""
    import itertools

    if slack is not None:
        monkeypatch.setattr(lossless, "INLINE_SLACK", slack)

    cases = special_weights()
    for (na, wa), (nb, wb) in itertools.product(cases.items(), cases.items()):
        if wa.shape[0] != wb.shape[0]:
            continue
        for ba, bb in zip(lossless.WIDTHS, lossless.WIDTHS[1:] + lossless.WIDTHS[:1]):
            pair = lossless.layer_major(lossless.encode(wa, ba), lossless.encode(wb, bb)).with_tables("cpu")
            for e, in_place in itertools.product(range(wa.shape[0]), (False, True)):
                out_a = torch.full(wa.shape[1:], float("nan"), dtype=torch.bfloat16)
                out_b = torch.full(wb.shape[1:], float("nan"), dtype=torch.bfloat16)
                pair.in_place = in_place
                pair.decode_into(e, out_a, out_b)
                assert _bits(out_a).equal(_bits(wa[e])) and _bits(out_b).equal(_bits(wb[e])), (na, nb, ba, bb, e, in_place)


def test_a_batch_of_staged_pairs_decodes_in_one_launch_bit_exact(monkeypatch):
    """decode_staged_pairs (a layer's tier hits): every case's experts, in a shuffled order, each from its
    own staged buffer into its slots of a pool (w13 and w2 pools, as the engine's), one launch for them
    all, every slot bit exact; slots off the kernel's 16-byte alignment decode a launch an expert, exact."""
    import itertools

    launches = []
    for name in ("_decode_pair_kernel", "_decode_pairs_kernel"):
        monkeypatch.setattr(lossless, name, _Counted(getattr(lossless, name), name, launches))
    cases = special_weights()
    for (na, wa), (nb, wb) in itertools.product(cases.items(), cases.items()):
        if wa.shape[0] != wb.shape[0] or na > nb:
            continue
        E, (ba, bb) = wa.shape[0], (lossless.WIDTHS[len(na) % 3], lossless.WIDTHS[len(nb) % 3])
        pair = lossless.layer_major(lossless.encode(wa, ba), lossless.encode(wb, bb))
        order = torch.randperm(2 * E, generator=torch.Generator().manual_seed(E)).tolist()
        for skew in (0, 1):  # 1: every w2 slot one element off the w13 slots' alignment
            pool_a = torch.full((2 * E * wa[0].numel(),), float("nan"), dtype=torch.bfloat16)
            pool_b = torch.full((2 * E * wb[0].numel() + skew,), float("nan"), dtype=torch.bfloat16)
            slot_a = [pool_a[i * wa[0].numel():][:wa[0].numel()].view(wa.shape[1:]) for i in range(2 * E)]
            slot_b = [pool_b[skew + i * wb[0].numel():][:wb[0].numel()].view(wb.shape[1:]) for i in range(2 * E)]
            jobs = [(i % E, lossless.stage_pair(pair, i % E, "cpu"), slot_a[i], slot_b[i]) for i in order]
            launches.clear()
            lossless.decode_staged_pairs(pair, jobs)
            want = ["_decode_pair_kernel"] * len(jobs) if skew else ["_decode_pairs_kernel"]
            assert launches == want, (na, nb, skew, launches)
            for i in range(2 * E):
                assert _bits(slot_a[i]).equal(_bits(wa[i % E])) and _bits(slot_b[i]).equal(_bits(wb[i % E])), \
                    (na, nb, ba, bb, skew, i)


def test_cudalink_copies_a_coded_expert_in_one_launch(monkeypatch):
    """CudaLink (on the fake CUDA API of test_link.py, the CPU as the device) copying coded experts of a
    CUDA store (encode_store(cuda=True): each layer laid out together): an expert's w13 and w2 into
    bf16 slots are one launch of the pair kernel (staged, or in place: decode_in_place, the arena taken
    as locked); a coalesced copy of several experts one launch of the batch kernel staged, one an expert
    in place; into fp32 slots (no pair path) each tensor decodes alone and converts exactly. The slots
    hold the weights' bits, and each expert's first source its staged bytes (what a tier keeps)."""
    from specter.offload import coded as coded_mod
    from test_link import FakeCuda

    from specter.moe import ExpertWeights
    from specter.offload.coded import encode_store
    from specter.offload.cuda_link import CudaLink

    g = torch.Generator().manual_seed(3)
    w13, w2 = (torch.randn(3, 40, 96, generator=g) * 0.02).bfloat16(), (torch.randn(3, 96, 20, generator=g) * 0.02).bfloat16()
    w13.view(3, -1)[:, ::97] = 1e30                                      # escapes in every expert's w13
    layer = encode_store([ExpertWeights(w13.clone(), w2.clone())], cuda=True)[0]
    launches = []
    for name in ("_decode_kernel", "_decode_pair_kernel", "_decode_pairs_kernel"):
        kernel = getattr(lossless, name)
        monkeypatch.setattr(lossless, name, _Counted(kernel, name, launches))
    link = CudaLink("cpu", bandwidth=1e9, cuda=FakeCuda(True))
    assert coded_mod.decode_in_place([layer], "cpu") == 0  # not locked: staged copies
    cases = ((torch.bfloat16, [0]), (torch.bfloat16, [1, 2]), (torch.bfloat16, [2, 0, 1]), (torch.float32, [2]))
    with link:
        for dtype, experts in cases + (("in place", [2, 0]),):
            if dtype == "in place":
                monkeypatch.setattr(coded_mod, "is_locked", lambda t: True)
                assert coded_mod.decode_in_place([layer], "cpu") == 1 and layer.w13.pair.in_place
                dtype = torch.bfloat16
            launches.clear()
            slots = [(torch.full(w13.shape[1:], float("nan"), dtype=dtype), torch.full(w2.shape[1:], float("nan"), dtype=dtype))
                     for _ in experts]
            dsts = [t for pair in slots for t in pair]
            srcs = [t for e in experts for t in (layer.w13[e], layer.w2[e])]
            link.copy(dsts, srcs, urgent=True).wait()
            for (s13, s2), e in zip(slots, experts):
                assert s13.equal(w13[e].to(dtype)) and s2.equal(w2[e].to(dtype)), (dtype, e)
            in_place = layer.w13.pair.in_place
            if dtype != torch.bfloat16:
                want = ["_decode_kernel"] * 2
            elif len(experts) == 1 or in_place:
                want = ["_decode_pair_kernel"] * len(experts)
            else:
                want = ["_decode_pairs_kernel"]
            assert launches == want, (dtype, experts, launches)
            if dtype == torch.bfloat16:  # staged: each expert's first source holds its bytes on the device
                assert all((srcs[2 * j].staged is None) == in_place for j in range(len(experts)))


def test_a_cuda_store_warms_each_kind_of_layer_once(monkeypatch):
    """warm_decode (a CUDA load, after the store is laid out: ready_on_cuda): one pair decode for each
    kind of layer (w13's and w2's shapes and widths), and one batch decode (a coalesced copy's experts, a
    CUDA tier's hits), so each kernel specialization compiles at load; the copies decode in place only
    with SPECTER_CODED_IN_PLACE=1."""
    from specter.moe import ExpertWeights
    from specter.offload.coded import encode_store, warm_decode

    g = torch.Generator().manual_seed(4)
    normal = lambda *shape: (torch.randn(*shape, generator=g) * 0.02).bfloat16()  # noqa: E731
    two_bit = torch.zeros(2, 40, 96, dtype=torch.bfloat16)                # two exponents: a 2-bit code
    two_bit.view(2, -1)[:, ::2] = 1.0
    layers = [ExpertWeights(normal(2, 40, 96), normal(2, 96, 20)) for _ in range(3)]
    layers.append(ExpertWeights(two_bit, normal(2, 96, 20)))
    store = encode_store(layers, cuda=True)
    kinds = {(layer.w13.packed.bits, layer.w2.packed.bits) for layer in store}
    assert len(kinds) == 2, kinds
    launches = []
    monkeypatch.setattr(lossless, "_decode_pair_kernel", _Counted(lossless._decode_pair_kernel, "pair", launches))
    assert warm_decode(store, "cpu") == 2 and launches == ["pair", "pair"]
    monkeypatch.setattr(lossless, "_decode_pairs_kernel", _Counted(lossless._decode_pairs_kernel, "batch", launches))
    launches.clear()  # the batch kernel, once a kind
    assert warm_decode(store, "cpu", batch=True) == 2 and launches == ["batch", "batch"]
    from specter.offload import coded as coded_mod  # what a CUDA load runs (ready_on_cuda): in place where asked
    monkeypatch.setattr(coded_mod, "is_locked", lambda t: True)
    for flag, in_place in ((None, False), ("1", True)):
        if flag:
            monkeypatch.setenv("SPECTER_CODED_IN_PLACE", flag)
        launches.clear()
        coded_mod.ready_on_cuda(store, "cpu")  # a copy of one expert, and of several (one batch launch)
        assert launches == ["pair", "pair", "batch", "batch"], (flag, launches)
        assert all(layer.w13.pair.in_place == in_place for layer in store), flag


class _Counted:
    """A kernel whose launches are noted by name, then run."""

    def __init__(self, kernel, name, log):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.kernel[grid]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_coded_store_for_cuda_decodes_on_copy(dtype):
    """encode_store(cuda=True) (what a CUDA load holds) and CodedExpert.decode_on (what CudaLink runs
    on its copy stream), the CPU as the device: the same bits in the slot, converted exactly to fp32;
    a store not laid out for CUDA is refused."""
    from specter.moe import ExpertWeights
    from specter.offload.coded import encode_store

    g = torch.Generator().manual_seed(7)
    w13, w2 = (torch.randn(3, 40, 96, generator=g) * 0.02).bfloat16(), (torch.randn(3, 96, 20, generator=g) * 0.02).bfloat16()
    w13.view(3, -1)[:, ::97] = 1e30                                      # escapes in every expert
    layer = encode_store([ExpertWeights(w13.clone(), w2.clone())], cuda=True)[0]
    for e in range(3):
        for coded, want in ((layer.w13[e], w13[e]), (layer.w2[e], w2[e])):
            slot = torch.full(want.shape, float("nan"), dtype=dtype)
            assert coded.decode_on(slot).equal(want.to(dtype))
    plain = encode_store([ExpertWeights(w13.clone(), w2.clone())])[0]
    with pytest.raises(RuntimeError, match="expert-major"):
        plain.w13[0].decode_on(torch.empty(40, 96, dtype=torch.bfloat16))


def test_the_coded_copy_experiment_runs_on_cpu(capsys):
    """bench/experiments/coded_copy_cost.py (a device check, CHECKS=codedcopy) end to end with the CPU
    as the device: both stores land exact (the coded one as the engine copies, a tensor at a time, in
    place, and as a tier hit from bytes kept on the device, alone and a batch), the coded copy moves
    fewer bytes."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "experiments"))
    import coded_copy_cost

    assert coded_copy_cost.main(["--device", "cpu", "--shapes", "small", "--copies", "2", "--batch", "2"]) == 0
    row, in_place = (json.loads(line) for line in capsys.readouterr().out.strip().splitlines()[-2:])
    assert row["raw"]["exact"] and row["coded"]["exact"] and row["coded_unpaired"]["exact"], row
    assert row["tier_hit"]["exact"] and row["tier_hit"]["bytes"] == row["coded"]["bytes"], row
    assert row["tier_batch"]["exact"] and "tier_batch_over_raw" in row, row  # expert 0 and 1 in one launch
    assert row["raw_batch"]["exact"] and row["coded_batch"]["exact"] and "coded_batch_over_raw_batch" in row, row
    assert row["raw_batch"]["bytes"] == row["raw"]["bytes"] and row["coded_batch"]["bytes"] < 0.75 * row["raw"]["bytes"]
    assert in_place["coded_in_place"]["exact"] and in_place["coded_in_place"]["bytes"] == row["coded"]["bytes"], in_place
    assert row["raw"]["bytes"] == (96 * 64 + 64 * 48) * 2 and row["coded"]["bytes"] < 0.75 * row["raw"]["bytes"], row


def test_a_cuda_tier_decodes_its_kept_bytes_with_the_kernel(monkeypatch):
    """test_coded_tier's CUDA tier scenario (FakeCuda streams, the CPU as the device) with the pair
    kernels themselves decoding every copy and every hit: each slot holds its expert's bits."""
    from test_coded_tier import cuda_tier_scenario

    decoded = []
    _count_decodes(monkeypatch, decoded, [])
    cuda_tier_scenario(decoded)


def test_a_cuda_tier_over_random_calls_with_the_kernels(monkeypatch):
    """test_coded_tier's 60 random calls on FakeCuda with the pair kernels themselves decoding every copy
    and every hit, a call's hits in one launch of the batch kernel: every slot holds its expert's bits."""
    from test_coded_tier import cuda_tier_random

    decoded, batches = [], []
    _count_decodes(monkeypatch, decoded, batches)
    cuda_tier_random(decoded, batches)


def _count_decodes(monkeypatch, decoded: list, batches: list) -> None:
    """The staged decodes, the kernels themselves, noting each expert decoded and each batch's size."""
    one, many = lossless.decode_staged_pair, lossless.decode_staged_pairs

    def counted_one(pair, e, staged, out_a, out_b):
        decoded.append(e)
        return one(pair, e, staged, out_a, out_b)

    def counted_many(pair, jobs):
        batches.append(len(jobs))
        decoded.extend(job[0] for job in jobs if len(jobs) > 1)  # one job: counted_one notes it
        return many(pair, jobs)

    monkeypatch.setattr(lossless, "decode_staged_pair", counted_one)
    monkeypatch.setattr(lossless, "decode_staged_pairs", counted_many)



def test_the_decode_tune_experiment_decodes_every_variant_exactly(capsys):
    """bench/experiments/decode_tune.py (CHECKS=decodetune) with the CPU as the device: each (BLOCK,
    NUM_WARPS) encodes and decodes the same bits, alone and as a batch, and lossless.py's constants are
    put back afterwards."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "experiments"))
    import decode_tune

    before = (lossless.BLOCK, lossless.NUM_WARPS)
    assert decode_tune.main(["--device", "cpu", "--shapes", "tiny", "--batch", "2", "--variants",
                             "1024x2,1024x4,2048x4"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [(r["block"], r["warps"]) for r in rows] == [(1024, 2), (1024, 4), (2048, 4)]
    assert all(r["exact"] for r in rows) and [r["current"] for r in rows] == [True, False, False], rows
    assert (lossless.BLOCK, lossless.NUM_WARPS) == before
