"""Decode TPOT of Specter's `resident` policy beside transformers' own `generate`, same checkpoint
(the bundled default model), same prompt, same thread count, fp32 on CPU, measured in one run.

    python -m pytest bench/test_decode_tpot.py --benchmark-only --benchmark-group-by=group

Both generate exactly N greedy tokens (EOS disabled), so mean time / N is the per-token cost
including prefill; the prefill share is small at N = 128.
"""
import pytest
import torch

import specter

N = 128
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def engine():
    e = specter.load(None, device="cpu", policy="resident")
    e.model.spec.eos_token_ids = []  # exactly N tokens
    return e


@pytest.fixture(scope="module")
def hf(engine):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(specter.default_model_path(), dtype=torch.float32).eval()
    return m, torch.tensor([engine.encode(PROMPT)])


@pytest.mark.benchmark(group="decode-tpot")
def test_specter_resident(benchmark, engine):
    out = benchmark.pedantic(lambda: engine.generate(PROMPT, max_new_tokens=N, temperature=0.0), rounds=5, warmup_rounds=1)
    assert len(out.token_ids) == N
    benchmark.extra_info["tpot_ms"] = out.stats["tpot_s"] * 1e3


@pytest.mark.benchmark(group="decode-tpot")
def test_transformers_generate(benchmark, engine, hf):
    model, ids = hf
    torch.set_num_threads(torch.get_num_threads())  # the engine already chose the thread count

    def run():
        with torch.inference_mode():
            return model.generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0)

    out = benchmark.pedantic(run, rounds=5, warmup_rounds=1)
    assert out.shape[1] - ids.shape[1] == N
