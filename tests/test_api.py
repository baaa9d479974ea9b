"""The public surface on the bundled default model: string prompts, stream, astream, stop
strings, stats keys, the CLI's --json, and plain-decoding equivalence of every policy."""
import asyncio
import json
import random
import threading

import pytest

import specter
from specter.cli import main
from specter.speculative.governor import Governor

pytestmark = pytest.mark.skipif(not (specter.default_model_path() / "model.safetensors").exists(),
                                reason="the bundled default model is not built")

PROMPT = "def fibonacci(n):"
STATS_KEYS = {"ttft_s", "tpot_s", "new_tokens", "cycles", "accepted_per_cycle", "acceptance_rate", "k_histogram",
              "expert_hits", "expert_misses", "prefetch_issued", "prefetch_used", "h2d_bytes", "stall_s",
              "draft_s", "verify_s"}
GREEDY = dict(temperature=0.0)  # the bundled model's own settings sample: comparisons of tokens ask for greedy


def fix_k(engine, k: int = 4):
    """Draft K tokens every cycle. The governor chooses K by measured time, so on a busy machine it may
    decode plainly for a whole generation; a test that needs speculation to happen fixes K."""
    engine.decoder.governor = Governor(engine.decoder.governor.k_max, fixed=k)
    return engine


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
    out = engine.generate(PROMPT, max_new_tokens=24, seed=3)  # the model's own settings, one draw
    stats = {}
    pieces = list(engine.stream(PROMPT, max_new_tokens=24, stats=stats, seed=3))
    assert "".join(pieces) == out.text
    assert stats["new_tokens"] == len(out.token_ids)


def test_astream(engine):
    async def collect():
        return [p async for p in engine.astream(PROMPT, max_new_tokens=16, seed=3)]

    assert "".join(asyncio.run(collect())) == engine.generate(PROMPT, max_new_tokens=16, seed=3).text


def test_stop_string_cuts_the_text(engine):
    full = engine.generate(PROMPT, max_new_tokens=32, stop=None, **GREEDY).text
    stop = full.strip()[len(full.strip()) // 2:][:3]
    assume = stop and stop in full
    if not assume:
        pytest.skip("continuation too short to pick a stop string")
    out = engine.generate(PROMPT, max_new_tokens=32, stop=[stop], **GREEDY)
    assert out.text == full[: full.find(stop)]
    assert len(out.token_ids) <= 32


def test_policies_give_resident_tokens_on_the_default_model(engine):
    want = engine.generate(PROMPT, max_new_tokens=24, **GREEDY).token_ids
    for policy in ("on-demand", "specter"):
        e = specter.load(None, device="cpu", policy=policy, residency=0.5)
        try:
            assert e.generate(PROMPT, max_new_tokens=24, **GREEDY).token_ids == want, policy
        finally:
            e.close()


def test_cli_generate_json(capsys):
    assert main(["generate", PROMPT, "--device", "cpu", "--policy", "resident", "--max-new-tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"text", "token_ids", "stats"} and len(out["token_ids"]) <= 8


def test_cli_generate_streams_text(capsys):
    assert main(["generate", PROMPT, "--device", "cpu", "--max-new-tokens", "8", "--seed", "0"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "TPOT" in captured.err


def test_cli_k_max(capsys):
    """--k-max 0 never speculates (every cycle is a plain step); a negative one is a one-line error."""
    argv = ["generate", PROMPT, "--device", "cpu", "--residency", "0.25", "--max-new-tokens", "8", "--json"]
    assert main(argv + ["--k-max", "0"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert set(stats["k_histogram"]) == {"0"} and stats["drafted_tokens"] == 0
    with pytest.raises(SystemExit) as e:  # argparse's refusal (--k-max takes integers >= 0)
        main(argv + ["--k-max", "-1"])
    assert e.value.code == 2 and "--k-max: expected an integer >= 0, got -1" in capsys.readouterr().err


def test_generate_summary_line():
    from specter.cli import summary_line

    base = dict(new_tokens=10, ttft_s=0.1, tpot_s=0.02, policy="specter")
    assert summary_line(base) == "[10 tokens, TTFT 100 ms, TPOT 20.0 ms (50.0 tok/s), policy specter]"
    assert summary_line(dict(base, new_tokens=1)) == "[1 token, TTFT 100 ms, TPOT n/a (one token), policy specter]"
    line = summary_line(dict(base, expert_hits=1, expert_misses=3, h2d_bytes=5e6, drafted_tokens=8,
                             accepted_per_cycle=3.5, acceptance_rate=0.9))
    assert "expert hit rate 25%, 5 MB copied" in line and "3.5 drafted tokens accepted a cycle (alpha 0.90)" in line
    line = summary_line(dict(base, expert_hits=1, expert_misses=3, tier_hits=2, h2d_bytes=1e6))  # the coded tier's
    assert "expert hit rate 75% (2 decoded from the coded tier), 1 MB copied" in line  # hits are on the device
    line = summary_line(dict(base, expert_hits=1, expert_misses=3, h2d_bytes=0, host_bytes=64e6))  # policy host's
    assert "expert hit rate 25%, 0 MB copied, 64 MB of experts computed on the host" in line  # lane (it said 0 MB)
    assert "seed 7" in summary_line(dict(base, seed=7)) and "seed" not in summary_line(dict(base, seed=None))


# --------------------------------------------------------------- one engine, many callers; stop strings
@pytest.fixture(scope="module")
def spec_engine():
    """Speculating every cycle (K fixed): its tests check what speculation commits (multi-token
    chunks, stop strings inside them, drafted-token stats), whatever the machine's load."""
    e = fix_k(specter.load(None, device="cpu", policy="specter", residency=0.5))
    yield e
    e.close()


PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n", "for i in range(10):"]


@pytest.mark.parametrize("which", ["specter greedy", "resident seeded"])
def test_concurrent_generations_give_their_solo_texts(engine, spec_engine, which):
    """Threads and astreams on one engine share its slot pool, planner and cache: they take turns,
    and each gets exactly the text it gets alone. (Seeded sampling under speculation depends on the
    governor's K choices, so its seeded runs are compared on `resident`.)"""
    import threading

    eng = spec_engine if which == "specter greedy" else engine
    kws = [GREEDY, dict(repetition_penalty=1.3), dict(frequency_penalty=0.5), GREEDY] if eng is spec_engine else \
        [dict(temperature=0.9, seed=3), dict(temperature=1.0, seed=4, min_p=0.05), dict(temperature=0.8, seed=5),
         dict(temperature=1.2, seed=6)]
    solo = [eng.generate(p, max_new_tokens=20, **kw).text for p, kw in zip(PROMPTS, kws)]
    got = {}

    def worker(i):
        got[i] = eng.generate(PROMPTS[i], max_new_tokens=20, **kws[i]).text

    async def streams():
        async def one(i):
            return "".join([p async for p in eng.astream(PROMPTS[i], max_new_tokens=20, **kws[i])])
        return await asyncio.gather(one(2), one(3))

    threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    got[2], got[3] = asyncio.run(streams())
    for t in threads:
        t.join(timeout=120)
    assert [got.get(i) for i in range(4)] == solo


def test_a_stream_in_progress_refuses_a_nested_generation_in_its_thread(engine):
    it = engine.stream(PROMPT, max_new_tokens=8)
    next(it)
    with pytest.raises(specter.ConfigError, match="finish or close that stream"):
        engine.generate(PROMPT, max_new_tokens=2)
    it.close()
    assert engine.generate(PROMPT, max_new_tokens=2).token_ids  # the turn was handed back


def test_leaving_an_astream_early_frees_the_engine(engine):
    async def first_piece():
        async for piece in engine.astream(PROMPT, max_new_tokens=64):
            return piece

    assert asyncio.run(first_piece())
    done = []
    import threading

    t = threading.Thread(target=lambda: done.append(engine.generate(PROMPT, max_new_tokens=4)))
    t.start()
    t.join(timeout=60)
    assert done, "the abandoned astream kept the engine"
    assert engine.turns.waiting == 0


@pytest.mark.parametrize("policy", ["resident", "on-demand"])
def test_an_astream_abandoned_at_the_loops_end_stops_before_the_next_generation(policy):
    """Breaking out of an astream and leaving asyncio.run: the stream is closed by a task that asyncio.run
    cancels at its end, and its generation thread must still end before the engine's turn is handed on
    (it went on decoding beside the next generation, whose greedy tokens then differed on on-demand)."""
    e = specter.load(None, device="cpu", policy=policy, residency=None if policy == "resident" else 0.25)
    try:
        want = e.generate(PROMPT, max_new_tokens=32, **GREEDY).token_ids

        async def first_piece():
            async for piece in e.astream(PROMPT, max_new_tokens=64, **GREEDY):
                return piece

        def generating() -> list:
            return [t for t in threading.enumerate() if t.name == "specter-generation" and t.is_alive()]

        for _ in range(3):
            assert asyncio.run(first_piece())
            assert not generating()
            assert e.generate(PROMPT, max_new_tokens=32, **GREEDY).token_ids == want

        async def cancelled_twice():
            """A task consuming a stream, cancelled, and cancelled again while it closes the stream."""
            first = asyncio.Event()

            async def consume():
                async for _ in e.astream(PROMPT, max_new_tokens=64, **GREEDY):
                    first.set()

            task = asyncio.create_task(consume())
            await first.wait()
            task.cancel()
            for _ in range(3):  # the stream's cleanup is waiting for the thread now (a cycle): cancel it there
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return generating()

        assert asyncio.run(cancelled_twice()) == []
        assert e.generate(PROMPT, max_new_tokens=32, **GREEDY).token_ids == want
    finally:
        e.close()


def _stops(engine):
    """Stop strings from the greedy continuation: one starting on a token boundary, one inside a token."""
    full = engine.generate(PROMPT, max_new_tokens=32, **GREEDY)
    ids, text = full.token_ids, full.text

    def first_here(i):  # token i has >= 3 chars, and both stops first occur where token i starts (resp. +1)
        at = len(engine.decode(ids[:i]))
        return (len(engine.decode(ids[i:i + 1])) >= 3 and text.find(text[at:at + 4]) == at
                and text.find(text[at + 1:at + 5]) == at + 1)

    b = next(i for i in range(2, len(ids)) if first_here(i))
    at = len(engine.decode(ids[:b]))
    return text, at, [text[at:at + 4], text[at + 1:at + 5]]


def test_stop_string_cuts_text_and_token_ids_alike(engine, spec_engine):
    full, at, (boundary, inside) = _stops(engine)
    for stop in (boundary, inside):
        hit = full.find(stop)
        out = engine.generate(PROMPT, max_new_tokens=32, stop=stop, **GREEDY)
        assert out.text == full[:hit], stop
        shown = engine.decode(out.token_ids)
        assert shown.startswith(out.text) and len(engine.decode(out.token_ids[:-1])) < len(out.text), stop
        if hit == at:  # the stop starts where a token starts: the ids decode to the text exactly
            assert shown == out.text
        # streamed: never a character of the stop string, pieces join to the text
        pieces = list(engine.stream(PROMPT, max_new_tokens=32, stop=[stop], **GREEDY))
        assert "".join(pieces) == out.text, (stop, pieces)
        ids = [t for chunk in engine.stream_ids(PROMPT, max_new_tokens=32, stop=stop, **GREEDY) for t in chunk]
        assert ids == out.token_ids
        # the same ids under speculation (whole multi-token chunks are committed at once)
        spec = spec_engine.generate(PROMPT, max_new_tokens=32, stop=stop, **GREEDY)
        assert (spec.text, spec.token_ids) == (out.text, out.token_ids)
        assert "".join(spec_engine.stream(PROMPT, max_new_tokens=32, stop=stop, **GREEDY)) == out.text


class _Chunks:
    """A decoder that commits the given chunks of token ids, whatever the prompt: the engine's own text
    path (stop strings, Printer, stream_ids) on exact id sequences, as one token a step (resident) or
    several a cycle (speculation) would commit them."""

    def __init__(self, real, chunks):
        self.real, self.chunks, self.context = real, chunks, real.context

    def reset_stats(self):
        pass

    def stats(self):
        return {}

    def run(self, ids, params, max_new):
        yield from (list(c) for c in self.chunks)


def _byte_ids(engine, text: str) -> list[int]:
    """One token a UTF-8 byte (the byte-level BPE's 256 byte tokens): a character split over tokens."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2's byte -> symbol table:
    others = [b for b in range(256) if b not in printable]             # printable bytes stand for themselves,
    symbol = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}  # others 256+
    vocab = engine.tokenizer.get_vocab()
    return [vocab[symbol[b]] for b in text.encode()]


def _run(engine, chunks, stop):
    """(generate's output, stream's pieces, stream_ids' ids) for the chunks."""
    real, engine.decoder = engine.decoder, _Chunks(engine.decoder, chunks)
    try:
        out = engine.generate([5], max_new_tokens=200, stop=stop, **GREEDY)
        pieces = list(engine.stream([5], max_new_tokens=200, stop=stop, **GREEDY))
        ids = [t for c in engine.stream_ids([5], max_new_tokens=200, stop=stop, **GREEDY) for t in c]
    finally:
        engine.decoder = real
    return out, pieces, ids


@pytest.mark.parametrize("stop", ["\u00e9", "a\u00e9", "\u20ac", "\U0001f600", "\ufffd"])
def test_a_stop_split_over_byte_tokens_cuts_as_one_chunk_does(engine, stop):
    """A stop ending in a multi-byte character that arrives a byte a token was never matched: the scan
    skipped the U+FFFD of the incomplete character. Nor may "\ufffd" match a character still arriving."""
    enc = lambda t: engine.tokenizer(t)["input_ids"]  # noqa: E731
    ch = "\u00e9" if stop == "\ufffd" else stop[-1]
    seq = enc("x = 1") + _byte_ids(engine, "a" + ch) + enc(" + y")
    full = engine.decode(seq)
    want = full if stop == "\ufffd" else full[:full.find(stop)]
    for chunks in ([[t] for t in seq], [seq]):  # one token a chunk, one chunk
        out, pieces, ids = _run(engine, chunks, [stop])
        assert out.text == want and out.stats["finish_reason"] == ("length" if stop == "\ufffd" else "stop")
        assert "".join(pieces) == want and ids == out.token_ids
        assert engine.decode(out.token_ids).startswith(want) and "\ufffd" not in engine.decode(out.token_ids)


def test_token_ids_never_end_inside_a_character(engine):
    """tokens h, 0xC3, 0xA9 (\u00e9), llo and stop "l": token_ids were [h, 0xC3], half a character, and
    stream_ids did not join to them."""
    enc = lambda t: engine.tokenizer(t)["input_ids"]  # noqa: E731
    seq = enc("h") + _byte_ids(engine, "\u00e9") + enc("llo")
    for chunks in ([[t] for t in seq], [seq]):
        out, pieces, ids = _run(engine, chunks, ["l"])
        assert (out.text, out.token_ids) == ("h\u00e9", seq[:3]) and ids == seq[:3] and "".join(pieces) == "h\u00e9"


@pytest.mark.parametrize("stops", [["x = 1", " ="], ["= 1\n", " "], ["na\u00efv", "\u00ef", "\u00efve"]])
def test_the_stop_that_ends_first_wins_however_tokens_are_chunked(engine, stops):
    """Within a chunk the stop that started first won, across chunks the one that ended first: resident
    and speculation cut the same greedy tokens differently. Now the one that ends first (a tie: the
    longer), what a token at a time finds."""
    enc = lambda t: engine.tokenizer(t)["input_ids"]  # noqa: E731
    seq = enc("y\nx = 1\n") + _byte_ids(engine, "na\u00efve") + enc(" end")
    full = engine.decode(seq)
    want = full[:min((full.find(s) + len(s), full.find(s)) for s in stops if s in full)[1]]
    for chunks in ([[t] for t in seq], [seq], [seq[:3], seq[3:7], seq[7:]]):
        out, pieces, ids = _run(engine, chunks, stops)
        assert out.text == want and "".join(pieces) == want and ids == out.token_ids, chunks


def test_tokens_for_and_within_under_byte_fallback():
    """A byte-fallback tokenizer (Llama, Mixtral) decodes each pending byte of a character as its own
    U+FFFD, so a prefix's text gets shorter when the character completes: the bisection over prefixes
    took a token inside a character."""
    import codecs

    from specter.streaming import tokens_for, tokens_within

    def decode(ids):  # ids are bytes: complete characters, then one U+FFFD a pending byte
        d = codecs.getincrementaldecoder("utf-8")()
        text = d.decode(bytes(ids))
        return text + "\ufffd" * len(d.getstate()[0])

    ids = list("xa\u20ac!b\U0001f600c".encode())
    text = decode(ids)
    starts = [len(decode(ids[:j])) for j in range(len(ids) + 1) if not decode(ids[:j]).endswith("\ufffd")]
    for n in range(len(text) + 1):
        j = tokens_for(decode, ids, n)
        assert not decode(ids[:j]).endswith("\ufffd") and len(decode(ids[:j])) >= n
        assert len(decode(ids[:j])) == min(c for c in starts if c >= n)
        k = tokens_within(decode, ids, n)
        assert len(decode(ids[:k]).rstrip("\ufffd")) <= n and (k == len(ids) or len(decode(ids[:k + 1])
                                                                                       .rstrip("\ufffd")) > n
                                                                  or decode(ids[:k + 1]).endswith("\ufffd"))


def test_held_back():
    from specter.streaming import held_back

    assert held_back("abc k.c", ["k.ca"]) == 3 and held_back("abc k", ["k.ca", "zz"]) == 1
    assert held_back("abc", ["k.ca"]) == 0 and held_back("", ["ab"]) == 0 and held_back("a", ["a"]) == 0
    # against its definition, every k tried, on texts and stops over two or three letters (overlaps abound)
    rng = random.Random(0)
    for n in range(3000):
        letters = "ab" if n % 2 else "abc"
        word = lambda lo, hi: "".join(rng.choice(letters) for _ in range(rng.randrange(lo, hi)))  # noqa: E731
        text, stops = word(0, 12), [word(1, 8) for _ in range(rng.randrange(1, 4))]
        want = max((k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])),
                   default=0)
        assert held_back(text, stops) == want, (text, stops)


def test_stats_are_none_where_not_applicable(engine, spec_engine):
    e = specter.load(None, device="cpu", policy="on-demand", residency=0.5)
    try:
        s = e.generate(PROMPT, max_new_tokens=6).stats
    finally:
        e.close()
    for k in ("acceptance_rate", "draft_efficiency", "accepted_per_cycle", "prefetch_recall", "route_coverage"):
        assert s[k] is None and engine.generate(PROMPT, max_new_tokens=3).stats[k] is None, k
    s = spec_engine.generate(PROMPT, max_new_tokens=24).stats
    assert s["drafted_tokens"] and 0 <= s["acceptance_rate"] <= 1 and 0 <= s["route_coverage"] <= 1
    e = fix_k(specter.load(None, device="cpu", policy="spec-lru", residency=0.5))
    try:
        s = e.generate(PROMPT, max_new_tokens=24).stats
    finally:
        e.close()
    assert s["drafted_tokens"] and s["prefetch_issued"] == 0 and s["prefetch_recall"] is None
    one = engine.generate(PROMPT, max_new_tokens=1).stats  # no token after the first: no TPOT (it was the
    assert one["generated_tokens"] == 1 and one["tpot_s"] == 0.0, one  # bookkeeping after it, divided by 1)


def test_every_policy_reports_one_stats_schema(engine):
    """`out.stats["host_experts"]` raised KeyError on resident, `recall_total` on on-demand (a QA pass):
    each policy reported its own keys, though one schema is documented. Every key is reported now, 0 or
    None where nothing happened; `h2d_path` is None where nothing was copied (host: misses computed there)."""
    stats = {"resident": engine.generate(PROMPT, max_new_tokens=4, **GREEDY).stats}
    for policy in ("on-demand", "host", "spec-lru", "specter"):
        e = specter.load(None, device="cpu", policy=policy, residency=0.25)
        try:
            stats[policy] = e.generate(PROMPT, max_new_tokens=4, **GREEDY).stats
        finally:
            e.close()
    cancel, early = threading.Event(), {}  # cancelled before its turn: the same keys
    cancel.set()
    assert list(engine.stream(PROMPT, max_new_tokens=4, stats=early, cancel=cancel, **GREEDY)) == []
    stats["cancelled"] = early
    keys = {p: set(s) - {"pipeline"} for p, s in stats.items()}
    assert all(k == keys["specter"] for k in keys.values()), {p: k ^ keys["specter"] for p, k in keys.items()}
    assert stats["host"]["h2d_bytes"] == 0 and stats["host"]["h2d_path"] is None
    assert stats["on-demand"]["h2d_bytes"] > 0 and stats["on-demand"]["h2d_path"]


def test_token_ids_of_numpy_and_torch_and_bad_arguments(engine):
    """numpy's and torch's integers are token ids as ints are (numpy's max_new_tokens already was); a
    prompt that is not one says what it got; `cancel` and `stats` of the wrong type, a stop string
    no text holds (a lone surrogate) and an unknown eviction rule are SpecterErrors, not AttributeError,
    ValueError or a stop that silently never matches."""
    import numpy as np
    import torch

    want = engine.generate([1, 2, 3, 4], max_new_tokens=3, **GREEDY).token_ids
    for ids in ([np.int64(1), np.int32(2), 3, 4], np.array([1, 2, 3, 4]), torch.tensor([1, 2, 3, 4]),
                [torch.tensor(t) for t in (1, 2, 3, 4)]):
        assert engine.generate(ids, max_new_tokens=3, **GREEDY).token_ids == want
    for bad, got in (([1.0, 2.0], "got list of float"), (torch.tensor([[1, 2]]), "got Tensor"),
                     ([True, 2], "got list of bool, int"), (np.array([0.5]), "got ndarray"), (3, "got int")):
        with pytest.raises(specter.ConfigError, match=got):
            engine.generate(bad, max_new_tokens=2)
    for kw, what in ((dict(cancel=True), "cancel must be a threading.Event"), (dict(stats=[]), "stats must be a dict")):
        with pytest.raises(specter.ConfigError, match=what):
            next(engine.stream(PROMPT, max_new_tokens=2, **kw))
    with pytest.raises(specter.ConfigError, match="stop string .* not valid Unicode"):
        engine.generate(PROMPT, max_new_tokens=2, stop="\ud800")
    with pytest.raises(specter.ConfigError, match="eviction must be one of lru, lfu"):
        specter.load(None, device="cpu", policy="on-demand", residency=0.25, eviction="fifo")
    assert engine.generate(PROMPT, max_new_tokens=2).stats["new_tokens"] == 2  # (the engine is fine)


@pytest.mark.parametrize("how", ["break", "astream"])
def test_leaving_a_stream_early_still_reports_how_it_ended(engine, how):
    """After a `break` out of stream() (or astream's), `stats` held only the sampling settings: no
    finish_reason, no counts. Leaving early is a cancellation: finish_reason "cancelled", and the stats
    of what ran."""
    stats = {}
    if how == "break":
        for _ in engine.stream(PROMPT, max_new_tokens=32, stats=stats, **GREEDY):
            break
    else:
        async def first():
            run = engine.astream(PROMPT, max_new_tokens=32, stats=stats, **GREEDY)
            async for _ in run:
                break
            await run.aclose()

        asyncio.run(first())
    assert stats["finish_reason"] == "cancelled" and 1 <= stats["new_tokens"] < 32, stats
    assert set(stats) >= set(STATS_KEYS)


def test_a_sampled_generation_reports_its_seed_and_repeats_with_it(engine):
    """Without a seed a sampled generation draws a fresh one; the stats say which, so passing it back
    repeats the generation (greedy: None)."""
    a = engine.generate(PROMPT, max_new_tokens=8, temperature=1.0)
    b = engine.generate(PROMPT, max_new_tokens=8, temperature=1.0)
    assert isinstance(a.stats["seed"], int) and 0 <= a.stats["seed"] < 2 ** 53 and a.stats["seed"] != b.stats["seed"]
    assert engine.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=a.stats["seed"]).token_ids == a.token_ids
    assert engine.generate(PROMPT, max_new_tokens=2, seed=7, temperature=1.0).stats["seed"] == 7
    assert engine.generate(PROMPT, max_new_tokens=2, **GREEDY).stats["seed"] is None


def test_finish_reason_and_cancel(engine):
    import threading

    assert engine.generate(PROMPT, max_new_tokens=4).stats["finish_reason"] == "length"
    full = engine.generate(PROMPT, max_new_tokens=16, **GREEDY).text
    assert engine.generate(PROMPT, max_new_tokens=16, stop=full[3:6], **GREEDY).stats["finish_reason"] == "stop"
    cancel, stats = threading.Event(), {}
    pieces = []
    for piece in engine.stream(PROMPT, max_new_tokens=64, stats=stats, cancel=cancel, **GREEDY):
        pieces.append(piece)
        cancel.set()  # e.g. the client went away: the generation ends at its next cycle
    assert stats["finish_reason"] == "cancelled" and stats["new_tokens"] <= 3, stats
    assert "".join(pieces) == full[:len("".join(pieces))]


def test_streaming_prints_the_text_before_an_incomplete_character(engine):
    """A chunk ending in the first byte of a character held back the whole chunk's text until the
    character completed; the complete text before it is final and is printed at once."""
    enc = lambda t: engine.tokenizer(t)["input_ids"]  # noqa: E731
    hello, emoji = enc("Hello"), _byte_ids(engine, "\U0001f600")
    chunks = [hello + emoji[:1], emoji[1:3], emoji[3:], enc("!")]
    out, pieces, ids = _run(engine, chunks, [])
    assert pieces == ["Hello", "\U0001f600", "!"] and ids == out.token_ids == [t for c in chunks for t in c]
    real, engine.decoder = engine.decoder, _Chunks(engine.decoder, chunks)
    try:
        streamed = list(engine.stream_ids([5], max_new_tokens=200, **GREEDY))
    finally:
        engine.decoder = real
    assert streamed == [hello, emoji, enc("!")]


def test_cuda_device_is_the_engines_on_every_thread_that_runs_it(monkeypatch):
    """A thread's current CUDA device starts as 0 and Triton launches on it: an engine on cuda:1 ran its
    kernels and recorded its lookahead events on device 0. The build, each generation's thread (the
    caller's, or astream's own) and each offload thread (its creator's device) make the engine's current."""
    import contextlib

    import torch

    import specter.builder as builder
    import specter.engine as engine_mod
    from specter.offload import threads

    assert isinstance(threads.cuda_device(torch.device("cpu")), contextlib.nullcontext)
    assert isinstance(threads.cuda_device(torch.device("cuda")), contextlib.nullcontext)  # the current one
    assert threads.cuda_device(torch.device("cuda", 1)).idx == 1
    seen, held = [], []

    @contextlib.contextmanager
    def record(device):
        seen.append((device, threading.current_thread().name))
        held.append(device)
        try:
            yield
        finally:
            held.pop()

    monkeypatch.setattr(builder, "cuda_device", record)
    monkeypatch.setattr(engine_mod, "cuda_device", record)
    e = specter.load(None, device="cpu", policy="resident")
    try:
        main_thread = threading.current_thread().name
        assert seen and set(seen) == {(e.device, main_thread)}  # the build (and load_shared within it)
        del seen[:]
        e.generate(PROMPT, max_new_tokens=2)
        assert seen and set(seen) == {(e.device, main_thread)}
        del seen[:]
        real_run, steps = e.decoder.run, []

        def run(*a):  # each decoding step on the engine's device
            for chunk in real_run(*a):
                steps.append(list(held))
                yield chunk

        e.decoder.run = run
        for _ in e.stream(PROMPT, max_new_tokens=4, **GREEDY):  # the caller's code between pieces: its own device
            assert held == []
        del e.decoder.run
        assert len(steps) >= 2 and all(h == [e.device] for h in steps)
        assert seen and set(seen) == {(e.device, main_thread)}
        del seen[:]

        async def drain():
            return [p async for p in e.astream(PROMPT, max_new_tokens=2)]

        asyncio.run(drain())
        assert seen and set(seen) == {(e.device, "specter-generation")}
    finally:
        e.close()
    # an offload thread takes its creator's device
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append((d, threading.current_thread().name)))

    class Owner:
        def close(self):
            pass

    threads.daemon(lambda: None, "specter-test-thread", Owner()).join()
    assert seen[-1] == (3, "specter-test-thread")


def test_a_generation_cut_short_recovers_the_slot_cache(monkeypatch):
    """An exception out of a generation (a Ctrl-C anywhere in a layer's copies) may leave a slot reserved
    with no copy coming; the engine has the expert provider recover (offload manager: free such slots)
    before it re-raises, and the next generation is the same tokens."""
    e = specter.load(None, device="cpu", policy="on-demand", residency=0.25)
    try:
        want = e.generate(PROMPT, max_new_tokens=12, **GREEDY).token_ids
        mgr = e.decoder.experts
        layer, free = next((l, x) for l in range(mgr.slots.n_layers) for x in range(mgr.slots.n_experts)
                           if mgr.slots.slot[l][x] < 0)
        real_call, recovered = type(mgr).__call__, []

        def cut(self, layer_, *a, **kw):  # a reservation left with no copy, then a Ctrl-C
            self.slots.reserve(layer, free)
            raise KeyboardInterrupt

        monkeypatch.setattr(type(mgr), "__call__", cut)
        monkeypatch.setattr(mgr, "recover", lambda: (recovered.append(1), type(mgr).recover(mgr)))
        with pytest.raises(KeyboardInterrupt):
            e.generate(PROMPT, max_new_tokens=12, **GREEDY)
        monkeypatch.setattr(type(mgr), "__call__", real_call)
        assert recovered and mgr.slots.slot[layer][free] < 0
        assert e.generate(PROMPT, max_new_tokens=12, **GREEDY).token_ids == want
    finally:
        e.close()


def test_a_dropped_engine_stops_its_threads_and_close_mid_generation_cancels_it(engine):
    """An engine dropped without close() kept its link and host-lane threads (and the store they hold)
    until exit: 2 threads and ~21 MiB an engine (a resource QA pass). They stop when it is collected.
    close() from another thread, or with a stream left suspended, made the generation raise a bare
    RuntimeError from the closed link: it ends as cancelled. Stats' {} and [] are each generation's own."""
    import gc
    import weakref

    def ours():
        return {t for t in threading.enumerate() if t.name.startswith(("specter-link", "specter-host"))}

    before = ours()
    e = specter.load(None, device="cpu", policy="specter", residency=0.25)
    assert e.generate(PROMPT, max_new_tokens=4, **GREEDY).token_ids and ours() - before
    gone = weakref.ref(e)
    del e
    gc.collect()
    assert gone() is None and ours() == before

    for policy, kw in (("specter", dict(residency=0.25)), ("resident", {})):  # (resident: no link to close)
        e = specter.load(None, device="cpu", policy=policy, **kw)
        stats = {}
        pieces = e.stream(PROMPT, max_new_tokens=64, stats=stats, **GREEDY)
        next(pieces)
        e.close()  # a stream left suspended
        rest = list(pieces)
        assert stats["finish_reason"] == "cancelled" and stats["generated_tokens"] < 64, (policy, rest, stats)
        with pytest.raises(specter.ConfigError, match="closed"):
            e.generate(PROMPT, max_new_tokens=2)

    with specter.load(None, device="cpu", policy="resident") as e:  # a context manager closes it
        assert e.generate(PROMPT, max_new_tokens=2, **GREEDY).token_ids and not e.closed
    assert e.closed

    first = engine.generate(PROMPT, max_new_tokens=2, **GREEDY).stats
    first["k_histogram"]["mine"] = 1
    first["compiled"].append("mine")
    again = engine.generate(PROMPT, max_new_tokens=2, **GREEDY).stats
    assert again["k_histogram"] == {} and again["compiled"] == []


THREADS_PUT_BACK = """
import gc, torch, specter
torch.set_num_threads(2)
a = specter.load(None, device="cpu", policy="resident", threads=1)
assert torch.get_num_threads() == 1
b = specter.load(None, device="cpu", policy="on-demand", residency=0.5, threads=1)
b.close()
b.close()  # (twice: released once)
assert torch.get_num_threads() == 1  # a is still open
a.close()
assert torch.get_num_threads() == 2
c = specter.load(None, device="cpu", policy="resident", threads=1)
assert c.generate("def f", max_new_tokens=2).token_ids and torch.get_num_threads() == 1
del c
gc.collect()
assert torch.get_num_threads() == 2  # dropped without close(): collected, put back too
from specter.bench import run_bench  # bench's one load for every policy sets them too
run_bench(None, ["on-demand", "specter"], prompts=[[1, 2, 3]], max_new_tokens=2, device="cpu", residency=0.5,
          threads=1, warmup=False)
assert torch.get_num_threads() == 2
print("ok")
"""


def test_closing_the_last_cpu_engine_puts_torchs_threads_back():
    """load() sets torch's (process-wide) threads on CPU and close() left them so: a user's
    torch.set_num_threads(2) read 1 after load + close. The last engine to close, or to be collected,
    puts back what they were before the first (in a process of its own: no other engine open)."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", THREADS_PUT_BACK], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]
