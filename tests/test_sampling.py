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
    counts = torch.bincount(sample(logits, params, params.generator("cpu")), minlength=3).float() / 20000
    torch.testing.assert_close(counts, torch.tensor([0.6, 0.3, 0.1]), atol=0.015, rtol=0)
