"""Specter's model code against transformers' reference on tiny random checkpoints (fp32, CPU)."""
import pytest
import torch

import specter
from specter.layers import KVCache
from specter.loader import load_checkpoint
from specter.moe import ResidentExperts
from specter.testing import ARCHS

PROMPTS = [[1, 5, 9, 33, 2], [7] * 3, list(range(10, 40))]


def hf_greedy(ref, prompt, n):
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(tiny, arch):
    path, ref = tiny(arch)
    model, experts, _ = load_checkpoint(path, torch.device("cpu"), torch.float32)
    tokens = torch.tensor(PROMPTS[2])
    cache = KVCache(model.spec, 64, "cpu", torch.float32)
    ours = model(tokens, 0, cache, ResidentExperts(experts))
    with torch.no_grad():
        theirs = ref(tokens[None]).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers(tiny, arch):
    path, ref = tiny(arch)
    engine = specter.load(path, device="cpu", policy="resident")
    for prompt in PROMPTS:
        assert engine.generate(prompt, max_new_tokens=24).token_ids == hf_greedy(ref, prompt, 24)


def test_incremental_decode_matches_one_pass(tiny):
    """Decoding token by token through the KV cache gives the logits of one full pass."""
    path, _ = tiny("deepseek_v2")
    model, experts, _ = load_checkpoint(path, torch.device("cpu"), torch.float32)
    tokens = torch.tensor(PROMPTS[2])
    full = model(tokens, 0, KVCache(model.spec, 64, "cpu", torch.float32), ResidentExperts(experts))
    cache = KVCache(model.spec, 64, "cpu", torch.float32)
    model(tokens[:10], 0, cache, ResidentExperts(experts))
    steps = [model(tokens[i:i + 1], i, cache, ResidentExperts(experts)) for i in range(10, len(tokens))]
    torch.testing.assert_close(torch.cat(steps), full[10:], rtol=1e-4, atol=1e-4)


def test_sharded_checkpoint(tiny):
    path, ref = tiny("mixtral", max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 2
    engine = specter.load(path, device="cpu", policy="resident")
    assert engine.generate(PROMPTS[0], max_new_tokens=16).token_ids == hf_greedy(ref, PROMPTS[0], 16)


def test_bf16_checkpoint(tiny):
    """A bf16 checkpoint computes in fp32 on CPU, as transformers does with the same weights."""
    from transformers import AutoModelForCausalLM

    path, _ = tiny("qwen2_moe", dtype=torch.bfloat16)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = specter.load(path, device="cpu", policy="resident")
    assert engine.dtype == torch.float32
    for prompt in PROMPTS[:2]:
        assert engine.generate(prompt, max_new_tokens=16).token_ids == hf_greedy(ref, prompt, 16)


def test_tied_embeddings_and_variants(tiny):
    """Tied lm_head, mlp-only (dense) layers in Qwen2-MoE, group-limited routing and q-LoRA in DeepSeek,
    PhiMoE's and Qwen2-MoE's sliding windows (21 positions through a window of 8: transformers masks to
    it), zero-size shared experts (transformers stores [0, H] weights and Qwen2-MoE's gate over them: no-ops)."""
    cases = [
        ("phimoe", dict(sliding_window=8)),
        ("qwen3_moe", dict(tie_word_embeddings=True)),
        ("qwen2_moe", dict(mlp_only_layers=[1], norm_topk_prob=True)),
        ("deepseek_v2", dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                             routed_scaling_factor=2.0)),
        ("olmoe", dict(clip_qkv=0.5)),
        ("qwen2_moe", dict(shared_expert_intermediate_size=0)),
        ("deepseek_v2", dict(n_shared_experts=0)),
        ("qwen2_moe", dict(use_sliding_window=True, sliding_window=8)),
    ]
    for arch, kw in cases:
        path, ref = tiny(arch, **kw)
        if kw.get("use_sliding_window"):  # (tiny_config set it after the constructor: every layer stayed full)
            assert "sliding_attention" in ref.config.layer_types, ref.config.layer_types
        engine = specter.load(path, device="cpu", policy="resident")
        assert engine.generate(PROMPTS[0], max_new_tokens=16).token_ids == hf_greedy(ref, PROMPTS[0], 16), arch


@pytest.mark.parametrize("arch", ["qwen3_moe", "phimoe"])
def test_longrope_is_exact_up_to_where_transformers_switches(tiny, arch):
    """rope_type longrope: transformers rotates a whole forward the long way once its last position passes
    original_max_position_embeddings (qwen3: long_factor; PhiMoE: long_mscale), a switch by batch that
    Specter does not make. Where the two sets differ the context ends there, and is exact up to it; where
    they are equal (Phi-3.5-MoE's mscales) the whole context is, a generation crossing it included."""
    from specter.testing import tiny_config

    cfg = tiny_config(arch)
    half = (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads) // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
            "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [2.0 + 0.5 * i for i in range(half)]}
    if arch == "phimoe":
        rope.update(short_mscale=1.1, long_mscale=1.3)
    for differ in (True, False):
        if not differ:
            rope.update(long_factor=rope["short_factor"]) if arch == "qwen3_moe" else rope.update(long_mscale=1.1)
        path, ref = tiny(arch, rope_parameters=dict(rope), max_position_embeddings=128)
        engine = specter.load(path, device="cpu", policy="resident")
        try:
            assert engine.context == (32 if differ else 128)
            assert engine.generate(PROMPTS[0], max_new_tokens=27).token_ids == hf_greedy(ref, PROMPTS[0], 27)
            if differ:
                with pytest.raises(specter.ContextLengthError, match="longrope: past original_max_position_embed"):
                    engine.generate(PROMPTS[2], max_new_tokens=12)
            else:  # 30 + 12 crosses 32 in both the prompt's and the generation's forwards
                assert engine.generate(PROMPTS[2], max_new_tokens=12).token_ids == hf_greedy(ref, PROMPTS[2], 12)
        finally:
            engine.close()


def test_eos_stops_generation(tiny):
    path, ref = tiny("qwen3_moe")
    engine = specter.load(path, device="cpu", policy="resident")
    out = engine.generate(PROMPTS[0], max_new_tokens=8)
    eos = out.token_ids[2]  # pretend the third generated token is end-of-sequence
    engine.model.spec.eos_token_ids = [eos]
    stopped = engine.generate(PROMPTS[0], max_new_tokens=8).token_ids
    assert stopped == out.token_ids[: out.token_ids.index(eos) + 1]
