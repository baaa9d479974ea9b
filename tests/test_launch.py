"""launch.py's direct launches hand a compiled kernel's launcher exactly what Triton's JIT would.

No GPU needed: aot.stub_driver compiles for sm_90 (ptxas) and records each launch the compiled
launcher receives. Each case runs the same calls twice, once through the JIT (`kernel[grid]`) and
once through launch(), and compares the two records: the same compiled kernel, grid, stream and
arguments, launch after launch, across experts whose escape runs differ, slots off 16-byte
alignment (another specialization), integer specializations, every lossless decode path and the
fused MoE call's four kernels.
"""
from __future__ import annotations

import pytest
import torch

from specter.triton_ops import aot, launch, lossless

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # Triton 3.9's FP-fusion default notice


def _pair(E: int = 4, seed: int = 0):
    """A CPU layer_major pair of trained-like experts: escape runs that differ by expert."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 48, 32, generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(E, 32, 24, generator=g) * torch.linspace(0.001, 1, E).view(E, 1, 1)).bfloat16()
    return lossless.layer_major(lossless.encode(w13, 3), lossless.encode(w2, 2)).with_tables("cpu")


def _buffers(pair):
    """Each expert's staged bytes, two slot pools, and a slot of each tensor 8 bytes off 16."""
    E = pair.a.shape[0]
    staged = [lossless.stage_pair(pair, e, "cpu") for e in range(E)]
    slots = [torch.zeros(E, *p.shape[1:], dtype=torch.bfloat16) for p in (pair.a, pair.b)]
    off = [torch.zeros(p.shape[1] * p.shape[2] + 4, dtype=torch.bfloat16)[4:].view(p.shape[1:])
           for p in (pair.a, pair.b)]
    return staged, slots, off


def _calls(pair, buffers, monkeypatch, via) -> list[aot.StubCall]:
    """Every expert of `pair` decoded alone, then the layer's experts in one batch, then a slot pair
    off 16 bytes and an aligned one again, then each expert in place and each w2 alone: the launches
    as recorded on the stub driver."""
    monkeypatch.setattr(lossless, "LAUNCHES_ON_CPU", True)
    monkeypatch.setattr(lossless, "launch", via)
    (staged, slots, off), E = buffers, pair.a.shape[0]
    with aot.stub_driver(90) as calls:
        for e in range(E):
            lossless.decode_staged_pair(pair, e, staged[e], slots[0][e], slots[1][e])
        lossless.decode_staged_pairs(pair, [(e, staged[e], slots[0][e], slots[1][e]) for e in range(E)])
        lossless.decode_staged_pair(pair, 1, staged[1], *off)
        lossless.decode_staged_pair(pair, E - 1, staged[-1], slots[0][-1], slots[1][-1])
        for e in range(E):  # in place from the arena (SPECTER_CODED_IN_PLACE's), then a tensor alone (decode_into)
            lossless.decode_pair_in_place(pair, e, slots[0][e], slots[1][e])
        for e in range(E):
            lossless.decode_triton(pair.b, e, slots[1][e])
    return calls


def _same(a, b, content: bool = True) -> bool:
    """Equal arguments of two runs (their tensors are the runs' own: equal bytes at equal alignment)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.data_ptr() % 16 == b.data_ptr() % 16 and (not content or a.equal(b)))
    return type(a) is type(b) and a == b


def test_direct_launches_are_the_jits_launches(monkeypatch):
    pair = _pair()
    assert len({pair.a.run_at[e + 1] - pair.a.run_at[e] for e in range(3)}) > 1 or \
        len({pair.b.expert_escapes(e).numel() for e in range(4)}) > 1, "the experts' escape runs should differ"
    buffers = _buffers(pair)
    jit, direct = (_calls(pair, buffers, monkeypatch, via) for via in (launch.through_the_jit, launch.launch))
    assert len(jit) == len(direct) == 4 + 1 + 2 + 4 + 4
    for i, (j, d) in enumerate(zip(jit, direct)):
        assert (j.kernel, j.grid, j.stream) == (d.kernel, d.grid, d.stream), i
        # the launcher's arguments: packed metadata, launch metadata, two hooks, then the kernel's
        assert j.args[0] == d.args[0] and len(j.args) == len(d.args), i
        assert all(_same(x, y) for x, y in zip(j.args[4:], d.args[4:])), i
    # a specialization's first launch went through the JIT (its launch metadata), the rest straight on
    firsts = [i for i, d in enumerate(direct) if d.args[1:4] != (None, None, None)]
    assert firsts[:3] == [0, 4, 5] and 11 in firsts and not {1, 2, 3, 6, 7} & set(firsts), firsts
    # (7: in place, expert 0, row 0: the staged launches' specialization; the next rows are multiples of 16)
    # the same compiled kernel wherever the JIT chose the same one: the functions' numbers say which
    by_jit = {}
    for j, d in zip(jit, direct):
        assert by_jit.setdefault(j.function, d.function) == d.function
    off = direct[5]
    assert off.function != direct[0].function, "a slot off 16 bytes is another specialization"
    assert direct[6].function == direct[2].function, "back on aligned slots: the first kernel again"


def test_an_integers_value_is_part_of_what_a_launch_is_keyed_by():
    """Triton compiles an integer argument equal to 1, one divisible by 16 and any other apart (for the
    ones it specializes: not `do_not_specialize`'s): each launch gets the kernel the JIT picks for its
    values. In one stub session, so the loaded kernels' numbers compare."""
    pair = _pair(E=2)
    staged, slots, _ = _buffers(pair)
    a, b = pair.a, pair.b
    grid, (rows, tab_a, tab_b, n_a, n_b), kw = lossless._pair_launch(a.padded, a.bits, b.padded, b.bits)
    numels = (a.shape[1] * a.shape[2], b.shape[1] * b.shape[2])
    words, outs = staged[0].view(torch.int32), (slots[0][0].view(torch.int16), slots[1][0].view(torch.int16))

    def args(row, esc):
        return (words, words, *outs, row, tab_a, tab_b, rows + esc, rows + esc, numels[0], n_a, numels[1], n_b)

    cases = [(0, 0), (1, 0), (7, 0), (32, 0), (0, 1), (0, 7), (0, 2 ** 31)]  # row: specialized; esc: not
    with aot.stub_driver(90) as calls:
        for row, esc in cases:
            launch.through_the_jit(lossless._decode_pair_kernel, grid, *args(row, esc), **kw)
        for row, esc in cases:
            launch.launch(lossless._decode_pair_kernel, grid, *args(row, esc), **kw)
    jit, direct = calls[:len(cases)], calls[len(cases):]
    assert [c.function for c in direct] == [c.function for c in jit]
    assert len({c.function for c in jit}) == 4                    # {0, 32}, {1}, {7}, and an i64 esc


def test_a_launch_hook_sends_every_launch_through_the_jit(monkeypatch):
    from triton import knobs

    seen = []
    hook = knobs.runtime.launch_enter_hook
    if not hasattr(hook, "add"):
        pytest.skip("this Triton's launch hooks are plain callables")
    hook.add(seen.append)
    try:
        pair = _pair(E=2)
        calls = _calls(pair, _buffers(pair), monkeypatch, launch.launch)
    finally:
        hook.remove(seen.append)
    assert len(seen) == len(calls) == 2 + 1 + 2 + 2 + 2
    assert all(c.args[1] is not None for c in calls)             # the JIT's launch metadata, for the hook


def test_launch_refuses_what_it_cannot_key_and_the_stub_leaves_nothing_behind(monkeypatch):
    pair = _pair(E=2)
    _calls(pair, _buffers(pair), monkeypatch, launch.launch)
    assert not launch._compiled
    assert all(aot.STUB_DEVICE not in k.device_caches for k in (lossless._decode_pair_kernel,
                                                                 lossless._decode_pairs_kernel))
    with aot.stub_driver(90), pytest.raises(TypeError, match="float"):
        launch.launch(lossless._decode_pairs_kernel, (1, 1), 0.5)


def test_a_kernel_that_is_not_a_jit_function_is_launched_as_it_is():
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((grid, args, kw))

    launch.launch(Recorder(), (3,), 1, 2.5, X=4)
    assert seen == [((3,), (1, 2.5), {"X": 4, "enable_fp_fusion": launch.FP_FUSION})]


@pytest.mark.parametrize("int4", [False, 4])
def test_a_moe_calls_launches_are_the_jits_too(int4, monkeypatch):
    """The fused MoE call's four kernels (alignment, gate/up, down, combine), dense and INT4, over a
    slot pool through a remap row, at two token counts, then in fp16: the same launches both ways (the
    buffers the call allocates hold whatever memory held: compared by dtype, shape and alignment)."""
    from specter.triton_ops import kernels

    H, I, E, k = 64, 32, 4, 2
    w13, w2 = aot.stand_in_experts(E, H, I, torch.bfloat16, int4)
    g = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(T, H, generator=g).bfloat16(), torch.randint(0, E, (T, k), generator=g),
               torch.rand(T, k, generator=g).bfloat16()) for T in (1, 3, 1)]
    inputs.append(tuple(t.half() if t.is_floating_point() else t for t in inputs[0]))  # the same kernels, fp16
    remap = torch.arange(E, dtype=torch.int32)
    monkeypatch.setattr(kernels, "LAUNCHES_ON_CPU", True)
    runs = []
    for via in (launch.through_the_jit, launch.launch):
        monkeypatch.setattr(kernels, "launch", via)
        with aot.stub_driver(90) as calls:
            for x, ids, weights in inputs:
                kernels.combine_triton(kernels.moe_rows_triton(x, ids, weights, w13, w2, remap))
        runs.append(calls)
    jit, direct = runs
    assert [c.kernel for c in jit] == ["_align_kernel", "_gate_up_kernel", "_down_kernel", "_combine_kernel"] * 4
    for i, (j, d) in enumerate(zip(jit, direct)):
        assert (j.kernel, j.grid, j.stream, j.function, j.args[0]) == (d.kernel, d.grid, d.stream, d.function,
                                                                      d.args[0]), i
        assert len(j.args) == len(d.args) and all(_same(x, y, content=False) for x, y in zip(j.args[4:], d.args[4:])), i
    assert all(d.args[1:4] == (None, None, None) for d in direct[8:12]), "the third call went straight to its kernels"
    assert {d.function for d in direct[13:]}.isdisjoint(d.function for d in direct[:12]), "fp16: other kernels"
