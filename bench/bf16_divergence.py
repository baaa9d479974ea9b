"""How often does speculative decoding at bf16 differ from plain bf16 decoding, and where?

At fp32 (CPU) speculation is token-for-token plain decoding. At bf16 a batched verification and a
one-token step round differently, so where two tokens' logits are (nearly) tied the argmax may
flip, and the continuations part there. This counts the prompts whose continuation differs and,
for each, the logit gap at the first difference (from plain decoding's own model: near 0 means a tie).

    python bench/bf16_divergence.py [--prompts 8] [--max-new-tokens 200] [--residency 0.5]
"""
from __future__ import annotations

import argparse
import random

import specter
from specter.testing import tie_gap


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--residency", type=float, default=0.5)
    ap.add_argument("--dtype", default="bf16")
    args = ap.parse_args()
    plain = specter.load(args.model, device="cpu", policy="resident", dtype=args.dtype)
    spec = specter.load(args.model, device="cpu", policy="specter", residency=args.residency, dtype=args.dtype)
    rng = random.Random(0)
    V = plain.spec.vocab_size
    differ, tokens_same, tokens_total, gaps, units_all = 0, 0, 0, [], []
    for p in range(args.prompts):
        prompt = [rng.randrange(V) for _ in range(args.prompt_len)]
        ref = plain.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=0.0).token_ids
        got = spec.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=0.0).token_ids
        i, gap, noise = tie_gap(plain, prompt, ref, got)
        same = len(ref) if i is None else i
        tokens_same += same
        tokens_total += len(ref)
        if i is not None:
            differ += 1
            units = abs(gap) / max(noise, 1e-12)
            gaps.append(gap)
            units_all.append(units)
            print(f"prompt {p}: differs at token {i} of {len(ref)}; plain's logit gap there {gap:.4f} "
                  f"(rounding noise there {noise:.4f}: gap = {units:.2f}x noise)")
        else:
            print(f"prompt {p}: identical ({len(ref)} tokens)")
    print(f"{args.dtype}: {differ} of {args.prompts} continuations differ from plain decoding; "
          f"{tokens_same} of {tokens_total} tokens before the first difference; "
          f"largest gap at a difference {max(gaps, default=0.0):.4f} "
          f"(at most {max(units_all, default=0.0):.2f}x the rounding noise at that position)")
    plain.close()
    spec.close()


if __name__ == "__main__":
    main()
