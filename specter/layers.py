"""Building blocks shared by every architecture: norms, RoPE, the static KV cache, attention
(grouped-query and DeepSeek's multi-head latent attention) and the dense SwiGLU MLP.

Batch size is one throughout (Specter's target): activations are [T, hidden], T tokens at
consecutive positions `start .. start+T-1`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # the CPU path: skip two no-op casts on the hot path
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def make_norm(spec: ModelSpec, dim: int | None = None) -> nn.Module:
    dim = dim or spec.hidden
    if spec.norm == "layer":  # PhiMoE: LayerNorm with bias
        return nn.LayerNorm(dim, eps=spec.norm_eps)
    return RMSNorm(dim, spec.norm_eps)


# ---------------------------------------------------------------------------------------- RoPE
class Rope(nn.Module):
    """Rotary embedding. `inv_freq` and `scale` come from transformers' own RoPE initialisers for
    scaled variants (yarn, longrope, llama3, linear), so long-context checkpoints rotate exactly as
    their reference does (longrope: up to original_max_position_embeddings where its long and short
    sets differ, the context then: config._exact_context). Two layouts: halves (Llama family) and
    interleaved pairs (DeepSeek)."""

    def __init__(self, spec: ModelSpec, dim: int, max_len: int | None = None):
        super().__init__()
        cfg = spec.hf_config
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        kind = rope.get("rope_type", "default")
        if kind == "default":
            theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            scale = 1.0
        else:  # (config._check_rope refused the others)
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", seq_len=max_len)
            if spec.arch == "phimoe":  # PhiMoE overrides the attention factor with its own mscales
                long = (max_len or 0) > rope.get("original_max_position_embeddings", spec.max_position)
                scale = rope["long_mscale"] if long else rope["short_mscale"]
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # [dim/2]
        self.scale = float(scale)
        self.interleaved = spec.rope_interleaved

    def cos_sin(self, pos: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = pos[:, None].float() * self.inv_freq  # [T, dim/2]
        if not self.interleaved:
            freqs = torch.cat((freqs, freqs), dim=-1)  # [T, dim]
        return (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)

    def apply(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Both rotated: q [T, heads, dim], k [T, kv_heads, dim]; cos/sin: [T, dim] (halves) or [T, dim/2]
        (interleaved)."""
        cos, sin = cos[:, None], sin[:, None]
        if self.interleaved:  # (x0 + i x1) * (cos + i sin), computed in fp32 as the reference does
            cf, sf = cos.float(), sin.float()
            qf, kf = q.float().unflatten(-1, (-1, 2)), k.float().unflatten(-1, (-1, 2))
            a, b, c, d = qf[..., 0], qf[..., 1], kf[..., 0], kf[..., 1]
            return (torch.stack((a * cf - b * sf, a * sf + b * cf), dim=-1).flatten(-2).to(q.dtype),
                    torch.stack((c * cf - d * sf, c * sf + d * cf), dim=-1).flatten(-2).to(k.dtype))
        q1, q2 = q.chunk(2, dim=-1)
        k1, k2 = k.chunk(2, dim=-1)
        return q * cos + torch.cat((-q2, q1), dim=-1) * sin, k * cos + torch.cat((-k2, k1), dim=-1) * sin


# ------------------------------------------------------------------------------------ KV cache
class KVCache:
    """Static per-layer K/V buffers for one sequence: k [n_kv, max_len, dk], v [n_kv, max_len, dv].

    Positions are the truth: `update` writes T rows at `start` and returns the view [0, start+T).
    Anything past the committed length is scratch (draft tokens, rejected verifications) that the
    next write overwrites, so rollback is just a smaller `start` next time.

    `start` may also be a 0-d device tensor (the captured draft step): then the rows are written
    with index_copy_ and the whole buffer comes back, its unwritten tail masked by position (see
    `attention_mask`), so no shape depends on a host integer.

    MLA models cache the latent instead: k [1, max_len, rank + rope] holds the normalised KV latent
    and the rotary key, and v is a view of its first `rank` columns (see MLAttention)."""

    def __init__(self, spec: ModelSpec, max_len: int, device, dtype):
        self.max_len = max_len
        if spec.attention == "mla":
            rank = spec.kv_lora_rank
            self.k = [torch.zeros(1, max_len, rank + spec.qk_rope_dim, device=device, dtype=dtype)
                      for _ in range(spec.n_layers)]
            self.v = [k[..., :rank] for k in self.k]
            return
        n_kv, d = spec.n_kv_heads, spec.head_dim
        self.k = [torch.zeros(n_kv, max_len, d, device=device, dtype=dtype) for _ in range(spec.n_layers)]
        self.v = [torch.zeros(n_kv, max_len, d, device=device, dtype=dtype) for _ in range(spec.n_layers)]

    def update(self, layer: int, start, k: torch.Tensor, v: torch.Tensor | None):
        # k: [T, n_kv, dk], v: [T, n_kv, dv] (None when v is a view of k: the MLA latent)
        if isinstance(start, torch.Tensor):
            pos = start + torch.arange(k.shape[0], device=k.device)  # [T]
            self.k[layer].index_copy_(1, pos, k.transpose(0, 1))
            if v is not None:
                self.v[layer].index_copy_(1, pos, v.transpose(0, 1))
            return self.k[layer], self.v[layer]  # [n_kv, max_len, d]
        end = start + k.shape[0]
        self.k[layer][:, start:end] = k.transpose(0, 1)
        if v is not None:
            self.v[layer][:, start:end] = v.transpose(0, 1)
        return self.k[layer][:, :end], self.v[layer][:, :end]  # [n_kv, end, d]

    def nbytes(self) -> int:
        """Bytes allocated (a view shares its base's storage and counts once)."""
        bases = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.k + self.v}
        return sum(bases.values())


def cuda_attention_backends() -> None:
    """On CUDA every attention of the process runs torch's memory-efficient kernel (flash and cuDNN
    attention off; math where it cannot). One kernel family for a one-token step (no mask) and a
    verification of K+1 tokens (a mask, which flash does not take), so that a row's bits do not
    depend on the width; and none of cuDNN attention's plan builds, one per new key length: in a
    decode, one a token (torch prefers cuDNN on Hopper)."""
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)


def attention_mask(start, T: int, window: int | None, device, keys: int | None = None) -> torch.Tensor | None:
    """[T, start+T] boolean mask (True = attend), or None when plain full attention is right.
    With `start` a 0-d tensor: always a [T, keys] mask over the whole cache buffer, from positions."""
    if isinstance(start, torch.Tensor):
        q = (start + torch.arange(T, device=device))[:, None]
        k = torch.arange(keys, device=device)[None, :]
    elif T == 1 and (window is None or start < window):
        return None
    else:
        q = torch.arange(start, start + T, device=device)[:, None]
        k = torch.arange(start + T, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    return allowed


def sdpa(q, k, v, mask, scale) -> torch.Tensor:
    # q: [T, H, d]; k/v: [n_kv, L, d] -> [T, H * dv]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask, scale=scale,
        enable_gqa=k.shape[0] != q.shape[1],
    )
    return o[0].transpose(0, 1).flatten(1)


# --------------------------------------------------------------------------------- attention
class Attention(nn.Module):
    """Grouped-query attention with the per-architecture knobs: q/k/v bias (Qwen2, PhiMoE),
    per-head q/k RMSNorm (Qwen3), q/k RMSNorm over the whole projection (OLMoE), clip_qkv (OLMoE)."""

    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        H, nh, nkv, d = spec.hidden, spec.n_heads, spec.n_kv_heads, spec.head_dim
        self.layer, self.nh, self.nkv, self.d = layer, nh, nkv, d
        self.q_proj = nn.Linear(H, nh * d, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(H, nkv * d, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(H, nkv * d, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(nh * d, H, bias=spec.o_bias)
        self.qk_norm, self.clip, self.scale = spec.qk_norm, spec.clip_qkv, spec.attn_scale
        self.window = spec.sliding_window[layer] if spec.sliding_window else None
        if spec.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(d, spec.norm_eps), RMSNorm(d, spec.norm_eps)
        elif spec.qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(nh * d, spec.norm_eps), RMSNorm(nkv * d, spec.norm_eps)

    def forward(self, x, rope: Rope, cos, sin, cache: KVCache, start: int) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [T, nh*d], [T, nkv*d] x2
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q, k, v = q.view(T, self.nh, self.d), k.view(T, self.nkv, self.d), v.view(T, self.nkv, self.d)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q, k, cos, sin)
        k_all, v_all = cache.update(self.layer, start, k, v)  # [n_kv, L, d]
        mask = attention_mask(start, T, self.window, x.device, k_all.shape[1])  # None: one token sees all
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_all[None], v_all[None], attn_mask=mask,
                                           scale=self.scale, enable_gqa=self.nkv != self.nh)  # [1, nh, T, d]
        return self.o_proj(o[0].transpose(0, 1).flatten(1))


class MLAttention(nn.Module):
    """DeepSeek-V2 multi-head latent attention. Queries come straight from `q_proj` (V2-Lite) or
    through a low-rank `q_a -> norm -> q_b` path (V2); keys and values come from a shared latent
    (`kv_a_proj_with_mqa -> norm`, rank r) plus one shared rotary key.

    The cache keeps only the latent c and the rotary key (r + rope per token, 9x less than
    per-head K/V for DeepSeek-V2), and attention runs in the latent space with kv_b_proj absorbed:
    with W_uk [nh, nope, r] and W_uv [nh, dv, r] the two halves of kv_b_proj,

        q_nope . k_nope = q_nope . (W_uk c) = (q_nope W_uk) . c        scores over [c, k_pe]
        sum_s p_s v_s = W_uv (sum_s p_s c_s)                          values are c itself

    so one MQA pass over [end, r + rope] replaces decompressing every cached position."""

    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        H, nh = spec.hidden, spec.n_heads
        self.layer, self.nh = layer, nh
        self.nope, self.rope_dim, self.dv, self.rank = spec.qk_nope_dim, spec.qk_rope_dim, spec.v_head_dim, spec.kv_lora_rank
        qk = self.nope + self.rope_dim
        if spec.q_lora_rank is None:
            self.q_proj = nn.Linear(H, nh * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(H, spec.q_lora_rank, bias=spec.qkv_bias)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(spec.q_lora_rank, nh * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, self.rank + self.rope_dim, bias=spec.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.rank, nh * (self.nope + self.dv), bias=False)
        self.o_proj = nn.Linear(nh * self.dv, H, bias=spec.qkv_bias)
        self.scale = spec.attn_scale
        self.lora_q = spec.q_lora_rank is not None

    def forward(self, x, rope: Rope, cos, sin, cache: KVCache, start: int) -> torch.Tensor:
        T, nh = x.shape[0], self.nh
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.lora_q else self.q_proj(x)
        q_nope, q_pe = q.view(T, nh, -1).split([self.nope, self.rope_dim], dim=-1)
        kv_lat, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(kv_lat)                                               # [T, r]
        q_pe, k_pe = rope.apply(q_pe, k_pe[:, None], cos, sin)  # [T, nh, rope], [T, 1, rope]
        ckv, c_all = cache.update(self.layer, start, torch.cat((c[:, None], k_pe), dim=-1), None)  # [1, end, r+rope]
        w = self.kv_b_proj.weight.view(nh, self.nope + self.dv, self.rank)
        q_lat = torch.einsum("tnd,ndr->tnr", q_nope, w[:, :self.nope])                # [T, nh, r]
        mask = attention_mask(start, T, None, x.device, ckv.shape[1])
        o_lat = sdpa(torch.cat((q_lat, q_pe), dim=-1), ckv, c_all, mask, self.scale)  # [T, nh * r]
        o = torch.einsum("tnr,ndr->tnd", o_lat.view(T, nh, self.rank), w[:, self.nope:])  # [T, nh, dv]
        return self.o_proj(o.reshape(T, nh * self.dv))


class MLP(nn.Module):
    """Dense SwiGLU MLP: dense layers, and the shared experts of Qwen2-MoE and DeepSeek-V2."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
