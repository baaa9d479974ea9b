"""The MoE decoder: one module tree for all supported architectures.

    embed -> [norm -> attention (GQA | MLA) -> + -> norm -> MoE block | dense MLP -> +] x L -> norm -> lm_head

Parameter names follow the Hugging Face checkpoints (`model.layers.N.self_attn.q_proj.weight`,
...), so loading is a rename only where architectures differ (see loader.py). Routed expert
weights are not parameters of this module: they come through the expert provider passed to
`forward`, which is how the same model runs resident, offloaded, or as the INT4 draft.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelSpec
from .layers import MLP, Attention, KVCache, MLAttention, Rope, make_norm
from .moe import ExpertProvider, MoEBlock
from . import sansio
from .profiling import span


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, moe_index: int | None):
        super().__init__()
        self.self_attn = MLAttention(spec, layer) if spec.attention == "mla" else Attention(spec, layer)
        self.mlp = MoEBlock(spec, moe_index) if moe_index is not None else MLP(spec.hidden, spec.dense_inter)
        self.is_moe = moe_index is not None
        self.input_layernorm = make_norm(spec)
        self.post_attention_layernorm = make_norm(spec)

    def forward(self, x, rope, cos, sin, cache, start, experts):
        x, h = self.attend(x, rope, cos, sin, cache, start)
        return x + (self.mlp(h, experts) if self.is_moe else self.mlp(h))

    def attend(self, x, rope, cos, sin, cache, start):
        """x [T, H] -> (x + attention, the MLP's input h [T, H])."""
        x = x + self.self_attn(self.input_layernorm(x), rope, cos, sin, cache, start)
        return x, self.post_attention_layernorm(x)

    def body(self, x, rope, cos, sin, cache, start, experts):
        """`forward` as a body (specter/sansio.py): the routed experts' waits are yielded."""
        x, h = self.attend(x, rope, cos, sin, cache, start)
        if not self.is_moe:
            return x + self.mlp(h)
        shared, ids, w = self.mlp.prepare(h)
        y = yield from sansio.call(experts, self.mlp.moe_index, h, ids, w)
        return x + self.mlp.combine(y, shared)


class Embedding(nn.Embedding):
    """Token embeddings whose rows come out in `out_dtype` (None: the table's). A CPU load keeps a
    16-bit checkpoint's table in its own dtype (loader.load_checkpoint) and upcasts the T rows it
    gathers: the values an upcast table gives, without a vocab x hidden fp32 copy in memory."""

    out_dtype: torch.dtype | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = super().forward(tokens)  # [T, H] in the table's dtype
        return x if self.out_dtype is None else x.to(self.out_dtype)


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden)
        moe_ids = {l: i for i, l in enumerate(spec.moe_layer_ids)}
        self.layers = nn.ModuleList(DecoderLayer(spec, l, moe_ids.get(l)) for l in range(spec.n_layers))
        self.norm = make_norm(spec)
        self.span_names = [f"layer {l}" for l in range(spec.n_layers)]  # profiling ranges


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
        self._check(tokens, start, cache)
        return self.run(tokens, start, cache, experts, logits_for)

    @torch.inference_mode()
    def body(self, tokens: torch.Tensor, start: int, cache: KVCache, experts: ExpertProvider,
             logits_for: str = "all"):
        """`forward` as a body (specter/sansio.py): drive(body) == forward; adrive awaits the offload
        manager's copies layer by layer."""
        self._check(tokens, start, cache)
        x, cos, sin = self._enter(tokens, start)
        for layer, name in zip(self.model.layers, self.model.span_names):
            with span(name):
                x = yield from layer.body(x, self.rope, cos, sin, cache, start, experts)
        return self._head(x, logits_for)

    def run(self, tokens, start: int, cache: KVCache, experts: ExpertProvider, logits_for: str = "all"):
        """`forward` without its checks and its inference mode: the body torch.compile traces."""
        x, cos, sin = self._enter(tokens, start)
        for layer, name in zip(self.model.layers, self.model.span_names):
            with span(name):
                x = layer(x, self.rope, cos, sin, cache, start, experts)
        return self._head(x, logits_for)

    def _enter(self, tokens, start):
        x = self.model.embed_tokens(tokens)  # [T, H]
        pos = torch.arange(tokens.shape[0], device=tokens.device) + start  # start: an int, or a 0-d device tensor
        return (x, *self.rope.cos_sin(pos, x.dtype))

    def _head(self, x, logits_for: str):
        if logits_for == "last":
            x = x[-1:]
        return self.logits(x)  # [T or 1, V] fp32

    @staticmethod
    def _check(tokens, start: int, cache: KVCache) -> None:
        if start + tokens.shape[0] > cache.max_len:
            raise IndexError(f"positions up to {start + tokens.shape[0]} exceed the KV cache ({cache.max_len})")

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: the layers' (on CPU the input embedding may keep a 16-bit checkpoint's
        table, so its parameter does not say it)."""
        return self.lm_head.weight.dtype

    def logits(self, x: torch.Tensor, chunk: int = 32768) -> torch.Tensor:
        """x [T, H] -> fp32 logits [T, V]: the final norm and lm_head computed in fp32 whatever the
        compute dtype. bf16 logits keep 8 significant bits, so a 16-bit head turns near-ties into exact
        ties that a batched verification and a one-token step break differently. The weight is
        upcast a vocabulary chunk at a time (no fp32 copy of lm_head is kept; on CPU at fp32 this is
        one plain linear)."""
        h = fp32_norm(self.model.norm, x)  # [T, H] fp32
        w, b = self.lm_head.weight, self.lm_head.bias
        if w.dtype == torch.float32 or w.shape[0] <= chunk:
            return F.linear(h, w.float(), None if b is None else b.float())
        parts = [F.linear(h, w[i:i + chunk].float(), None if b is None else b[i:i + chunk].float())
                 for i in range(0, w.shape[0], chunk)]
        return torch.cat(parts, dim=-1)


def fp32_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's normalisation of x computed in fp32 (its weights upcast), whatever their dtype."""
    x = x.float()
    if isinstance(norm, nn.LayerNorm):
        return F.layer_norm(x, norm.normalized_shape, norm.weight.float(), norm.bias.float(), norm.eps)
    return norm.weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))
