"""The draft's one-token step, compiled with torch.compile (Inductor).

Eager, one drafted token of a small MoE is mostly dispatch: a few hundred tiny ops, each a
Python call and a kernel launch. Compiled, Inductor fuses the norms, RoPE and attention glue, and
the routed experts become one gather and two batched GEMVs, with no host read of the routing:

    x [1, H], ids [1, k]
      -> w13[ids] [k, 2I, H] @ x -> [k, 2I] -> silu(gate) * up      [k, I]
      -> w2[ids]  [k, H, I]  @ .  -> [k, H]  -> sum_j weight_j * y_j  [1, H]   (top-k order)

The step writes its routing into the lookahead buffer at a row given as a 0-d tensor, and
positions and KV cache lengths are symbolic, so one graph serves every row, position and
generation: nothing recompiles after `warmup`, which the builder calls at load (10-25 s on two CPU
cores; Inductor's on-disk cache makes later loads faster).

Measured on the bundled model (2-core CPU): a draft step takes ~2.8 ms eager and ~1.7 ms compiled.
In a link-bound decode that buys less than it seems (`bench/compile_speedup.py`, side by side:
decode 7% faster at 25% residency, 13% at 50%), because a shorter draft also hides fewer copies:
at 25% the draft's share of decode time fell from 27% to 19% and the copy stall's rose from 64%
to 71%.

CPU only for now: on CUDA the draft keeps quanto's packed INT4 tensors, which the gather above
cannot index; a compiled (and CUDA-graph) step over packed INT4 is the next piece.

The draft's tokens may differ in the last bits from the eager draft's (a different summation
order); that changes nothing downstream, because verification by the target decides every
committed token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specter.layers import KVCache
from specter.model import MoETransformer
from specter.moe import ExpertWeights
from specter.speculative.lookahead import Lookahead


class GatheredExperts:
    """Expert provider for one token over resident weights, without host syncs (graph friendly).
    Records the router's choice into `lookahead` at row `self.row` (a 0-d tensor)."""

    def __init__(self, layers: list[ExpertWeights], lookahead: Lookahead):
        self.layers, self.lookahead = layers, lookahead
        self.row = torch.zeros(1, dtype=torch.int64, device=lookahead.ids.device)

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # x [1, H], ids [1, k], weights [1, k]
        self.lookahead.ids[:, layer].index_copy_(0, self.row, ids.to(torch.int32))
        self.lookahead.weights[:, layer].index_copy_(0, self.row, weights.float())
        ew = self.layers[layer]
        h = torch.matmul(ew.w13[ids[0]], x[0])                          # [k, 2I]
        gate, up = h.chunk(2, dim=-1)
        y = torch.matmul(ew.w2[ids[0]], (F.silu(gate) * up)[..., None])[..., 0]  # [k, H]
        return (y * weights[0, :, None].to(y.dtype)).sum(0, keepdim=True)        # [1, H]


class CompiledDraftStep:
    """draft_step(token [1], start, row, cache) -> logits [1, V]; fills lookahead row `row`."""

    def __init__(self, model: MoETransformer, layers: list[ExpertWeights], lookahead: Lookahead):
        self.model, self.experts = model, GatheredExperts(layers, lookahead)
        self._step = torch.compile(self._run, dynamic=True)
        self._cache = None

    def warmup(self) -> None:
        """Compile now, on a scratch cache, so the first generation's timings (which the governor
        learns from) do not include the compile."""
        dev = self.experts.row.device
        # position 4 and row 2, not 0 or 1: torch.compile specialises on those two values
        self(torch.zeros(1, dtype=torch.int64, device=dev), 4, 2, KVCache(self.model.spec, 16, dev, self.dtype))

    @property
    def dtype(self) -> torch.dtype:
        return self.model.lm_head.weight.dtype

    def _run(self, token: torch.Tensor, start: int, cache: KVCache) -> torch.Tensor:
        return self.model.run(token, start, cache, self.experts)

    def __call__(self, token: torch.Tensor, start: int, row: int, cache: KVCache) -> torch.Tensor:
        if start + 1 > cache.max_len:
            raise IndexError(f"position {start} is past the KV cache ({cache.max_len})")
        if cache is not self._cache:  # a new generation's cache: its length is symbolic, not a recompile
            for t in cache.k + cache.v:  # (v may be a view of k: the MLA latent)
                torch._dynamo.mark_dynamic(t, 1)
            self._cache = cache
        with torch.no_grad():
            self.experts.row.fill_(row)
            return self._step(token, start, cache)
