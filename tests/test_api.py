"""The public surface on the bundled default model: string prompts, stream, astream, stop
strings, stats keys, the CLI's --json, and plain-decoding equivalence of every policy."""
import asyncio
import json

import pytest

import specter
from specter.cli import main

pytestmark = pytest.mark.skipif(not (specter.default_model_path() / "model.safetensors").exists(),
                                reason="the bundled default model is not built")

PROMPT = "def fibonacci(n):"
STATS_KEYS = {"ttft_s", "tpot_s", "new_tokens", "cycles", "accepted_per_cycle", "acceptance_rate", "k_histogram",
              "expert_hits", "expert_misses", "prefetch_issued", "prefetch_used", "h2d_bytes", "stall_s",
              "draft_s", "verify_s"}


@pytest.fixture(scope="module")
def engine():
    e = specter.load(None, device="cpu", policy="resident")
    yield e
    e.close()


def test_generate_string_prompt(engine):
    out = engine.generate(PROMPT, max_new_tokens=24)
    assert 0 < len(out.token_ids) <= 24
    assert out.text == engine.decode(out.token_ids)
    assert STATS_KEYS <= set(out.stats)


def test_stream_pieces_join_to_the_text(engine):
    out = engine.generate(PROMPT, max_new_tokens=24)
    stats = {}
    pieces = list(engine.stream(PROMPT, max_new_tokens=24, stats=stats))
    assert "".join(pieces) == out.text
    assert stats["new_tokens"] == len(out.token_ids)


def test_astream(engine):
    async def collect():
        return [p async for p in engine.astream(PROMPT, max_new_tokens=16)]

    assert "".join(asyncio.run(collect())) == engine.generate(PROMPT, max_new_tokens=16).text


def test_stop_string_cuts_the_text(engine):
    full = engine.generate(PROMPT, max_new_tokens=32, stop=None).text
    stop = full.strip()[len(full.strip()) // 2:][:3]
    assume = stop and stop in full
    if not assume:
        pytest.skip("continuation too short to pick a stop string")
    out = engine.generate(PROMPT, max_new_tokens=32, stop=[stop])
    assert out.text == full[: full.find(stop)]
    assert len(out.token_ids) <= 32


def test_policies_give_resident_tokens_on_the_default_model(engine):
    want = engine.generate(PROMPT, max_new_tokens=24).token_ids
    for policy in ("on-demand", "specter"):
        e = specter.load(None, device="cpu", policy=policy, residency=0.5)
        try:
            assert e.generate(PROMPT, max_new_tokens=24).token_ids == want, policy
        finally:
            e.close()


def test_cli_generate_json(capsys):
    assert main(["generate", PROMPT, "--device", "cpu", "--policy", "resident", "--max-new-tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"text", "token_ids", "stats"} and len(out["token_ids"]) <= 8


def test_cli_generate_streams_text(capsys):
    assert main(["generate", PROMPT, "--device", "cpu", "--max-new-tokens", "8"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "TPOT" in captured.err


def test_cli_k_max(capsys):
    """--k-max 0 never speculates (every cycle is a plain step); a negative one is a one-line error."""
    argv = ["generate", PROMPT, "--device", "cpu", "--residency", "0.25", "--max-new-tokens", "8", "--json"]
    assert main(argv + ["--k-max", "0"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert set(stats["k_histogram"]) == {"0"} and stats["drafted_tokens"] == 0
    assert main(argv + ["--k-max", "-1"]) == 2
    assert "k_max must be an integer >= 0" in capsys.readouterr().err


def test_generate_summary_line():
    from specter.cli import summary_line

    base = dict(new_tokens=10, ttft_s=0.1, tpot_s=0.02, policy="specter")
    assert summary_line(base) == "[10 tokens, TTFT 100 ms, TPOT 20.0 ms (50.0 tok/s), policy specter]"
    line = summary_line(dict(base, expert_hits=1, expert_misses=3, h2d_bytes=5e6, drafted_tokens=8,
                             accepted_per_cycle=3.5, acceptance_rate=0.9))
    assert "expert hit rate 25%, 5 MB copied" in line and "3.5 drafted tokens accepted a cycle (alpha 0.90)" in line
