"""The MoE decoder: one module tree for all supported architectures.

    embed -> [norm -> attention (GQA | MLA) -> + -> norm -> MoE block | dense MLP -> +] x L -> norm -> lm_head

Parameter names follow the Hugging Face checkpoints (`model.layers.N.self_attn.q_proj.weight`,
...), so loading is a rename only where architectures differ (see loader.py). Routed expert
weights are not parameters of this module: they come through the expert provider passed to
`forward`, which is how the same model runs resident, offloaded, or as the INT4 draft.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import ModelSpec
from .layers import MLP, Attention, KVCache, MLAttention, Rope, make_norm
from .moe import ExpertProvider, MoEBlock


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, moe_index: int | None):
        super().__init__()
        self.self_attn = MLAttention(spec, layer) if spec.attention == "mla" else Attention(spec, layer)
        self.mlp = MoEBlock(spec, moe_index) if moe_index is not None else MLP(spec.hidden, spec.dense_inter)
        self.is_moe = moe_index is not None
        self.input_layernorm = make_norm(spec)
        self.post_attention_layernorm = make_norm(spec)

    def forward(self, x, rope, cos, sin, cache, start, experts):
        x = x + self.self_attn(self.input_layernorm(x), rope, cos, sin, cache, start)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, experts) if self.is_moe else self.mlp(h))


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden)
        moe_ids = {l: i for i, l in enumerate(spec.moe_layer_ids)}
        self.layers = nn.ModuleList(DecoderLayer(spec, l, moe_ids.get(l)) for l in range(spec.n_layers))
        self.norm = make_norm(spec)


class MoETransformer(nn.Module):
    def __init__(self, spec: ModelSpec, max_len: int | None = None):
        super().__init__()
        self.spec = spec
        self.model = Backbone(spec)
        self.lm_head = nn.Linear(spec.hidden, spec.vocab_size, bias=spec.lm_head_bias)
        rope_dim = spec.qk_rope_dim if spec.attention == "mla" else spec.head_dim
        self.rope = Rope(spec, rope_dim, max_len)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,         # [T] int64, at positions start .. start+T-1
        start: int,
        cache: KVCache,
        experts: ExpertProvider,
        logits_for: str = "all",      # "all" -> [T, V]; "last" -> [1, V]
    ) -> torch.Tensor:
        T = tokens.shape[0]
        if start + T > cache.max_len:
            raise IndexError(f"positions up to {start + T} exceed the KV cache ({cache.max_len})")
        return self.run(tokens, start, cache, experts, logits_for)

    def run(self, tokens, start: int, cache: KVCache, experts: ExpertProvider, logits_for: str = "all"):
        """`forward` without its checks and its inference mode: the body torch.compile traces."""
        T = tokens.shape[0]
        x = self.model.embed_tokens(tokens)  # [T, H]
        pos = torch.arange(start, start + T, device=tokens.device)
        cos, sin = self.rope.cos_sin(pos, x.dtype)
        for layer in self.model.layers:
            x = layer(x, self.rope, cos, sin, cache, start, experts)
        if logits_for == "last":
            x = x[-1:]
        return self.lm_head(self.model.norm(x)).float()  # [T or 1, V]
