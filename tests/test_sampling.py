import pytest
import torch

import specter
from specter.sampling import SamplingParams, probs, sample


@pytest.fixture(scope="module")
def engine(tiny):
    path, _ = tiny("qwen3_moe")
    return specter.load(path, device="cpu", policy="resident")


def test_same_seed_same_tokens(engine):
    a = engine.generate([1, 2, 3], max_new_tokens=20, temperature=1.0, seed=7).token_ids
    b = engine.generate([1, 2, 3], max_new_tokens=20, temperature=1.0, seed=7).token_ids
    c = engine.generate([1, 2, 3], max_new_tokens=20, temperature=1.0, seed=8).token_ids
    assert a == b
    assert a != c


def test_top_k_one_is_greedy(engine):
    greedy = engine.generate([4, 5, 6], max_new_tokens=16).token_ids
    assert engine.generate([4, 5, 6], max_new_tokens=16, temperature=1.3, top_k=1, seed=1).token_ids == greedy


def test_top_p_masks_the_tail():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = probs(logits, SamplingParams(temperature=1.0, top_p=0.75))
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = probs(logits, SamplingParams(temperature=1.0, top_p=0.5))  # the top token alone reaches 0.5
    torch.testing.assert_close(p, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    p = probs(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert (p[0, :3] > 0).all() and p[0, 3] == 0


def test_top_k_masks_and_temperature_sharpens():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0]])
    p = probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all()
    torch.testing.assert_close(p[0, :2].sum(), torch.tensor(1.0))
    cold, hot = probs(logits, SamplingParams(temperature=0.5)), probs(logits, SamplingParams(temperature=2.0))
    assert cold[0, 0] > hot[0, 0]


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).repeat(20000, 1)
    params = SamplingParams(temperature=1.0, seed=0)
    counts = torch.bincount(sample(logits, params, params.draws("cpu")), minlength=3).float() / 20000
    torch.testing.assert_close(counts, torch.tensor([0.6, 0.3, 0.1]), atol=0.015, rtol=0)


# ------------------------------------------------------------------ penalties and min-p, against references
def test_repetition_penalty_and_min_p_match_transformers():
    from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

    from specter.sampling import History, penalize

    torch.manual_seed(0)
    logits = torch.randn(1, 50) * 3
    prompt, out = [3, 7, 7, 11], [20, 3, 41]
    p = SamplingParams(temperature=1.0, repetition_penalty=1.7, min_p=0.08)
    hist = History(prompt, "cpu")
    hist.commit(out)
    ref = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + out]), logits.clone())
    torch.testing.assert_close(penalize(logits, p, hist), ref)
    ref_p = torch.softmax(MinPLogitsWarper(0.08)(None, ref), -1)
    torch.testing.assert_close(probs(logits, p, hist), ref_p)
    assert (probs(logits, p, hist) == 0).sum() > 10  # min-p really dropped the tail


def test_a_huge_repetition_penalty_leaves_a_zero_logit_zero():
    """A penalty validation accepts (1e39) is inf in fp32: 0 * inf made a seen token's zero logit NaN,
    which greedy then picked (argmax) and sampling dropped. transformers divides a zero logit: 0."""
    from specter.sampling import History, penalize

    logits = torch.tensor([[0.0, 2.0, -1.0, 0.0]])
    hist = History([0, 1, 2], "cpu")
    got = penalize(logits, SamplingParams(temperature=0.0, repetition_penalty=1e39), hist)
    assert got[0, 0] == 0 and got[0, 1] == 0 and got[0, 2] == float("-inf") and got[0, 3] == 0, got
    assert probs(logits, SamplingParams(temperature=0.0, repetition_penalty=1e39), hist).argmax() == 0


def test_top_p_keeps_the_same_tokens_of_a_tie_in_any_batch():
    """Tied probabilities at the top-p boundary (common in 16-bit logits): an unstable sort may order them
    differently in a verification's [K+1, V] batch than in a plain step's [1, V], and keep other tokens."""
    logits = torch.zeros(1, 64)
    p = SamplingParams(temperature=1.0, top_p=0.5)
    one = probs(logits, p)
    assert (one[0, :32] > 0).all() and (one[0, 32:] == 0).all()  # the first of the tied tokens, in order
    assert torch.equal(probs(logits.repeat(9, 1), p), one.repeat(9, 1))


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    """OpenAI's definition: logit[j] -= frequency * count[j] + presence * (count[j] > 0), over the
    generated tokens (the prompt is not counted)."""
    from specter.sampling import History, penalize

    logits = torch.zeros(1, 8)
    hist = History([1, 2], "cpu")
    hist.commit([2, 5, 5, 5])
    got = penalize(logits, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), hist)
    want = torch.zeros(1, 8)
    want[0, 2] = -(0.5 + 0.25)
    want[0, 5] = -(0.5 + 3 * 0.25)
    torch.testing.assert_close(got, want)


def test_history_rows_see_the_drafted_prefix():
    """Row i of a K+1-row verification sees the committed history plus drafted[:i] -- what the draft
    saw when it drew drafted[i]."""
    from specter.sampling import History, penalize

    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5)
    logits = torch.randn(4, 16)
    drafted = [9, 4, 9]
    hist = History([1], "cpu")
    hist.commit([4])
    rows = penalize(logits, p, hist, drafted)
    for i in range(4):
        alone = History([1], "cpu")
        alone.commit([4] + drafted[:i])
        torch.testing.assert_close(rows[i:i + 1], penalize(logits[i:i + 1], p, alone))
        # the draft's single-row form: the last row sees every pending token
        torch.testing.assert_close(rows[i:i + 1], penalize(logits[i:i + 1], p, hist, drafted[:i]))


def test_greedy_repetition_penalty_matches_transformers(tiny):
    path, ref = tiny("qwen3_moe")
    engine = specter.load(path, device="cpu", policy="resident")
    prompt = [7, 7, 7, 1, 5]
    ours = engine.generate(prompt, max_new_tokens=20, repetition_penalty=1.4).token_ids
    theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, repetition_penalty=1.4,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs
    assert ours != engine.generate(prompt, max_new_tokens=20).token_ids  # the penalty changed something


@pytest.mark.parametrize("kw,match", [(dict(min_p=1.5), "min_p"), (dict(repetition_penalty=0), "repetition_penalty"),
                                      (dict(presence_penalty=3), "presence_penalty"),
                                      (dict(frequency_penalty=float("nan")), "frequency_penalty"),
                                      (dict(temprature=1.0), "did you mean 'temperature'")])
def test_bad_sampling_controls_are_config_errors(engine, kw, match):
    with pytest.raises(specter.ConfigError, match=match):
        engine.generate([1, 2, 3], max_new_tokens=2, **kw)


def test_numpy_scalars_are_the_numbers_they_hold(engine):
    """A sweep's numpy values (np.float32 temperature, np.int64 top_k and seed) were refused as if out of
    range ("temperature must be a finite number >= 0 ... got np.float32(0.7)"); np.float64 passed."""
    import numpy as np

    from specter.sampling import SamplingParams

    p = SamplingParams(temperature=np.float32(0.75), top_p=np.float16(0.5), top_k=np.int64(5), seed=np.uint32(3),
                       min_p=np.float32(0.25), repetition_penalty=np.int8(2), presence_penalty=np.float32(-1.5))
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.min_p, p.repetition_penalty, p.presence_penalty) == \
        (0.75, 0.5, 5, 3, 0.25, 2.0, -1.5)
    assert all(type(v) in (int, float) for v in (p.temperature, p.top_p, p.top_k, p.seed, p.repetition_penalty))
    kw = dict(temperature=0.75, top_k=5, seed=3)
    want = engine.generate([1, 2, 3], max_new_tokens=6, **kw).token_ids
    got = engine.generate([1, 2, 3], max_new_tokens=np.int64(6), temperature=np.float32(0.75), top_k=np.int64(5),
                          seed=np.int64(3))
    assert got.token_ids == want and got.stats["new_tokens"] == 6
    for bad in (dict(top_k=np.float32(2.0)), dict(temperature=np.float32("nan")), dict(seed=np.bool_(True)),
                dict(top_k=True)):
        with pytest.raises(specter.ConfigError):
            SamplingParams(**bad)


def test_a_filter_without_a_temperature_is_warned_at_the_callers_line(engine, capsys):
    """top_p / top_k / min_p alone leave the neutral temperature 0, greedy, which they do not change: it
    was silent (the server's default temperature is 1, the API's and CLI's 0). Warned, at the caller's
    own line (a SpecterWarning; the CLI prints it as one line); not where a temperature is given, even
    0, or for top_k 1 (greedy by itself)."""
    import warnings

    from specter.cli import main
    from specter.errors import SpecterWarning

    with pytest.warns(SpecterWarning,
                      match=r"top_p \(--top-p\) and min_p \(--min-p\) have no effect without a temperature") as seen:
        engine.generate([1, 2, 3], max_new_tokens=2, top_p=0.9, min_p=0.1)
    assert [w.filename for w in seen] == [__file__]
    with pytest.warns(SpecterWarning, match=r"top_k \(--top-k\) has no effect") as seen:
        list(engine.stream_ids([1, 2, 3], max_new_tokens=2, top_k=5))
    assert [w.filename for w in seen] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for kw in (dict(top_p=0.9, temperature=0.0), dict(top_p=0.9, temperature=0.7), dict(top_k=1), dict(seed=3),
                   {}):
            engine.generate([1, 2, 3], max_new_tokens=2, **kw)
    assert main(["generate", "--prompt-ids", "1,2,3", "--device", "cpu", "--policy", "resident", "--top-k", "5",
                 "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "specter: warning: top_k (--top-k) has no effect without a temperature" in err
    assert "SpecterWarning" not in err


def test_seeds_never_touch_the_global_rng(engine):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    engine.generate([1, 2, 3], max_new_tokens=8, temperature=1.0)            # seed=None: a fresh seed
    engine.generate([1, 2, 3], max_new_tokens=8, temperature=1.0, seed=5)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.initial_seed() == 123
