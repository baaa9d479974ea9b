"""Tiny random checkpoints of every supported architecture, built with transformers' own config
classes and saved with `save_pretrained`: what the tests and CPU benchmarks run on.

Weights are drawn wider than transformers' init (std 0.02 would make every logit ~0 and every
greedy continuation a tie-break), so routing and next tokens are decisive.
"""
from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("mixtral", "phimoe", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2")


def tiny_config(arch: str, **overrides):
    import transformers as T

    base = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256, eos_token_id=127, bos_token_id=1, pad_token_id=0,
                tie_word_embeddings=False)
    if arch == "mixtral":
        cls, kw = T.MixtralConfig, dict(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)
    elif arch == "phimoe":
        cls, kw = T.PhimoeConfig, dict(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                                       attention_bias=True, lm_head_bias=True)
    elif arch == "qwen2_moe":
        cls, kw = T.Qwen2MoeConfig, dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=2, shared_expert_intermediate_size=48,
                                         norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])
    elif arch == "qwen3_moe":
        cls, kw = T.Qwen3MoeConfig, dict(head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=True)
    elif arch == "olmoe":
        cls, kw = T.OlmoeConfig, dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    elif arch == "deepseek_v2":
        cls, kw = T.DeepseekV2Config, dict(num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
                                           n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                           first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32,
                                           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                           routed_scaling_factor=1.0)
    else:
        raise ValueError(f"unknown arch {arch!r}; one of {ARCHS}")
    # overrides through the constructor: what it derives follows them (Qwen2-MoE's layer_types from
    # use_sliding_window, set after it, kept every layer full attention); then set, as the file says
    cfg = cls(**{**base, **kw, **overrides})
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def make_tiny_checkpoint(path: str | Path, arch: str = "qwen3_moe", *, seed: int = 0, dtype=torch.float32,
                         max_shard_size: str | None = None, std: float = 0.25, **overrides):
    """Write a random tiny checkpoint to `path`; returns the transformers model (fp32, eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
            elif "norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.1)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(dtype).save_pretrained(str(path), **kw)
    return model.float()


def first_divergence(ref: list[int], got: list[int]) -> int | None:
    """Index of the first token where two continuations differ (None: one is a prefix of the other)."""
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            return i
    return None


CHUNKS = (2, 3, 5, 8)  # tie_gap's verification widths
DRAFTED = (2, 5, 10, 17)  # ... and of verifications batching got's drafted tokens after ref's (K_MAX 16)


def tie_gap(engine, prompt: list[int], ref: list[int], got: list[int]) -> tuple[int | None, float, float]:
    """Where `got` leaves `ref` (both continuations of `prompt`), how far apart the two tokens score
    there, and how much rounding alone moves a logit there.

    The gap is plain decoding's own: logits of ref's token minus got's after a prefill of the prompt
    and one-token steps over ref[:i], exactly the order plain decoding summed in. The noise is the
    largest difference over the vocabulary between those logits and the same tokens fed in the other
    orders a speculative decoder sums in: one batched forward, and ref[:i] in chunks of each of
    ``CHUNKS`` tokens (verifications of several widths), and ref[:i] with got's continuation from i in the
    verification's batch (``DRAFTED`` rows: a 16-bit expert GEMM's rows round differently in a batch of
    other rows, and the wrong drafts are in it; seen on a tiny PhiMoE: 0.10, where the orders
    without them moved nothing). At fp32 it is about 1e-6. At 16-bit precision
    it is the size of a tie, and it can be large: where a router's top-k is a near-tie at an earlier
    token, one order picks another expert there than the other, and every later logit moves (seen on
    the bundled model at bf16: 2.3, with 0.03 when the routing agrees). (None, 0.0, 0.0) when the
    continuations never diverge.

    A lossless decoder at 16-bit precision may only diverge where the gap is within that noise: a
    one-token step and a batched verification sum in different orders, so a near-tie (of the tokens
    or of an earlier routing) can break either way, but a decisive token never changes."""
    import torch

    from .layers import KVCache

    i = first_divergence(ref, got)
    if i is None:
        return None, 0.0, 0.0
    dec = engine.decoder
    ids = list(prompt) + list(ref[:i])

    def forward(chunks, row=-1):  # one cache, the chunks in order; the logits of the last chunk's `row`
        cache, start = KVCache(engine.spec, len(ids) + max(DRAFTED), engine.device, engine.dtype), 0
        for c in chunks:
            logits = dec.model(torch.tensor(c, device=engine.device), start, cache, dec.experts)
            start += len(c)
        return logits[row].float()

    stepped = forward([list(prompt)] + [[t] for t in ref[:i]])
    orders = [[ids]] + [[list(prompt)] + [list(ref[j:min(j + w, i)]) for j in range(0, i, w)] for w in CHUNKS]
    noise = max(float((stepped - forward(o)).abs().max()) for o in orders)
    for w in DRAFTED:  # ref[:i] accepted, its last token verified with got's drafts after it: row 0 scores i
        if len(ids) > 1:
            noise = max(noise, float((stepped - forward([ids[:-1], ids[-1:] + list(got[i:i + w - 1])], 0)).abs().max()))
    return i, float(stepped[ref[i]] - stepped[got[i]]), noise