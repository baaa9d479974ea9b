"""specter.compiled: the draft's one-token step under torch.compile (CPU, Inductor).

1. The compiled step computes what the eager draft computes (logits to float tolerance, the same
   lookahead rows), at several positions and rows, through one graph.
2. An engine built with compile=True gives exactly the resident tokens (verification decides), and
   generations with new KV caches of other lengths do not recompile.
3. compile=True off the CPU is a clear error before anything loads.
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo.utils as dynamo_utils

import specter
from specter import builder
from specter.errors import ConfigError
from specter.layers import KVCache

PROMPT = [1, 5, 9, 33, 2, 17, 4]


@pytest.fixture(scope="module")
def compiled_engine(tmp_path_factory):
    from specter.testing import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("compiled")
    make_tiny_checkpoint(path, "qwen3_moe", eos_token_id=None)
    engine = specter.load(path, device="cpu", policy="specter", residency=0.5, compile=True)
    yield path, engine
    engine.close()


def unique_graphs() -> int:
    return dynamo_utils.counters["stats"]["unique_graphs"]


def test_compiled_step_matches_eager_draft(compiled_engine):
    _, engine = compiled_engine
    dec = engine.decoder
    model, step, la = dec.model, dec.draft_step, dec.draft.lookahead
    graphs = unique_graphs()
    caches = [KVCache(model.spec, 48, dec.device, dec.dtype) for _ in range(2)]
    for c in caches:  # the same committed prefix in both
        model(torch.tensor(PROMPT), 0, c, dec.target)
    for i, tok in enumerate([3, 60, 7, 21, 99]):
        pos = len(PROMPT) + i
        dec.draft.row = i
        want = model(torch.tensor([tok]), pos, caches[0], dec.draft)           # eager, records row i
        want_ids = la.ids[i].clone()
        la.ids[i] = -1
        got = step(torch.tensor([tok]), pos, i, caches[1])                      # compiled, records row i
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(la.ids[i], want_ids), (i, la.ids[i], want_ids)
        torch.testing.assert_close(caches[1].k[0][:, pos], caches[0].k[0][:, pos], rtol=1e-5, atol=1e-5)
    dec.draft.row = None
    assert unique_graphs() == graphs, "every row and position must replay the warm-up's graph"


def test_compiled_engine_is_lossless_and_does_not_recompile(compiled_engine):
    path, engine = compiled_engine
    ref = specter.load(path, device="cpu", policy="resident")
    calls = []
    step = engine.decoder.draft_step
    engine.decoder.draft_step = lambda *a: calls.append(a[1]) or step(*a)
    graphs = unique_graphs()
    try:
        for n in (40, 25):  # two generations, two KV cache lengths
            out = engine.generate(PROMPT, max_new_tokens=n)
            assert out.token_ids == ref.generate(PROMPT, max_new_tokens=n).token_ids, n
    finally:
        engine.decoder.draft_step = step
        ref.close()
    assert calls, "the compiled step was never used"
    assert unique_graphs() == graphs


def test_compile_off_the_cpu_or_not_a_bool_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="compile=True"):
        builder.build_engine(tmp_path, torch.device("cuda"), policy="specter", compile=True)
    with pytest.raises(ConfigError, match="compile must be True or False"):
        builder.build_engine(tmp_path, torch.device("cpu"), policy="specter", compile="yes")


def test_bench_cli_compile_flag(compiled_engine, capsys, tmp_path, monkeypatch):
    """--compile reaches the engines `specter bench` builds: the speculative one drafts through a
    compiled step, the plain one ignores it, and both give the first policy's tokens."""
    import json

    from specter.cli import main

    path, _ = compiled_engine
    built = []
    real = builder._compiled_draft_step
    monkeypatch.setattr(builder, "_compiled_draft_step", lambda *a: built.append(a) or real(*a))
    prompts = tmp_path / "prompts.json"  # the tiny checkpoint ships no tokenizer: token-id prompts
    prompts.write_text(json.dumps([PROMPT, [3, 60, 7]]))
    rc = main(["bench", "--model", str(path), "--device", "cpu", "--policies", "on-demand,specter",
               "--residency", "0.5", "--max-new-tokens", "12", "--compile", "--k-max", "4",
               "--prompts", str(prompts), "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    pols = json.loads(out)["policies"]
    assert pols["specter"]["lossless_vs_on-demand"] is True and pols["specter"]["drafted_tokens"] > 0
    assert len(built) == 1  # the specter engine's draft, and nothing for on-demand
