"""One rank's part of the model: its layers' weights, KV cache and expert provider.

The rank reads only its stage's tensors from the checkpoint (loader.load_checkpoint(layers=)):
its layers, the embedding on the first stage, the final norm and lm_head on the last; the modules
it never runs are replaced by empty ones, and its expert provider (resident weights, or an offload
manager with its own slot pool and link) is built over its own MoE layers' store only.

`StagePieces` is what the model's own layer loop (MoETransformer.run, `pieces=`) runs for a stage:
the model's pieces over this stage's layers, entered from the previous stage's hidden state
(positions from `start`), leaving with the hidden state [T, H] (the last MLP's output added), or
with the logits on the last stage. Both sides of a boundary therefore hold x + out exactly as the
single-process loop does.
"""
from __future__ import annotations

import time
from itertools import repeat

import torch
from torch import nn

from ..layers import KVCache
from .stages import Stage


class _NoZeros:
    """run's `pieces.zeros[:T]` (the MLP output before the first layer): None, as without pieces."""

    def __getitem__(self, _):
        return None


class StagePieces:
    """MoETransformer's pieces restricted to one stage (see the module docstring)."""

    zeros = _NoZeros()

    def __init__(self, model, stage: Stage):
        self.model, self.stage = model, stage
        self.dense, self.pre_experts = model.dense, model.pre_experts

    def layers(self, cache: KVCache):
        return zip(self.model.model.layers[self.stage.first:self.stage.last], repeat(cache))

    def enter(self, x, start):
        """First stage: token ids [T] -> embeddings; later stages: the hidden state [T, H] as received.
        Then cos/sin of positions start .. start+T-1."""
        if self.stage.is_first:
            return self.model.enter(x, start)
        pos = torch.arange(x.shape[0], device=x.device) + start
        cos, sin = self.model.rope.cos_sin(pos, x.dtype)
        return x, cos, sin

    def head(self, x, out, logits_for: str = "all"):
        if self.stage.is_last:
            return self.model.head(x, out, logits_for)
        return x if out is None else x + out


class ShiftedExperts:
    """A provider over a stage's own MoE layers, called with the model's MoE layer numbers. `guess`:
    the next-layer policy's guesses, over the stage's own layers (passed on each call, as
    PlainDecoder passes them)."""

    def __init__(self, inner, offset: int, guess=None):
        self.inner, self.offset, self.guess = inner, offset, guess

    def __call__(self, layer, x, ids, weights):
        if self.guess is not None:
            return self.inner(layer - self.offset, x, ids, weights, guess=self.guess)
        return self.inner(layer - self.offset, x, ids, weights)

    def stats(self) -> dict:
        return dict(getattr(self.inner, "stats", lambda: {})())

    def reset_stats(self) -> None:
        getattr(self.inner, "reset_stats", lambda: None)()

    def close(self) -> None:
        getattr(self.inner, "close", lambda: None)()


def stage_cache(spec, stage: Stage, max_len: int, device, dtype) -> KVCache:
    """A KV cache holding only this stage's layers (the others' entries are 1-row placeholders)."""
    cache = KVCache(spec, 1, device, dtype)
    for l in range(stage.first, stage.last):
        k, v = cache.k[l], cache.v[l]
        big = k.new_zeros(k.shape[0], max_len, k.shape[2])
        cache.v[l] = big[..., :v.shape[-1]] if v.data_ptr() == k.data_ptr() else v.new_zeros(v.shape[0], max_len,
                                                                                                v.shape[2])
        cache.k[l] = big
    cache.max_len = max_len
    return cache


def drop_others(model, stage: Stage, dtype: torch.dtype) -> None:
    """Removes what this stage never runs (left on the meta device by a stage's load): other layers'
    modules, the embedding table (all but the first stage), the final norm and lm_head (all but the
    last); each dropped weight becomes an empty tensor of `dtype`."""
    layers = model.model.layers
    for l in range(len(layers)):
        if not stage.first <= l < stage.last:
            layers[l] = nn.Identity()
    if not stage.is_first:
        model.model.embed_tokens.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
    if not stage.is_last:
        model.lm_head.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        model.lm_head.bias = None
        model.model.norm = nn.Identity()


class StageModel:
    """This rank's loaded stage: the model's loop over its layers with its own provider. A drafting
    policy's stage also holds its layers' part of the speculation: `lookahead` (rows over its own MoE
    layers), `planner` (specter: prefetching its own layers' experts from those rows), `guessing`
    (specter's K = 0 steps: next-layer guesses within the stage) and `mgr`, the offload manager under
    them (None where the stage has no MoE layer). The first stage of a drafting policy also holds the
    whole draft (`whole`): every layer's non-expert weights, every MoE layer's INT4 experts (`draft`,
    recording into `whole_lookahead`, whose first rows' columns are its own `lookahead`) and a KV
    cache of every layer, so the K draft steps of a cycle cross no boundary (speculative.py)."""

    def __init__(self, model, provider, stage: Stage, device, dtype, plan=None, tokenizer=None, path=None):
        self.model, self.provider, self.stage = model, provider, stage
        self.device, self.dtype, self.plan, self.tokenizer, self.path = device, dtype, plan, tokenizer, path
        self.pieces = StagePieces(model, stage)
        self.cache: KVCache | None = None
        self.mgr = self.draft = self.planner = self.guessing = self.lookahead = self.whole_lookahead = None
        self.whole = False  # this stage holds the whole draft and a KV cache of every layer
        self.k_max = 0  # a drafting policy's longest draft (the wire's inline rows follow it)
        self.step_s = 0.0  # wall seconds in `forward` since reset_stats (stats: step_s)
        self.prefill_stall_s = None  # the stage's stall_s after its first target step since reset_stats

    @property
    def all_resident(self) -> bool:
        """Nothing of this stage is ever copied (no MoE layer, every expert resident, or no offloading)."""
        return self.mgr is None or self.mgr.all_resident

    def begin(self, max_len: int) -> None:
        spec = self.model.spec
        self.cache = (KVCache(spec, max_len, self.device, self.dtype) if self.whole
                      else stage_cache(spec, self.stage, max_len, self.device, self.dtype))

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, start: int, experts=None, logits_for: str = "last") -> torch.Tensor:
        """Token ids [T] (first stage) or the hidden state [T, H] -> the hidden state [T, H], or fp32
        logits ([1, V] for "last", [T, V] for "all") on the last stage. `experts`: the provider to run
        (default the target's)."""
        if start + x.shape[0] > self.cache.max_len:
            raise IndexError(f"positions up to {start + x.shape[0]} exceed the KV cache ({self.cache.max_len})")
        t = time.perf_counter()
        try:
            return self.model.run(x, start, self.cache, self.provider if experts is None else experts, logits_for,
                                  pieces=self.pieces)
        finally:
            self.step_s += time.perf_counter() - t
            if experts is None and self.prefill_stall_s is None and self.provider is not None:  # the prompt's
                self.prefill_stall_s = self.provider.stats().get("stall_s", 0.0)

    @torch.inference_mode()
    def draft_forward(self, tokens: torch.Tensor, start: int, logits_for: str = "last") -> torch.Tensor:
        """One step of the whole draft (`whole` only): token ids [T] -> fp32 logits, every layer run here
        with the INT4 experts, as the single-process draft runs."""
        if start + tokens.shape[0] > self.cache.max_len:
            raise IndexError(f"positions up to {start + tokens.shape[0]} exceed the KV cache ({self.cache.max_len})")
        return self.model.run(tokens, start, self.cache, self.draft, logits_for)

    def stats(self) -> dict:
        s = self.provider.stats() if self.provider is not None else {}
        s["step_s"] = self.step_s
        s["prefill_stall_s"] = self.prefill_stall_s or 0.0  # (decode_stall_s: stall_s less this, summed)
        if self.planner is not None:
            s["cover_hits"], s["cover_total"] = self.planner.cover_hits, self.planner.cover_total
        return s

    def reset_stats(self) -> None:
        self.step_s, self.prefill_stall_s = 0.0, None
        if self.provider is not None:
            self.provider.reset_stats()
        if self.planner is not None:
            self.planner.reset_stats()

    def close(self) -> None:
        if self.provider is not None:
            self.provider.close()


def kv_row_bytes(spec, dtype: torch.dtype) -> int:
    """Bytes of one layer's K/V at one position (MLA: the latent and its rotary key)."""
    n = spec.kv_lora_rank + spec.qk_rope_dim if spec.attention == "mla" else 2 * spec.n_kv_heads * spec.head_dim
    return n * dtype.itemsize


def kv_rows(cache: KVCache, spec, first: int, last: int, start: int, T: int) -> torch.Tensor:
    """Layers [first, last)'s K/V at positions [start, start+T), as bytes (layer by layer, k then v)."""
    parts = []
    for l in range(first, last):
        parts.append(cache.k[l][:, start:start + T].reshape(-1).view(torch.uint8))
        if spec.attention != "mla":  # MLA's v is a view of k
            parts.append(cache.v[l][:, start:start + T].reshape(-1).view(torch.uint8))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def put_kv_rows(cache: KVCache, spec, first: int, last: int, start: int, T: int, data: torch.Tensor) -> None:
    """Writes kv_rows' bytes `data` into `cache`."""
    o = 0
    for l in range(first, last):
        for t in (cache.k[l],) if spec.attention == "mla" else (cache.k[l], cache.v[l]):
            dst = t[:, start:start + T]
            n = dst.numel() * dst.element_size()
            dst.copy_(data[o:o + n].view(dst.dtype).view(dst.shape))
            o += n


def lookahead_columns(whole, n: int):
    """A Lookahead over the first `n` MoE layers of `whole`'s, sharing its rows (views)."""
    from ..speculative.draft import Lookahead

    la = Lookahead.__new__(Lookahead)
    la.__dict__.update(whole.__dict__)
    la.ids, la.weights, la.host = whole.ids[:, :n], whole.weights[:, :n], whole.host[:, :n]
    la.n_layers, la._events = n, [None] * whole.k_max
    return la
