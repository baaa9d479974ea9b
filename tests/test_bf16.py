"""bf16: what speculation guarantees at 16-bit precision.

1. The final norm and lm_head run in fp32 whatever the compute dtype (bf16 logits keep 8
   significant bits and turn near-ties into exact ties); the vocabulary-chunked upcast gives the
   same logits as one fp32 linear.
2. Speculative decoding at bf16 gives plain bf16 decoding's tokens, except that it may part from
   them at a near-tie: where it does, plain decoding's own logits for the two tokens are within
   bf16 rounding of each other. A wrong token anywhere else fails.
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F

import specter
from specter.testing import tie_gap

# A tie: plain decoding's gap between the two tokens is within TIE_NOISE times what summing the same tokens
# in the other order (one batched forward) moves a logit there. The noise is one sample of the rounding
# (verification batches in yet another order): the bundled model's differences measured 0.03-2.3x it
# (bench/bf16_divergence.py --prompts 24), hence 4. A decisive token wins by ~1, far beyond that.
TIE_NOISE = 4.0


def test_head_is_fp32_and_chunking_changes_nothing(tiny):
    path, _ = tiny("phimoe")  # LayerNorm with bias and an lm_head bias: the awkward case
    engine = specter.load(path, device="cpu", policy="resident", dtype="bf16")
    model = engine.decoder.model
    x = torch.randn(3, model.spec.hidden).bfloat16()
    got = model.head(x)
    norm, head = model.model.norm, model.lm_head
    h = F.layer_norm(x.double(), norm.normalized_shape, norm.weight.double(), norm.bias.double(), norm.eps)
    want = F.linear(h, head.weight.double(), head.bias.double())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.head(x, chunk=40), got, rtol=0, atol=1e-6)  # 128 = 40+40+40+8


def test_speculation_at_bf16_differs_only_at_ties():
    plain = specter.load(None, device="cpu", policy="resident", dtype="bf16")
    spec = specter.load(None, device="cpu", policy="specter", residency=0.5, dtype="bf16")
    rng = random.Random(1)
    drafted = 0
    try:
        for _ in range(3):
            prompt = [rng.randrange(plain.spec.vocab_size) for _ in range(10)]
            ref = plain.generate(prompt, max_new_tokens=64, temperature=0.0).token_ids
            out = spec.generate(prompt, max_new_tokens=64, temperature=0.0)
            drafted += out.stats["drafted_tokens"]
            i, gap, noise = tie_gap(plain, prompt, ref, out.token_ids)
            assert i is None or abs(gap) <= TIE_NOISE * noise, (prompt, i, gap, noise)
    finally:
        plain.close()
        spec.close()
    assert drafted > 0


def test_tie_gap_sees_a_decisive_difference(tiny):
    """The comparison can fail: a continuation with one token changed where the model is sure."""
    path, _ = tiny("qwen3_moe")
    engine = specter.load(path, device="cpu", policy="resident", dtype="bf16")
    prompt = [1, 5, 9, 33]
    ref = engine.generate(prompt, max_new_tokens=6).token_ids
    wrong = ref[:3] + [(ref[3] + 1) % engine.spec.vocab_size] + ref[4:]
    i, gap, noise = tie_gap(engine, prompt, ref, wrong)
    assert i == 3 and gap > max(TIE_NOISE * noise, 0.5), (gap, noise)
    assert tie_gap(engine, prompt, ref, ref) == (None, 0.0, 0.0)


def test_tie_gap_counts_the_wrong_drafts_in_a_verifications_batch(tiny):
    """A QA pass saw spec-lru at bf16 with a draft of 9 part from plain decoding on the tiny PhiMoE by a gap
    of 0.05 that tie_gap called noise 0.0: the verification's batch held the wrong drafts after the row, and
    a 16-bit expert GEMM rounds a row differently among other rows. Its noise counts such batches now."""
    path, _ = tiny("phimoe", dtype=torch.bfloat16)
    with specter.load(path, device="cpu", policy="resident", dtype="bf16") as engine:
        prompt = [5, 9, 11, 40, 7]
        ref = engine.generate(prompt, max_new_tokens=4, temperature=0.0).token_ids
        assert ref[:3] == [22, 2, 107], ref  # (the case as found, at torch 2.13's bf16 arithmetic on CPU)
        i, gap, noise = tie_gap(engine, prompt, ref, ref[:2] + [25, 25, 7, 0, 22, 2, 12, 89, 31, 118])
    assert i == 2 and 0 < gap <= TIE_NOISE * noise, (gap, noise)
