"""The MoE decoder: one module tree for all supported architectures, one layer loop for every caller.

    embed -> [norm -> attention (GQA | MLA) -> + -> norm -> MoE block | dense MLP -> +] x L -> norm -> lm_head

Parameter names follow the Hugging Face checkpoints (`model.layers.N.self_attn.q_proj.weight`,
...), so loading is a rename only where architectures differ (see loader.py). Routed expert
weights are not parameters of this module: each MoE layer calls the expert provider passed to
`forward` (moe.py), which is how the same model runs resident, offloaded, or as the INT4 draft.

The layer loop (`run`) is written once. It calls four *pieces* -- `enter`, `dense`, `pre_experts`,
`head` -- and between an MoE layer's `pre_experts` and the next piece, the provider. Eagerly the
pieces are this module's own methods; the draft step (compiled/draft_step.py) traces `run` whole;
the verifier (compiled/verify_step.py) passes the same methods compiled, over a padded width. An MoE
layer's output is added at the start of the next piece (`out`), so a compiled piece ends right
before the routed experts and the next one starts right after them.
"""
from __future__ import annotations

from itertools import repeat

import torch
import torch.nn.functional as F
from torch import nn

from . import profiling
from .config import ModelSpec
from .layers import MLP, Attention, KVCache, MLAttention, Rope, make_norm
from .moe import ExpertProvider


# ------------------------------------------------------------------------------ routers, MoE block
def route_sparsemixer(logits: torch.Tensor, eps: float):
    """PhiMoE's sparsemixer at inference: the top expert, weighted by a softmax over the experts
    within a relative `2*eps` of it; then the same for the runner-up with the top expert masked."""
    def pick(masked: torch.Tensor):
        top, idx = masked.max(dim=-1, keepdim=True)
        far = (top - logits) / logits.abs().clamp(min=top) > 2 * eps
        w = torch.softmax(masked.masked_fill(far, float("-inf")), dim=-1).gather(-1, idx)
        return idx, w

    id1, w1 = pick(logits)
    id2, w2 = pick(logits.scatter(-1, id1, float("-inf")))
    return torch.cat((id1, id2), dim=-1), torch.cat((w1, w2), dim=-1)


def route_deepseek(logits: torch.Tensor, spec: ModelSpec):
    """DeepSeek-V2: softmax scores in fp32, greedy or group-limited top-k, scaled by routed_scaling_factor,
    as transformers does (norm_topk_prob, which DeepSeek's own code honours and transformers ignores, is
    refused: config.py)."""
    scores = torch.softmax(logits.float(), dim=-1)
    if spec.topk_method == "group_limited_greedy":
        T, E = scores.shape
        group_best = scores.view(T, spec.n_group, E // spec.n_group).max(dim=-1).values  # [T, G]
        keep = torch.topk(group_best, spec.topk_group, dim=-1, sorted=False).indices
        mask = torch.zeros_like(group_best, dtype=torch.bool).scatter_(1, keep, True)
        scores = scores.masked_fill(~mask.repeat_interleave(E // spec.n_group, dim=1), 0.0)
    w, ids = torch.topk(scores, spec.top_k, dim=-1, sorted=False)
    return ids, w * spec.routed_scale


class MoEBlock(nn.Module):
    """An MoE layer's own weights: the router and the optional shared expert (Qwen2-MoE gates it with
    a sigmoid; DeepSeek-V2 adds it plainly). The routed experts come from the provider. The shared
    expert runs before them, so on an offloading provider it overlaps with copies still in flight."""

    def __init__(self, spec: ModelSpec, moe_index: int):
        super().__init__()
        self.spec, self.moe_index = spec, moe_index
        self.gate = nn.Linear(spec.hidden, spec.n_experts, bias=False)  # the router
        self.shared = MLP(spec.hidden, spec.shared_inter) if spec.shared_inter else None
        self.shared_gate = nn.Linear(spec.hidden, 1, bias=False) if spec.shared_gate else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] -> ids [T, k] (int64), weights [T, k]
        s = self.spec
        if s.router == "deepseek":
            return route_deepseek(F.linear(x.float(), self.gate.weight.float()), s)
        logits = self.gate(x)  # [T, E]
        if s.router == "sparsemixer":
            return route_sparsemixer(logits, s.router_jitter)
        # Mixtral, Qwen2/3-MoE, OLMoE: softmax over all experts, top-k, optional renormalisation
        w, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), s.top_k, dim=-1)
        if s.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return ids, w.to(logits.dtype)

    def shared_out(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's output [T, H] (gated where the architecture gates it), or None."""
        if self.shared is None:
            return None
        y = self.shared(x)
        return y if self.shared_gate is None else torch.sigmoid(self.shared_gate(x)) * y


class DecoderLayer(nn.Module):
    """Attention and an MLP (an MoE block, or dense); the model's pieces run them."""

    def __init__(self, spec: ModelSpec, layer: int, moe_index: int | None):
        super().__init__()
        self.index, self.moe_index = layer, moe_index  # moe_index: the provider's layer (None: dense)
        self.self_attn = MLAttention(spec, layer) if spec.attention == "mla" else Attention(spec, layer)
        self.mlp = MoEBlock(spec, moe_index) if moe_index is not None else MLP(spec.hidden, spec.dense_inter)
        self.is_moe = moe_index is not None
        self.input_layernorm = make_norm(spec)
        self.post_attention_layernorm = make_norm(spec)


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        # A skeleton the loader fills: no random init (normal_ on the meta device imports torch._dynamo, ~1 s a load)
        self.embed_tokens = nn.Embedding.from_pretrained(torch.empty(spec.vocab_size, spec.hidden, device="meta"),
                                                         freeze=False)
        moe_ids = {l: i for i, l in enumerate(spec.moe_layer_ids)}
        self.layers = nn.ModuleList(DecoderLayer(spec, l, moe_ids.get(l)) for l in range(spec.n_layers))
        self.norm = make_norm(spec)
        self.span_names = [f"layer {l}" for l in range(spec.n_layers)]  # profiling ranges


class MoETransformer(nn.Module):
    def __init__(self, spec: ModelSpec, max_len: int | None = None, dtype: torch.dtype = torch.float32):
        """`dtype`: the compute dtype, the one its layers are loaded in (loader.load_checkpoint). No
        parameter alone says it: on CPU the input embedding may keep a 16-bit checkpoint's table."""
        super().__init__()
        self.spec, self.dtype = spec, dtype
        self.model = Backbone(spec)
        self.lm_head = nn.Linear(spec.hidden, spec.vocab_size, bias=spec.lm_head_bias)
        rope_dim = spec.qk_rope_dim if spec.attention == "mla" else spec.head_dim
        self.rope = Rope(spec, rope_dim, max_len)

    def run(self, tokens, start, cache: KVCache, experts: ExpertProvider, logits_for: str = "all",
            pieces=None, rows: int | None = None):
        """The layer loop: tokens [T] (int64) at positions start .. start+T-1 -> logits [T, V] ("all")
        or [1, V] ("last"). `forward` is this under inference mode; the compiled steps call it
        directly. `start`: an int, or a 0-d device tensor (the compiled steps). `pieces`: an object
        with this module's four piece methods (the verifier's compiled ones) and `layers(cache)`, the
        (layer, its K/V) pairs; `rows`: the real rows of a padded width, the only ones the provider
        sees (the verifier checks its own padding against the cache)."""
        if pieces is None and not isinstance(start, torch.Tensor) and start + tokens.shape[0] > cache.max_len:
            raise IndexError(f"positions up to {start + tokens.shape[0]} exceed the KV cache ({cache.max_len})")
        p = self if pieces is None else pieces
        x, cos, sin = p.enter(tokens, start)
        out = empty = None if pieces is None else pieces.zeros[:x.shape[0]]  # the last MLP's output, not yet added
        named = not torch.compiler.is_compiling() and profiling.ON  # the flag read after: no guard on it
        layers = zip(self.model.layers, repeat(cache)) if pieces is None else pieces.layers(cache)
        for layer, kv in layers:  # (layer, the cache its attention writes)
            with profiling.span(self.model.span_names[layer.index]) if named else profiling.NULL:
                if layer.moe_index is None:
                    x, out = p.dense(layer, x, out, cos, sin, kv, start), empty
                    continue
                x, h, ids, w, shared = p.pre_experts(layer, x, out, cos, sin, kv, start)
                if rows is None:
                    out = experts(layer.moe_index, h, ids, w)  # [T, H]
                else:  # the real rows only; the padding's output is zeros
                    out = experts(layer.moe_index, h[:rows], ids[:rows], w[:rows])
                    if x.shape[0] > rows:
                        out = F.pad(out, (0, 0, 0, x.shape[0] - rows))
                if shared is not None:
                    out = out + shared
        return p.head(x, out, logits_for)

    forward = torch.inference_mode()(run)  # model(tokens, start, cache, experts, logits_for="all")

    # ------------------------------------------------------------------ the pieces run calls
    def enter(self, tokens, start):
        """tokens [T] -> embeddings x [T, H] in the compute dtype, and cos/sin of positions start ..
        start+T-1. A CPU load keeps a 16-bit checkpoint's table in its own dtype (loader.load_checkpoint):
        the T rows gathered are upcast, the values an upcast table gives without its fp32 copy."""
        x = self.model.embed_tokens(tokens).to(self.dtype)  # [T, H]
        pos = torch.arange(tokens.shape[0], device=tokens.device) + start  # start: an int, or a 0-d device tensor
        cos, sin = self.rope.cos_sin(pos, x.dtype)
        return x, cos, sin

    def dense(self, layer: DecoderLayer, x, out, cos, sin, cache: KVCache, start):
        """A dense layer, after adding the previous MLP's output `out` (None: nothing) -> x [T, H]."""
        if out is not None:
            x = x + out
        x = x + layer.self_attn(layer.input_layernorm(x), self.rope, cos, sin, cache, start)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def pre_experts(self, layer: DecoderLayer, x, out, cos, sin, cache: KVCache, start):
        """An MoE layer up to its routed experts -> x [T, H] (the residual), h [T, H] (the experts'
        input), ids [T, k], weights [T, k], the shared expert's output [T, H] or None."""
        if out is not None:
            x = x + out
        x = x + layer.self_attn(layer.input_layernorm(x), self.rope, cos, sin, cache, start)
        h = layer.post_attention_layernorm(x)
        moe = layer.mlp
        shared = None if moe.shared is None else moe.shared_out(h)
        ids, w = moe.route(h)
        return x, h, ids, w, shared

    def head(self, x, out=None, logits_for: str = "all", chunk: int = 32768):
        """x [T, H] + the last MLP's output `out` -> fp32 logits [T, V] ("all") or [1, V] ("last"): the
        final norm and lm_head computed in fp32 whatever the compute dtype. bf16 logits keep 8
        significant bits, so a 16-bit head turns near-ties into exact ties that a batched verification
        and a one-token step break differently. The weight is upcast a vocabulary chunk at a time (no
        fp32 copy of lm_head is kept; on CPU at fp32 this is one plain linear)."""
        if out is not None:
            x = x + out
        if logits_for == "last":
            x = x[-1:]
        norm, x = self.model.norm, x.float()  # the final norm in fp32, its weights upcast
        if isinstance(norm, nn.LayerNorm):
            h = F.layer_norm(x, norm.normalized_shape, norm.weight.float(), norm.bias.float(), norm.eps)
        else:
            h = norm.weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))  # [T, H]
        w, b = self.lm_head.weight, self.lm_head.bias
        if w.dtype == torch.float32 or w.shape[0] <= chunk:
            return F.linear(h, w.float(), None if b is None else b.float())
        parts = [F.linear(h, w[i:i + chunk].float(), None if b is None else b[i:i + chunk].float())
                 for i in range(0, w.shape[0], chunk)]
        return torch.cat(parts, dim=-1)
