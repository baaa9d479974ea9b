"""CUDA only (skipped without a GPU): the paths CPU CI never runs, checked on the GPU machine.

bench/device_check.sh (CHECKS=suite) runs this file with the CUDA tests of the other files, by the
selection `-k cuda`: the compiled kernels (test_triton_ops.py), CudaLink (test_link.py), the stall
timer (test_profiling.py) and the `[cuda]` cases of conftest's `device` fixture.

1. fused_moe's Triton kernels at bf16, dense and INT4 experts, at the expert shapes of real models,
   with and without the remap row: within bf16 rounding of an fp32 torch reference over the same
   (dequantized) weights, and batch invariant bit for bit (a token's output is the same whatever
   the batch's size T and wherever the token sits in it).
1b. Attention under the engine's SDPA backends: a one-token step is a verification's last row, bit
   for bit.
2. One lossless greedy run per policy on a tiny bf16 checkpoint (eager steps): the tokens of plain
   resident decoding, or parted from them only at a near-tie (tests/test_bf16.py's criterion).
3. astream against generate, K fixed: the very same text.
3b. The host lane beside the GPU: its rows back on the device bit for bit as the CPU computes them,
   after inputs still queued at submit; policy host, and specter with host_threads, as 2.
4. The captured draft step and verifier (compile=True, CUDA graphs): both ran compiled, no host
   sync inside them (bench/graph_check.py's checks), and the tokens lossless as in 2.
5. The pinned host store (bench/pinned_check.py): exact-size pinning and its fallback.
The tests run in the file's order, 4 last.
Only public entry points of the kernels are used (pack_int4, Int4Experts.dequantize, fused_moe).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BENCH = Path(__file__).resolve().parents[1] / "bench"

#          experts, hidden, moe intermediate, top-k
SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8),
          "deepseek-v2-lite": (64, 2048, 1408, 6),
          "mixtral-8x7b": (8, 4096, 14336, 2)}
T_MAX = 128
BATCHES = (1, 2, 8, 33)


# ------------------------------------------------------------------------------ 1. fused MoE kernels
@pytest.fixture(scope="module", params=list(SHAPES))
def layer(request):
    """One MoE layer on the GPU: bf16 and packed INT4 experts, T_MAX routed tokens, and a remap row
    over a pool of half the experts (the rest not resident: their rows are skipped)."""
    from specter.triton_ops import pack_int4

    E, H, I, k = SHAPES[request.param]
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device="cuda", generator=g).mul_(0.02).bfloat16()
    w2 = torch.randn(E, H, I, device="cuda", generator=g).mul_(0.02).bfloat16()
    x = torch.randn(T_MAX, H, device="cuda", generator=g).bfloat16()
    ids = torch.rand(T_MAX, E, device="cuda", generator=g).topk(k, dim=1).indices
    weights = torch.softmax(torch.randn(T_MAX, k, device="cuda", generator=g), -1).bfloat16()
    R = max(E // 2, 1)
    remap = torch.full((E,), -1, dtype=torch.int32, device="cuda")
    remap[torch.randperm(E, device="cuda", generator=g)[:R]] = torch.randperm(R, device="cuda", generator=g).int()
    p13, p2 = w13[:R].contiguous(), w2[:R].contiguous()  # the pool: R rows the remap points into
    yield {"name": request.param, "x": x, "ids": ids, "weights": weights, "remap": remap,
           ("dense", False): (w13, w2), ("int4", False): (pack_int4(w13), pack_int4(w2)),
           ("dense", True): (p13, p2), ("int4", True): (pack_int4(p13), pack_int4(p2))}
    torch.cuda.empty_cache()


def _dense_fp32(w):
    return (w.dequantize() if hasattr(w, "dequantize") else w).float()


@pytest.mark.parametrize("remapped", [False, True], ids=["all-resident", "remap"])
@pytest.mark.parametrize("kind", ["dense", "int4"])
def test_fused_moe_cuda_bf16_is_within_rounding_of_the_fp32_reference(layer, kind, remapped):
    from specter.triton_ops import fused_moe

    w13, w2 = layer[kind, remapped]
    remap = layer["remap"] if remapped else None
    d13, d2 = _dense_fp32(w13), _dense_fp32(w2)
    for T in BATCHES + (T_MAX,):
        x, ids, w = layer["x"][:T], layer["ids"][:T], layer["weights"][:T]
        got = fused_moe(x, ids, w, w13, w2, remap=remap)
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        ref = fused_moe(x.float(), ids, w.float(), d13, d2, remap=remap, backend="torch")
        err = (got.float() - ref).abs()
        scale = float(ref.abs().max())
        rel = float(err.norm() / ref.norm().clamp_min(1e-12))
        assert float(err.max()) <= 3e-2 * scale and rel <= 1e-2, \
            f"{layer['name']} {kind} T={T}: max error {float(err.max()):.3g} (output max {scale:.3g}), relative {rel:.3g}"


@pytest.mark.parametrize("remapped", [False, True], ids=["all-resident", "remap"])
@pytest.mark.parametrize("kind", ["dense", "int4"])
def test_fused_moe_cuda_is_batch_invariant_bit_for_bit(layer, kind, remapped):
    """A token's output has the same bits whatever T, and wherever it sits in the batch."""
    from specter.triton_ops import fused_moe

    w13, w2 = layer[kind, remapped]
    remap = layer["remap"] if remapped else None
    x, ids, w = layer["x"], layer["ids"], layer["weights"]
    full = fused_moe(x, ids, w, w13, w2, remap=remap)
    for T in BATCHES:
        part = fused_moe(x[:T], ids[:T], w[:T], w13, w2, remap=remap)
        off = (part != full[:T]).any(-1).nonzero()[:, 0].tolist()
        assert not off, f"{layer['name']} {kind}: tokens {off[:8]} of a batch of {T} differ from the batch of {T_MAX}"
    perm = torch.randperm(T_MAX, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    shuffled = fused_moe(x[perm], ids[perm], w[perm], w13, w2, remap=remap)
    off = (shuffled != full[perm]).any(-1).nonzero()[:, 0].tolist()
    assert not off, f"{layer['name']} {kind}: {len(off)} tokens differ once the batch is shuffled"


# ------------------------------------------------------------------- 1b. attention at every width
@pytest.mark.parametrize("heads", [(32, 4, 128, 128), (16, 16, 192, 128)], ids=["gqa", "mla"])
def test_attention_rows_do_not_depend_on_the_width_on_cuda(heads):
    """With the engine's SDPA backends (layers.cuda_attention_backends) a one-token step (no mask) and
    the last row of a masked verification over the same keys are the same bits: the lossless runs
    below compare plain decoding's steps with verifications."""
    from specter.layers import cuda_attention_backends

    nh, nkv, dqk, dv = heads
    flags = [torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled()]
    cuda_attention_backends()
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        L, T = 300, 5
        q = torch.randn(1, nh, T, dqk, device="cuda", generator=g).bfloat16()
        k = torch.randn(1, nkv, L, dqk, device="cuda", generator=g).bfloat16()
        v = torch.randn(1, nkv, L, dv, device="cuda", generator=g).bfloat16()
        F = torch.nn.functional
        mask = torch.arange(L, device="cuda")[None, :] <= torch.arange(L - T, L, device="cuda")[:, None]
        wide = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=nkv != nh)
        step = F.scaled_dot_product_attention(q[:, :, -1:], k, v, enable_gqa=nkv != nh)
        assert torch.equal(step, wide[:, :, -1:]), float((step.float() - wide[:, :, -1:].float()).abs().max())
    finally:
        torch.backends.cuda.enable_flash_sdp(flags[0])
        torch.backends.cuda.enable_cudnn_sdp(flags[1])


# ---------------------------------------------------------------- 2, 3. end to end on a tiny checkpoint
PROMPTS = ([1, 5, 9, 33, 17], [2, 40, 41, 7, 100, 3, 3])
NEW = 32
POLICY_KW = {"resident": {}, "on-demand": {"residency": 0.5}, "next-layer": {"residency": 0.5},
             "spec-lru": {"residency": 0.5, "k_max": 6}, "specter": {"residency": 0.5, "k_max": 6}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny bf16 checkpoint (published ones are 16-bit: the CUDA default compute dtype follows), with
    the bundled model's tokenizer (its 4096 ids cover the tiny vocabulary; stops come from the config's
    eos, None here) so that text streams."""
    import shutil

    import specter
    from specter.testing import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("cuda-qwen3")
    make_tiny_checkpoint(path, "qwen3_moe", dtype=torch.bfloat16, eos_token_id=None)
    shutil.copy(specter.default_model_path() / "tokenizer.json", path)
    return path


@pytest.fixture(scope="module")
def shared(checkpoint):
    from specter.bench import load_once

    return load_once(checkpoint, device="cuda")


@pytest.fixture(scope="module")
def plain(checkpoint, shared):
    """Plain resident decoding on CUDA: the reference engine and its greedy tokens."""
    import specter

    engine = specter.load(checkpoint, device="cuda", policy="resident", shared=shared)
    tokens = [engine.generate(p, max_new_tokens=NEW, temperature=0.0).token_ids for p in PROMPTS]
    assert all(len(t) == NEW for t in tokens) and len({t for ts in tokens for t in ts}) > 8  # not degenerate
    yield engine, tokens
    engine.close()


def _fix_k(engine, k: int = 3) -> bool:
    """Speculative engines draft K tokens every cycle (the whole draft/verify/rollback path runs)."""
    from specter.speculative.governor import Governor

    gov = getattr(engine.decoder, "governor", None)
    if gov is None:
        return False
    engine.decoder.governor = Governor(gov.k_max, fixed=k)
    return True


def _lossless(plain, engine, label: str) -> list:
    """Greedy outputs of `engine`; each equals plain decoding's or parts from it only at a near-tie."""
    from specter.testing import tie_gap

    sys.path.insert(0, str(Path(__file__).parent))
    from test_bf16 import TIE_NOISE

    ref_engine, ref = plain
    outs = [engine.generate(p, max_new_tokens=NEW, temperature=0.0) for p in PROMPTS]
    for p, out, want in zip(PROMPTS, outs, ref):
        i, gap, noise = tie_gap(ref_engine, p, want, out.token_ids)
        assert i is None or abs(gap) <= TIE_NOISE * noise, \
            f"{label}, prompt {p}: parts from resident at token {i} by {gap:.3g} (rounding noise {noise:.3g})"
    return outs


@pytest.mark.parametrize("policy", list(POLICY_KW))
def test_each_policy_is_lossless_on_cuda(checkpoint, shared, plain, policy):
    import specter

    engine = specter.load(checkpoint, device="cuda", policy=policy, shared=shared, compile=False,
                          **POLICY_KW[policy])
    try:
        speculative = _fix_k(engine)
        outs = _lossless(plain, engine, f"{policy} (eager, {engine.decoder.__class__.__name__})")
        if speculative:
            assert sum(o.stats["drafted_tokens"] for o in outs) > 0
    finally:
        engine.close()


def test_astream_gives_generates_text_on_cuda(checkpoint, shared, plain):
    """astream runs the decoder on a thread of its own (docs/ARCHITECTURE.md): generate's text, K fixed."""
    import asyncio

    import specter

    engine = specter.load(checkpoint, device="cuda", policy="specter", shared=shared, compile=False,
                          **POLICY_KW["specter"])

    async def collect(prompt):
        return "".join([piece async for piece in engine.astream(prompt, max_new_tokens=NEW, temperature=0.0)])

    try:
        assert _fix_k(engine)
        outs = _lossless(plain, engine, "specter, generate")
        texts = [asyncio.run(collect(p)) for p in PROMPTS]
    finally:
        engine.close()
    assert texts == [o.text for o in outs]


# ------------------------------------------------------------------------- 3b. the host lane beside a GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_host_lanes_rows_cross_to_the_gpu_bit_for_bit_on_cuda(dtype):
    """HostLane's CUDA branch alone, exactly: the inputs a GPU op has just written (queued, not yet run when
    the job is submitted) reach the lane, and the rows it computes on the host from the bf16 store come
    back to the device with the very bits the same computation gives on the CPU, in the inputs' dtype."""
    from specter.moe import ExpertWeights
    from specter.offload.host_lane import HostLane
    from specter.triton_ops import expert_rows

    E, H, I, T, k = 8, 256, 192, 5, 2
    g = torch.Generator().manual_seed(0)
    store = ExpertWeights((torch.randn(E, 2 * I, H, generator=g) * 0.05).bfloat16(),
                          (torch.randn(E, H, I, generator=g) * 0.05).bfloat16())
    base = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, k, generator=g), -1)
    cold = sorted(set(ids.flatten().tolist()))[::2]
    lane = HostLane([store], "cuda", threads=2)
    try:
        x = torch.empty(T, H, device="cuda", dtype=dtype)
        torch.cuda._sleep(100_000_000)  # tens of ms of work queued on the compute stream ahead of x's bytes
        x.copy_(base.to(dtype).pin_memory(), non_blocking=True)  # still queued when the job is submitted
        job = lane.submit(0, x, ids.cuda(), w.cuda().to(dtype), cold)
        job.wait()  # a stream wait: the rows are read on the device after their copy
        got = (job.rows * 1).cpu()
    finally:
        lane.close()
    remap = torch.full((E,), -1, dtype=torch.int32)
    remap[cold] = torch.tensor(cold, dtype=torch.int32)
    want = expert_rows(base.to(dtype).bfloat16(), ids, w.to(dtype), store.w13, store.w2, remap=remap,
                       backend="torch")
    assert got.dtype == dtype and torch.equal(got, want.to(dtype))


@pytest.mark.parametrize("policy, dtype, compile", [("host", "bfloat16", False), ("host", "bfloat16", None),
                                                    ("host", "float16", False), ("specter", "bfloat16", False)])
def test_the_host_lane_is_lossless_on_cuda(checkpoint, shared, plain, policy, dtype, compile):
    """offload/host_lane.py's CUDA branch on a GPU: `host` computes every miss on the host (eager steps,
    and the CUDA default: MoE calls from graphs), also in float16 over the bf16 store (eager: the lane
    computes in bf16 and hands back float16 rows); specter with `host_threads` splits the misses between the
    lanes, K fixed. The host's kernels round otherwise than the GPU's, so the criterion is 2's: resident
    decoding's tokens, or parted from them at a near-tie (float16: resident float16 decoding's)."""
    import specter

    kw = {"residency": 0.5, "host_threads": 2} | ({"k_max": 6} if policy == "specter" else {})
    ref = plain
    if dtype != "bfloat16":
        resident = specter.load(checkpoint, device="cuda", policy="resident", dtype=dtype, compile=compile)
        ref = (resident, [resident.generate(p, max_new_tokens=NEW, temperature=0.0).token_ids for p in PROMPTS])
    engine = specter.load(checkpoint, device="cuda", policy=policy, dtype=dtype, compile=compile,
                          shared=shared if dtype == "bfloat16" else None, **kw)
    try:
        _fix_k(engine)
        outs = _lossless(ref, engine, f"{policy} with its host lane ({dtype}, compile={compile})")
        hosted = sum(o.stats["host_experts"] for o in outs)
        assert hosted > 0 or policy == "specter", [o.stats for o in outs]  # host: every miss; specter: its choice
        print(f"{policy} {dtype}: {hosted} experts computed on the host")
    finally:
        engine.close()
        if ref is not plain:
            ref[0].close()


# -------------------------------------------------------------------------------- 5. pinned store
def test_pinned_host_store_on_cuda(capsys):
    sys.path.insert(0, str(BENCH))
    import pinned_check

    rc = pinned_check.main()
    assert rc == 0, capsys.readouterr().out[-2000:]


@pytest.mark.parametrize("policy", ["resident", "on-demand"])
def test_plain_policies_replay_their_moe_calls_losslessly_on_cuda(checkpoint, shared, plain, policy):
    """compile left to its CUDA default: each MoE call replays from a CUDA graph (GraphedRows), the
    tokens those of eager plain decoding."""
    import specter

    engine = specter.load(checkpoint, device="cuda", policy=policy, shared=shared, **POLICY_KW[policy])
    try:
        _lossless(plain, engine, f"{policy}, MoE calls from CUDA graphs")
        experts = engine.decoder.experts  # ResidentExperts holds GraphedRows.fused_moe; the manager, both
        graphed = getattr(experts, "expert_rows", None) or experts.fused_moe.__self__
        assert graphed.stats["graphs"] > 0 and graphed.stats["replays"] > 0, graphed.stats
    finally:
        engine.close()


# ----------------------------------------------- 4. captured graphs (last: the compile takes longest)
def test_captured_graphs_run_sync_free_and_lossless_on_cuda(checkpoint, shared, plain):
    """compile=True on CUDA: the draft step and the verifier's pieces as CUDA graphs."""
    import specter

    sys.path.insert(0, str(BENCH))
    from graph_check import sync_free_check, verify_sync_check

    engine = specter.load(checkpoint, device="cuda", policy="specter", shared=shared, compile=True,
                          **POLICY_KW["specter"])
    try:
        assert _fix_k(engine)
        outs = _lossless(plain, engine, "specter, CUDA graphs")
        assert set(outs[-1].stats["compiled"]) == {"draft", "verify"}, outs[-1].stats["compiled"]
        graphed = engine.decoder.experts.expert_rows  # the MoE calls between the pieces: GraphedRows
        assert graphed.stats["replays"] > 0, graphed.stats
        sync_free_check(engine)     # raise under set_sync_debug_mode("error") on a host sync
        verify_sync_check(engine)
    finally:
        engine.close()
