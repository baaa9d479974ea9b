"""specter.compiled: the sync-free draft step and the piecewise verifier under
torch.compile(fullgraph=True), on CPU.

1. Capture safety without a GPU: compiled through a backend that scans each ATen graph for what a
   CUDA graph cannot hold (host syncs, multinomial, device copies, ops on another device), the
   draft step is one graph with none of them, greedy and sampled, and the verifier's pieces two
   each (width 1, then any width); nothing recompiles across generations of other prompt lengths,
   K (0 included) and sampling settings ("fail_on_recompile"); greedy tokens equal resident
   decoding; out.stats["compiled"] says which steps ran compiled. The verifier's pieces also on
   the other layer kinds (MLA with a dense first layer and a shared expert; LayerNorm + biases).
2. The scanner sees what it must (it can fail).
3. Inductor (what compile=True runs): the step drafts what the eager draft drafts (tokens and
   lookahead rows), the verifier's logits are the eager forward's, and an engine on both is lossless.
4. compile that is not a bool (or None: auto) is a clear error; auto leaves CPU engines eager.
5. Graphs that copy nothing: every tensor the draft step (dense and packed INT4) and each verify
   piece read above 1 MB is a static input (CUDA graphs copy the others before every replay).
"""
from __future__ import annotations

import pytest
import torch

import specter
from specter import builder
from specter.compiled.capture import capture_check_backend, copied_inputs, static_inputs_backend
from specter.compiled.draft_step import DraftStep
from specter.compiled.verify_step import VerifyStep
from specter.errors import ConfigError
from specter.layers import KVCache
from specter.sampling import SamplingParams

PROMPT = [1, 5, 9, 33, 2, 17, 4]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from specter.testing import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("compiled")
    # bf16, as published checkpoints are: on CPU the input embedding then keeps its 16-bit table and
    # computes in fp32, so no parameter of the first module tells the compute dtype
    make_tiny_checkpoint(path, "qwen3_moe", eos_token_id=None, dtype=torch.bfloat16)
    return path


def test_draft_and_verify_steps_capture_cleanly_and_never_recompile(tiny_path):
    ref = specter.load(tiny_path, device="cpu", policy="resident")
    eng = specter.load(tiny_path, device="cpu", policy="specter", residency=0.5)
    found, graphs = [], []
    dec = eng.decoder
    dec.draft_step = DraftStep(dec.model, dec.draft.layers, dec.draft.lookahead, compile=True,
                               backend=capture_check_backend(found, graphs))
    dec.verify_step = VerifyStep(dec.model, dec.governor.k_max, compile=True,
                                 backend=capture_check_backend(found, graphs))
    try:
        dec.draft_step.warmup()
        assert len(graphs) == 2 and found == [], found  # greedy and sampled: one graph each, clean
        dec.verify_step.warmup()
        # embed, MoE-layer segment, head (no dense layer here): widths 1 and any, clean
        assert len(graphs) == 2 + 3 * 2 and found == [], found
        with torch.compiler.set_stance("fail_on_recompile"):
            for prompt, n, k in ((PROMPT, 9, 0), (PROMPT, 30, 3), (PROMPT[:3], 17, 6), (PROMPT * 3, 24, 5)):
                dec.governor.fixed = k
                out = eng.generate(prompt, max_new_tokens=n)
                assert out.token_ids == ref.generate(prompt, max_new_tokens=n).token_ids, (prompt, n, k)
                assert out.stats["compiled"] == (["draft", "verify"] if k else ["verify"])
            for t, top_k, top_p in ((0.7, 0, 1.0), (1.3, 5, 0.9)):  # the sync-free sampled draft: a seed's
                kw = dict(max_new_tokens=12, temperature=t, top_k=top_k, top_p=top_p, seed=1)  # tokens, as plain's
                out = eng.generate(PROMPT, **kw)
                assert out.stats["drafted_tokens"] > 0 and out.token_ids == ref.generate(PROMPT, **kw).token_ids
            # penalties draft eagerly (tokens built on the host) and still verify through the pieces
            out = eng.generate(PROMPT, max_new_tokens=16, repetition_penalty=1.3)
            assert out.token_ids == ref.generate(PROMPT, max_new_tokens=16, repetition_penalty=1.3).token_ids
            assert out.stats["compiled"] == ["verify"]
        assert len(graphs) == 8 and found == [], found
    finally:
        eng.close()
        ref.close()


def test_the_scanner_catches_graph_breakers():
    found = []
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        torch.compile(lambda x: x[:int(x.sum().item())] * 2, backend=capture_check_backend(found),  # a length read back
                      fullgraph=True)(torch.ones(4, dtype=torch.int64))
    torch.compile(lambda p: torch.multinomial(p, 1), backend=capture_check_backend(found), fullgraph=True)(
        torch.ones(4))
    for op in ("_local_scalar_dense", "_assert_scalar", "multinomial"):
        assert any(op in f for f in found), (op, found)


@pytest.mark.parametrize("arch", ["deepseek_v2", "phimoe"])
def test_verify_pieces_compute_the_forward_on_every_layer_kind(arch, tmp_path):
    """MLA attention, a dense first layer and a shared expert (deepseek_v2); LayerNorm, biases and
    the sparsemixer router (phimoe): the pieces are clean graphs, give the forward's logits and
    tokens at every width, and recompile for neither a width nor a longer cache."""
    from specter.testing import make_tiny_checkpoint

    make_tiny_checkpoint(tmp_path, arch, eos_token_id=None)
    eng = specter.load(tmp_path, device="cpu", policy="resident")
    model, experts = eng.decoder.model, eng.decoder.experts
    found, graphs = [], []
    step = VerifyStep(model, 8, compile=True, backend=capture_check_backend(found, graphs))
    step.warmup()
    pieces = len(graphs)
    assert pieces == 2 * (4 if model.spec.n_moe_layers < model.spec.n_layers else 3) and found == [], found
    n = len(PROMPT)
    with torch.compiler.set_stance("fail_on_recompile"):
        for max_len in (n + 9 + step.headroom, 64):
            caches = [KVCache(model.spec, max_len, eng.device, eng.dtype) for _ in range(2)]
            for c in caches:
                model(torch.tensor(PROMPT), 0, c, experts)
            for T in (1, 2, 5, 9):
                toks = torch.arange(T) + 3
                want = model(toks, n, caches[0], experts)
                got = step.step(toks, n, caches[1], experts)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                assert torch.equal(got.argmax(-1), want.argmax(-1)), (arch, max_len, T)
    assert len(graphs) == pieces and found == [], found
    with pytest.raises(IndexError, match="headroom"):
        step.step(torch.arange(3), 62, caches[1], experts)  # padded to 4: past the cache's 64 rows
    eng.close()


def test_width_buckets():
    from specter.compiled.verify_step import width_buckets

    assert width_buckets(32) == (1, 2, 4, 8, 16, 33) and width_buckets(4) == (1, 2, 5) and width_buckets(0) == (1,)
    for k_max in range(40):  # sorted, the largest is every verification's K_max + 1
        b = width_buckets(k_max)
        assert list(b) == sorted(set(b)) and b[0] == 1 and b[-1] == k_max + 1


def test_a_draft_step_past_k_max_is_refused_not_run(tiny_path):
    """A cycle drafts K_max tokens at most: one step more would index the step's buffers out of bounds
    on the device (a CUDA graph's device-side assert kills the process), so the host refuses it;
    begin() starts a new cycle."""
    eng = specter.load(tiny_path, device="cpu", policy="specter", residency=0.5)
    dec = eng.decoder
    try:
        la = dec.draft.lookahead
        step = DraftStep(dec.model, dec.draft.layers, la)
        cache = KVCache(dec.model.spec, 48, dec.device, dec.dtype)
        dec.model(torch.tensor(PROMPT), 0, cache, dec.experts)
        for _ in range(2):
            step.begin(60, len(PROMPT), SamplingParams())
            for _ in range(la.k_max):
                step.step(cache)
            with pytest.raises(RuntimeError, match="K_max"):
                step.step(cache)
    finally:
        eng.close()


def test_inductor_steps_compute_what_the_eager_ones_do(tiny_path):
    """The real compile (Inductor), greedy only to keep CI short: per step the same drafted token
    and lookahead row as the eager INT4 draft; the verifier's logits those of the eager forward;
    then a lossless engine on both."""
    eng = specter.load(tiny_path, device="cpu", policy="specter", residency=0.5)
    dec = eng.decoder
    try:
        model, la = dec.model, dec.draft.lookahead
        step = DraftStep(model, dec.draft.layers, la, compile=True)
        caches = [KVCache(model.spec, 48, dec.device, dec.dtype) for _ in range(2)]
        for c in caches:  # the same committed prefix in both
            model(torch.tensor(PROMPT), 0, c, dec.experts)
        n, tok = len(PROMPT), 60
        step.begin(tok, n, SamplingParams())
        for i in range(5):
            dec.draft.row = i
            want = int(model(torch.tensor([tok]), n + i, caches[0], dec.draft).argmax(-1))  # eager, records row i
            want_ids = la.ids[i].clone()
            step.step(caches[1])
            tok = int(step.tokens[i + 1])
            assert tok == want and torch.equal(la.ids[i], want_ids), (i, tok, want)
            assert la.read_host(i, i + 1) == [want_ids.tolist()]  # published to the host mirror
            torch.testing.assert_close(caches[1].k[0][:, n + i], caches[0].k[0][:, n + i], rtol=1e-5, atol=1e-5)
        dec.draft.row = None
        verify = VerifyStep(model, dec.governor.k_max, compile=True)
        verify.warmup()
        cache = KVCache(model.spec, 48, dec.device, dec.dtype)
        model(torch.tensor(PROMPT), 0, cache, dec.experts)
        for T in (1, 4, 7):
            toks = torch.arange(T) + 11
            want = model(toks, n, caches[0], dec.experts)
            got = verify.step(toks, n, cache, dec.experts)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(got.argmax(-1), want.argmax(-1)), T
        ref = specter.load(tiny_path, device="cpu", policy="resident")
        dec.draft_step, dec.verify_step = step, verify
        dec.governor.fixed = 4  # speculate every cycle: both steps run whatever the governor would choose
        with torch.compiler.set_stance("fail_on_recompile"):
            for m in (25, 90):  # two generations; the second grows the KV cache (a dynamic length)
                out = eng.generate(PROMPT, max_new_tokens=m)
                assert out.token_ids == ref.generate(PROMPT, max_new_tokens=m).token_ids, m
                assert out.stats["compiled"] == ["draft", "verify"]
        ref.close()
    finally:
        eng.close()


def test_inductor_verifier_keeps_eager_bf16_numerics(tiny_path):
    """Lossless: at a 16-bit compute dtype the compiled verifier (Inductor) computes the eager pieces'
    K/V bit for bit at every width (EAGER_NUMERICS: without it Inductor keeps fused intermediates in
    fp32 and folds residual adds into matmuls; K/V differ and logits part by ~0.1). The logits agree
    to fp32 rounding only: Inductor sums the head's fp32 RMSNorm in another order than eager."""
    eng = specter.load(tiny_path, device="cpu", policy="resident", dtype="bf16")
    model, experts = eng.decoder.model, eng.decoder.experts
    try:
        assert model.dtype == torch.bfloat16
        steps = [VerifyStep(model, 3, compile=c) for c in (False, True)]  # widths 1, 2, 4
        caches = [KVCache(model.spec, 32, eng.device, model.dtype) for _ in steps]
        for c in caches:
            model(torch.tensor(PROMPT), 0, c, experts)
        n = len(PROMPT)
        for T in (1, 2, 3, 4, 1):  # each step's K/V feeds the next: any drift would compound
            toks = torch.arange(T) * 7 + 11
            want, got = (s.step(toks, n, c, experts) for s, c in zip(steps, caches))
            for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
                assert torch.equal(a, b), T
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            assert torch.equal(got.argmax(-1), want.argmax(-1)), T
            n += T
    finally:
        eng.close()


def test_compile_not_a_bool_is_a_clear_error_and_auto_is_off_on_cpu(tiny_path):
    with pytest.raises(ConfigError, match="compile must be True, False or None"):
        builder.build_engine(tiny_path, torch.device("cpu"), policy="specter", compile="yes")
    eng = specter.load(tiny_path, device="cpu", policy="specter", residency=0.5)
    assert eng.decoder.draft_step is None and eng.decoder.verify_step is None  # auto: CUDA only (builder._compiled_steps)
    eng.close()


def test_bench_cli_compile_flag(tiny_path, capsys, tmp_path, monkeypatch, fixed_k):
    """--compile reaches the engines `specter bench` builds (the step itself is stubbed: compiling
    is tested above): the speculative one gets a draft step and a verifier, the plain one its
    one-token step (the verifier at K_max 0: width 1)."""
    import json

    from specter.cli import main

    built = []
    monkeypatch.setattr(builder, "_compiled_draft_step",
                        lambda model, draft, compile=True: built.append(compile) or DraftStep(
                            model, draft.layers, draft.lookahead, compile=False))
    monkeypatch.setattr(builder, "_compiled_verify_step",
                        lambda model, k_max, compile=True: built.append(k_max) or VerifyStep(model, k_max))
    prompts = tmp_path / "prompts.json"  # the tiny checkpoint ships no tokenizer: token-id prompts
    prompts.write_text(json.dumps([PROMPT, [3, 60, 7]]))
    rc = main(["bench", "--model", str(tiny_path), "--device", "cpu", "--policies", "on-demand,specter",
               "--residency", "0.5", "--max-new-tokens", "12", "--compile", "--k-max", "4",
               "--prompts", str(prompts), "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    pols = json.loads(out)["policies"]
    assert pols["specter"]["lossless_vs_on-demand"] is True and pols["specter"]["drafted_tokens"] > 0
    assert built == [0, True, 4]  # on-demand's one-token step, then the specter engine's draft and verifier


def test_the_plan_holds_the_kv_cache_a_padded_verifier_writes(tiny_path, monkeypatch):
    """The compiled verifier pads a verification to a width bucket and writes KV rows past the context
    (K_max of them at most: `headroom`); the plan counted the context's rows only (40 planned, 48
    allocated). The plan now counts them as scratch, and the cache at a full context is the plan's.
    (The steps stubbed eager, as above: the padding is the step's, compiled or not.)"""
    monkeypatch.setattr(builder, "_compiled_draft_step", lambda model, draft, compile=True: DraftStep(
        model, draft.layers, draft.lookahead, compile=False))
    monkeypatch.setattr(builder, "_compiled_verify_step", lambda model, k_max, compile=True: VerifyStep(model, k_max))
    context, k_max = 40, 8
    eng = specter.load(tiny_path, device="cpu", policy="specter", residency=0.5, compile=True, k_max=k_max,
                       context=context)
    try:
        eng.generate(PROMPT, max_new_tokens=context - len(PROMPT))
        assert eng.plan.kv_scratch == k_max == eng.decoder.verify_step.headroom
        assert eng.decoder._cache.nbytes() == eng.plan.kv_bytes == \
            KVCache(eng.model.spec, context + k_max, "cpu", eng.dtype).nbytes()
    finally:
        eng.close()
    plain = specter.load(tiny_path, device="cpu", policy="specter", residency=0.5, k_max=k_max, context=context)
    try:  # eager (CPU's default): no scratch
        assert plain.plan.kv_scratch == 0 and plain.plan.kv_bytes == KVCache(plain.model.spec, context, "cpu",
                                                                             plain.dtype).nbytes()
    finally:
        plain.close()


@pytest.mark.parametrize("policy", ["resident", "on-demand", "next-layer"])
def test_plain_policies_step_through_their_one_token_step(tiny_path, monkeypatch, policy):
    """compile=True gives a plain policy the verifier at width 1 as its step, traced through the
    capture-checking backend (what a CUDA graph needs, without Inductor): every token after prefill
    goes through it, its pieces are clean graphs, none recompiles for a longer cache or another
    generation, the KV cache is kept across generations, and the tokens are resident decoding's."""
    steps, found, graphs = [], [], []

    def one_token_step(model, k_max, compile=True):
        step = VerifyStep(model, k_max, compile=True, backend=capture_check_backend(found, graphs))
        step.warmup()
        real = step.step
        step.step = lambda *a: steps.append(a[0].shape[0]) or real(*a)
        return step

    ref = specter.load(tiny_path, device="cpu", policy="resident")
    monkeypatch.setattr(builder, "_compiled_verify_step", one_token_step)
    kw = {} if policy == "resident" else {"residency": 0.5}
    eng = specter.load(tiny_path, device="cpu", policy=policy, compile=True, **kw)
    try:
        assert eng.decoder.step.buckets == (1,) and found == [] and len(graphs) == 3  # embed, MoE segment, head
        with torch.compiler.set_stance("fail_on_recompile"):
            for m in (9, 20, 9, 20):
                steps.clear()
                out = eng.generate(PROMPT, max_new_tokens=m)
                assert out.token_ids == ref.generate(PROMPT, max_new_tokens=m).token_ids, m
                assert steps == [1] * (m - 1), steps
                assert out.stats["compiled"] == ["verify"]
        assert eng.decoder._caches == 2  # made, grown once for 20 tokens, kept (without graphs: no CACHE_MIN)
        assert len(graphs) == 3 and found == [], found
    finally:
        eng.close()
        ref.close()


@pytest.mark.parametrize("kw", [dict(temperature=0.7), dict(temperature=1.3, top_k=5), dict(temperature=1.0, top_p=0.8),
                                dict(temperature=0.9, top_k=7, top_p=0.6, min_p=0.1),
                                dict(temperature=1.0, top_p=1e-50), dict(temperature=0.5, top_p=1e-30, top_k=4)],
                         ids=str)
def test_step_filters_as_sampling_probs(kw):
    """The step's tensor-parameter filter keeps the tokens, and the probabilities, of sampling.probs; at a
    top_p below fp32's range too (it compared as 0 and dropped every token: NaN, every draft rejected)."""
    from specter.compiled.draft_step import filtered_probs
    from specter.sampling import probs

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    p = SamplingParams(**kw)
    V = logits.shape[1]
    t = lambda v, dt=torch.float32: torch.tensor(v, dtype=dt)  # noqa: E731
    got = filtered_probs(logits, t(p.temperature), t(p.top_k if p.top_k else V, torch.int64),
                         t(p.top_p if p.top_p < 1 else 2.0), t(p.min_p))
    torch.testing.assert_close(got, probs(logits, p), rtol=1e-5, atol=1e-6)


MB = 1 << 20


@pytest.fixture(scope="module")
def wide_path(tmp_path_factory):
    """Experts (dense and packed), embedding and lm_head above 1 MB each, so a copied one shows."""
    from specter.testing import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("wide")
    make_tiny_checkpoint(path, "qwen3_moe", eos_token_id=None, dtype=torch.bfloat16, hidden_size=256,
                         moe_intermediate_size=512, num_experts=16, vocab_size=2048)
    return path


def test_captured_graphs_read_every_large_tensor_as_a_static_input(wide_path):
    """The draft step, dense (CPU) and packed INT4 (CUDA's layout, through fused_moe's torch backend
    here), and every verify piece: no tensor input over 1 MB that a CUDA graph would copy per replay."""
    from specter.moe import ExpertWeights
    from specter.speculative.draft import DraftExperts

    eng = specter.load(wide_path, device="cpu", policy="specter", residency=0.5, draft_cache="off")
    dec = eng.decoder
    try:
        packed = DraftExperts(eng.shared.store, dec.draft.lookahead, dec.device, dec.dtype, packed=True)
        copied = {}
        for name, layers in (("dense", dec.draft.layers),
                             ("int4", [ExpertWeights(a, b) for a, b in zip(packed.q13, packed.q2)])):
            inputs = []
            step = DraftStep(dec.model, layers, dec.draft.lookahead, compile=True,
                             backend=static_inputs_backend(inputs))
            step.warmup()
            big = [i for i in inputs if i.nbytes > MB]
            assert any("experts" in i.name for i in big), (name, big)  # the weights are there, and large
            copied[name] = [i.name for i in copied_inputs(inputs, MB)]
        for name, k_max, kinds in (("verify", 8, 3 * 2), ("one-token step", 0, 3)):  # 0: a plain policy's
            inputs = []
            verify = VerifyStep(dec.model, k_max, compile=True, backend=static_inputs_backend(inputs))
            verify.warmup()
            assert len({i.graph for i in inputs}) == kinds and any(i.nbytes > MB for i in inputs)
            copied[name] = [i.name for i in copied_inputs(inputs, MB)]
        assert copied == {"dense": [], "int4": [], "verify": [], "one-token step": []}, copied
    finally:
        eng.close()


def test_graph_recordings_are_bounded_and_all_made_before_generating(tiny_path):
    """Under CUDA graphs a graph is recorded per static address set (each layer's weights and K/V, the
    cache) and per thread. Emulated on CPU: the steps run as they do with graphs (eagerly here), and
    each piece's call is keyed by what would make cudagraph trees record (piece, width, K/V address).
    The decoder records them all on each thread before its first generation there: the keys the
    warm-up met are `recordings()` per step, and generations, on two threads, meet no other."""
    import threading

    from specter.compiled.verify_step import graph_plan

    ref = specter.load(tiny_path, device="cpu", policy="resident")
    eng = specter.load(tiny_path, device="cpu", policy="specter", residency=0.5)
    dec = eng.decoder
    draft = DraftStep(dec.model, dec.draft.layers, dec.draft.lookahead)
    verify = VerifyStep(dec.model, dec.governor.k_max)
    warm, seen, calls = set(), set(), []
    phase = {"warm": False}

    def keyed(fn, key):
        def run(*args):
            calls.append(k := (threading.get_ident(), *key(*args)))
            (warm if phase["warm"] else seen).add(k)
            return fn(*args)
        return run

    def warming(fn):
        def run(*args, **kw):
            phase["warm"] = True
            try:
                return fn(*args, **kw)
            finally:
                phase["warm"] = False
        return run

    draft._greedy = keyed(draft._greedy, lambda cache: ("greedy", cache.k[0].data_ptr()))
    draft._sampled = keyed(draft._sampled, lambda cache: ("sampled", cache.k[0].data_ptr()))
    verify.enter = keyed(verify.enter, lambda tokens, start: ("enter", tokens.shape[0]))
    verify.head = keyed(verify.head, lambda x, out, logits_for: ("head", x.shape[0]))
    verify.pre_experts = keyed(verify.pre_experts,
                               lambda layer, x, out, cos, sin, kv, start: ("moe", x.shape[0], kv.k[0].data_ptr()))
    for step in (draft, verify):
        step.graphs = True
    draft.warmup()  # the load's compile warm-up, on a scratch cache: it must record nothing, so runs
    verify.warmup()  # each graph (piece and width) once at most -- its cudagraph warm-up run
    scratch = [key[1:3] for key in calls]
    assert len(scratch) == len(set(scratch)) == 2 + 3 * 3, scratch  # greedy, sampled; 3 pieces x widths 1, 2, 4
    seen.clear()
    for step in (draft, verify):
        step.warmup = warming(step.warmup)
    dec.draft_step, dec.verify_step = draft, verify
    try:
        def generate(out: list):
            for prompt, n, k in ((PROMPT, 30, None), (PROMPT * 3, 40, 32), (PROMPT[:2], 20, 5)):
                dec.governor.fixed = k
                got = eng.generate(prompt, max_new_tokens=n, temperature=0.8 if k == 5 else 0.0, seed=2)
                out.append((got.token_ids, ref.generate(prompt, max_new_tokens=n).token_ids if k != 5 else None,
                            got.stats["cuda_graphs"]))
        dec.record_graphs()  # as a server's engine thread would before its first request
        assert len(dec.graphs.warmups) == 1 and seen == set()
        outs = []
        generate(outs)
        other = threading.Thread(target=generate, args=(outs,))
        other.start()
        other.join()
        assert len(outs) == 6
        for got, want, _ in outs:
            assert want is None or got == want
        assert seen and seen <= warm, seen - warm  # nothing recorded once generating
        per_thread = draft.recordings() + verify.recordings()
        spec = dec.model.spec
        assert per_thread == graph_plan(spec.n_layers, spec.vocab_size, spec.hidden, 32, 2)["recordings"]
        assert len(warm) == 2 * per_thread  # two threads, one cache (it never grew)
        graphs = outs[-1][2]
        assert graphs["recordings"] == 2 * per_thread and graphs["threads"] == 2 and graphs["warmups"] == 2
        assert graphs["recorded"] is None and graphs["bytes"] is None  # counted and measured on CUDA only
    finally:
        eng.close()
        ref.close()


def test_plan_says_how_many_cuda_graphs_and_their_pool(capsys):
    """`specter plan` on CUDA counts the recordings VerifyStep and DraftStep make per thread and cache
    (the bundled model: 4 layers, K_max 32), a plain policy's one-token step's, and estimates their pool."""
    import json

    from specter.cli import main
    from specter.compiled.verify_step import graph_plan

    assert main(["plan", "--device", "cuda", "--policy", "specter", "--json"]) == 0
    graphs = json.loads(capsys.readouterr().out)["cuda_graphs"]
    assert graphs["recordings"] == 6 * (4 + 2) + 2 and graphs["pool_bytes"] > 2 * 33 * 4096 * 4
    assert main(["plan", "--device", "cuda", "--policy", "specter"]) == 0
    assert "CUDA graphs (compiled draft and verifier): 38 recorded per generating thread" in capsys.readouterr().out
    assert main(["plan", "--device", "cuda", "--policy", "on-demand", "--json"]) == 0  # its one-token step
    graphs = json.loads(capsys.readouterr().out)["cuda_graphs"]
    assert graphs["recordings"] == 4 + 2 and graphs["draft"] == 0 and graphs["widths"] == 1
    assert main(["plan", "--device", "cuda", "--policy", "resident"]) == 0
    assert "CUDA graphs (compiled one-token step): 6 recorded per generating thread" in capsys.readouterr().out
    assert main(["plan", "--device", "cpu", "--policy", "specter", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cuda_graphs"] is None
    assert graph_plan(48, 151936, 2048, 32, 2)["recordings"] == 6 * 50 + 2  # Qwen3-30B-A3B's shape
