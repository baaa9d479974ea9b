"""triton_ops/graphed.py: GraphedRows, expert_rows replayed from CUDA graphs.

On CPU the capture is a stand-in (FakeGraphs: a "graph" reruns the captured function on the static
buffers it closed over, writing into the captured output, as a replay does), so what is tested here
is the wrapper: keys, static inputs copied in every call, outputs that survive later calls, eager
fallbacks, and an engine that decodes through it losslessly. The CUDA test runs the real graphs.
"""
from __future__ import annotations

import pytest
import torch

import specter
from specter.triton_ops import expert_rows, fused_moe
from specter.triton_ops.graphed import GraphedRows

from test_triton_ops import moe_case


class FakeGraphs:
    def __init__(self, fail: bool = False):
        self.fail, self.captures = fail, 0

    def capture(self, fn):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captures += 1
        out = fn()
        return (fn, out), out

    @staticmethod
    def replay(graph) -> None:  # a real replay writes its output whatever the mode: no autograd checks
        fn, out = graph
        with torch.inference_mode(out.is_inference()):
            out.copy_(fn())


def _calls(device="cpu", dtype=torch.float32, E=8, H=32, I=24):
    """Two layers' weights, one shared remap tensor rewritten between calls (the manager's `late`),
    and a sequence of calls over T = 1, 3, 2 with and without it."""
    layers = [moe_case(3, 2, E=E, H=H, I=I, dtype=dtype, seed=s)[3:5] for s in (1, 2)]
    layers = [tuple(w.to(device) for w in ws) for ws in layers]
    remap = torch.full((E,), -1, dtype=torch.int32, device=device)
    g = torch.Generator().manual_seed(5)
    calls = []
    for i in range(30):  # each of the 12 kinds of call two or three times
        T = (1, 3, 2)[i % 3]
        x, ids, w, *_ = moe_case(T, 2, E=E, H=H, I=I, dtype=dtype, seed=10 + i)
        table = None
        if i % 2:
            table = torch.randperm(E, generator=g).int()
            table[torch.rand(E, generator=g) < 0.4] = -1
        calls.append((x.to(device), ids.to(device), w.to(device), layers[i % 4 // 2], table))
    return calls, remap


def _run(rows_fn, calls, remap):
    out = []
    for x, ids, w, (w13, w2), table in calls:
        r = None
        if table is not None:
            r = remap.copy_(table.to(remap.device))  # the same tensor, new contents
        out.append(rows_fn(x, ids, w, w13, w2, remap=r))
    return out


def test_graphed_rows_are_expert_rows_and_survive_later_calls():
    calls, remap = _calls()
    fake = FakeGraphs()
    graphed = GraphedRows(graphs=fake)
    got = _run(graphed, calls, remap)      # every output kept until the end: later replays must not touch it
    want = _run(expert_rows, calls, remap)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), i
    keys = {(id(c[3][0]), c[0].shape[0], c[4] is None) for c in calls}
    assert graphed.stats == {"graphs": len(keys), "replays": len(calls) - len(keys), "eager": len(keys)}
    assert fake.captures == len(keys)


def test_graphed_fused_moe_is_fused_moe_and_its_own_kind_of_call():
    """fused_moe through the graphs (the combine inside them: all-resident layers) gives fused_moe's
    output, and its kinds of call are not expert_rows' (a [T, H] graph never serves a [T, k, H] call)."""
    calls, remap = _calls()
    graphed = GraphedRows(graphs=FakeGraphs())
    for i, call in enumerate(calls):
        fn, ref = (graphed.fused_moe, fused_moe) if i % 5 else (graphed, expert_rows)
        assert torch.equal(_run(fn, [call], remap)[0], _run(ref, [call], remap)[0]), i
    kinds = {(i % 5 > 0, id(c[3][0]), c[0].shape[0], c[4] is None) for i, c in enumerate(calls)}
    assert graphed.stats["graphs"] == len(kinds) and graphed.stats["replays"] == len(calls) - len(kinds)


def test_graphed_rows_serve_calls_in_and_out_of_inference_mode():
    """The engine's prefill and plain steps run under inference_mode, the verifier under no_grad: a
    kind of call first seen in one mode replays in the other (the H200 bench at 18:07 stopped on
    'Inplace update to inference tensor outside InferenceMode' when the static inputs were made
    under inference_mode)."""
    calls, remap = _calls()
    want = _run(expert_rows, calls, remap)
    modes = (torch.inference_mode, torch.no_grad)
    for first, then in (modes, modes[::-1]):  # the 12 kinds of call first seen in one mode, replayed in the other
        graphed = GraphedRows(graphs=FakeGraphs())
        for i, call in enumerate(calls):
            with first() if i < 12 else then():
                got = _run(graphed, [call], remap)[0]
            assert torch.equal(got, want[i]), (first.__name__, i)
        assert graphed.stats["replays"] == len(calls) - 12


def test_graphed_rows_fall_back_to_eager_calls():
    calls, remap = _calls()
    want = _run(expert_rows, calls, remap)
    capped = GraphedRows(graphs=FakeGraphs(), max_graphs=2)
    assert all(torch.equal(a, b) for a, b in zip(_run(capped, calls, remap), want))
    assert capped.stats["graphs"] == 2 and capped.stats["replays"] + capped.stats["eager"] == len(calls)
    failing = GraphedRows(graphs=FakeGraphs(fail=True))
    assert all(torch.equal(a, b) for a, b in zip(_run(failing, calls, remap), want))
    assert failing.stats == {"graphs": 0, "replays": 0, "eager": len(calls)}
    x, ids, w, (w13, w2), _ = calls[0]
    empty = GraphedRows(graphs=FakeGraphs())
    for _ in range(2):  # T = 0: nothing to capture
        assert empty(x[:0], ids[:0], w[:0], w13, w2).shape == (0, 2, x.shape[1])
    assert empty.stats["graphs"] == 0
    small = GraphedRows(graphs=FakeGraphs(), max_tokens=2)  # T = 3 (a prefill's size here): never captured
    assert all(torch.equal(a, b) for a, b in zip(_run(small, calls, remap), want))
    kinds = {(id(c[3][0]), c[0].shape[0], c[4] is None) for c in calls if c[0].shape[0] <= 2}
    assert small.stats["graphs"] == len(kinds) and len(small._entries) == len(kinds)


@pytest.mark.parametrize("policy", ["resident", "on-demand", "specter"])
def test_an_engine_decoding_through_graphed_rows_is_lossless(monkeypatch, policy):
    """The builder's GraphedRows (CUDA's default) given the stand-in capture on CPU: greedy tokens
    are resident decoding's, and the MoE calls replayed."""
    from specter import builder

    made: list[GraphedRows] = []

    def graphed(device, compile):
        made.append(GraphedRows(graphs=FakeGraphs()))
        return made[-1]

    ref = specter.load(policy="resident", device="cpu")
    monkeypatch.setattr(builder, "moe_graphs", graphed)
    eng = specter.load(policy=policy, device="cpu", residency=None if policy == "resident" else 0.5)
    try:
        for prompt in ("The capital of France is", "Once upon a time"):
            want = ref.generate(prompt, max_new_tokens=12, temperature=0.0).token_ids
            assert eng.generate(prompt, max_new_tokens=12, temperature=0.0).token_ids == want, prompt
        assert len(made) == 1 and made[0].stats["replays"] > 0, made[0].stats
    finally:
        eng.close()
        ref.close()


def test_the_eager_draft_replays_its_moe_calls(monkeypatch):
    """With a penalty set the draft runs eagerly (not the captured step): its INT4 MoE calls go through
    the engine's GraphedRows too, and the tokens are resident decoding's under the same penalty."""
    from specter import builder

    made: list[GraphedRows] = []

    def graphed(device, compile):
        made.append(GraphedRows(graphs=FakeGraphs()))
        return made[-1]

    kw = dict(max_new_tokens=16, temperature=0.0, repetition_penalty=1.3)
    ref = specter.load(policy="resident", device="cpu")
    monkeypatch.setattr(builder, "moe_graphs", graphed)
    eng = specter.load(policy="specter", device="cpu", residency=0.5)
    try:
        draft_calls = []
        real = eng.decoder.draft.fused_moe
        eng.decoder.draft.fused_moe = lambda *a, **k: draft_calls.append(1) or real(*a, **k)
        assert real.__self__ is made[0]
        eng.decoder.governor.fixed = 3  # draft every cycle
        out = eng.generate("Once upon a time", **kw)
        assert out.token_ids == ref.generate("Once upon a time", **kw).token_ids
        assert draft_calls and out.stats["drafted_tokens"] > 0 and made[0].stats["replays"] > 0
    finally:
        eng.close()
        ref.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_rows_replay_expert_rows_bit_for_bit_on_cuda():
    """Real CUDA graphs: the same rows as the eager kernels, bit for bit, at bf16, with every
    output kept while later graphs replay (one shared memory pool), and a dense and an INT4 pool."""
    from specter.triton_ops import pack_int4

    for int4 in (False, True):
        calls, remap = _calls("cuda", torch.bfloat16, E=16, H=256, I=128)
        if int4:
            packed = {}
            calls = [c[:3] + (packed.setdefault(id(c[3][0]), tuple(pack_int4(w) for w in c[3])), c[4]) for c in calls]
        graphed = GraphedRows()
        got = _run(graphed, calls, remap) + _run(graphed.fused_moe, calls, remap)
        want = _run(expert_rows, calls, remap) + _run(fused_moe, calls, remap)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(got, want)), int4
        assert graphed.stats["graphs"] > 0 and graphed.stats["replays"] > 0, graphed.stats
