"""The draft's one-token step with zero host syncs, eager or compiled (torch.compile, fullgraph).

Everything the step reads or writes is a static device buffer, updated in place, so the host only
launches work and K steps run back to back without ever waiting for the device:

    tokens [K_max+1] int64   tokens[0] = the pending token; step i reads tokens[i], writes tokens[i+1]
    base, row        0-d     position of tokens[0]; the step's row (incremented by the step)
    lookahead rows   [K_max, L, k]   the draft routers' choices (GatheredExperts writes row `row`)
    noise            [V]     sampling: the drafted position's Exp(1) noise (sampling.Draws), filled (eagerly)
                             before each step
    KV cache         static buffers, written at `base + row` with index_copy_, masked by position

Greedy drafts take the argmax; sampled drafts take argmax(q / noise), the exponential race with the
noise the target draws that position's token with (sampling.py: a drafted token is kept when both
draws agree), and need no multinomial (no host sync, graph safe). Temperature, top-k and top-p are
0-d tensors, so no sampling setting is a recompile.

The routed experts are gathered, not grouped on the host:

    x [1, H], ids [1, k]
      -> w13[ids] [k, 2I, H] @ x -> [k, 2I] -> silu(gate) * up      [k, I]
      -> w2[ids]  [k, H, I]  @ .  -> [k, H]  -> sum_j weight_j * y_j  [1, H]   (top-k order)

The host learns each lookahead row through `Lookahead.publish` (a non-blocking copy into a host
mirror plus an event), never by waiting on the step. The acceptance read after verification is
the cycle's only read of drafted tokens (decoder.py).

On CPU the draft's experts are dequantised and gathered as above; on CUDA they stay packed INT4
and the step calls the fused MoE op (specter.triton_ops.fused_moe, a custom op torch.compile
traces through).

The draft's tokens may differ in the last bits from the eager draft's (a different summation
order); that changes nothing downstream, because verification by the target decides every
committed token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specter.compiled.capture import own_code
from specter.layers import KVCache
from specter.model import MoETransformer
from specter.moe import ExpertWeights
from specter.sampling import Draws, SamplingParams
from specter.speculative.draft import Lookahead
from specter.triton_ops import Int4Experts, fused_moe


class GatheredExperts:
    """Expert provider for one token over resident weights, without host syncs (graph friendly).
    Records the router's choice into `lookahead` at row `self.row` (a 0-d tensor). Dense weights
    are gathered (below); packed INT4 ones (Int4Experts, the CUDA draft) go through the fused MoE
    custom op, which reads routing on the device only."""

    def __init__(self, layers: list[ExpertWeights], lookahead: Lookahead, row: torch.Tensor):
        self.layers, self.lookahead, self.row = layers, lookahead, row

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # x [1, H], ids [1, k], weights [1, k]
        at = self.row.view(1)
        self.lookahead.ids[:, layer].index_copy_(0, at, ids.to(torch.int32))
        self.lookahead.weights[:, layer].index_copy_(0, at, weights.float())
        ew = self.layers[layer]
        if isinstance(ew.w13, Int4Experts):
            return fused_moe(x, ids, weights, ew.w13, ew.w2)           # [1, H]
        h = torch.matmul(ew.w13[ids[0]], x[0])                          # [k, 2I]
        gate, up = h.chunk(2, dim=-1)
        y = torch.matmul(ew.w2[ids[0]], (F.silu(gate) * up)[..., None])[..., 0]  # [k, H]
        return (y * weights[0, :, None].to(y.dtype)).sum(0, keepdim=True)        # [1, H]


def draft_layers(draft) -> list[ExpertWeights]:
    """The draft's experts per MoE layer, as the step reads them: dense (unpacked) or Int4Experts."""
    if draft.packed:
        return [ExpertWeights(w13, w2) for w13, w2 in zip(draft.q13, draft.q2)]
    return draft.layers


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """sampling.probs (without penalties) with its settings as 0-d tensors: logits [N, V] ->
    probabilities [N, V] fp32. top_k = V, top_p > 1 and min_p = 0 turn those filters off (the
    same tokens survive as in `probs`)."""
    z = logits.float() / temperature
    sorted_z, order = torch.sort(z, dim=-1, descending=True, stable=True)   # [N, V] (ties: one order a batch)
    kth = sorted_z.gather(-1, (top_k - 1).expand(z.shape[0], 1))           # [N, 1]
    z = z.masked_fill(z < kth, float("-inf"))
    p = torch.softmax(z, dim=-1)
    sorted_p = p.gather(-1, order)
    drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p                        # mass of more likely tokens
    drop[..., 0] = False                             # the likeliest always kept (a top_p fp32 rounds to 0)
    p = p.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), 0.0)
    p = p / p.sum(-1, keepdim=True)
    p = p.masked_fill(p < min_p * p.amax(-1, keepdim=True), 0.0)
    return p / p.sum(-1, keepdim=True)


class DraftStep:
    """K sync-free draft steps: `begin(t, n, params)`, then `step(cache, draws)` K times; the drafted
    tokens are `tokens[1:K+1]` (device).

    compile=True runs the step under torch.compile(fullgraph=True): Inductor on CPU; on CUDA
    mode="reduce-overhead" (CUDA graphs). `backend` overrides (tests pass a capture-checking one)."""

    def __init__(self, model: MoETransformer, layers: list[ExpertWeights], lookahead: Lookahead, *,
                 compile: bool = False, backend=None, mode: str | None = None):
        dev = lookahead.ids.device
        V = model.spec.vocab_size
        self.model, self.lookahead, self.compiled = model, lookahead, compile
        self.graphs = False  # CUDA graphs (mode "reduce-overhead"): recorded per KV cache and thread
        self.tokens = torch.zeros(lookahead.k_max + 1, dtype=torch.int64, device=dev)
        self.base = torch.zeros((), dtype=torch.int64, device=dev)
        self.row = torch.zeros((), dtype=torch.int64, device=dev)
        self.noise = torch.ones(V, dtype=torch.float32, device=dev)
        self.temperature = torch.ones((), dtype=torch.float32, device=dev)
        self.top_k = torch.full((), V, dtype=torch.int64, device=dev)
        self.top_p = torch.full((), 2.0, dtype=torch.float32, device=dev)
        self.min_p = torch.zeros((), dtype=torch.float32, device=dev)
        self.experts = GatheredExperts(layers, lookahead, self.row)
        self._cache, self._sample, self._i, self._n = None, False, 0, 0
        fns = (self._step_greedy, self._step_sampled)
        if compile:
            if mode is None and dev.type == "cuda":
                mode = "reduce-overhead"
            self.graphs = backend is None and mode == "reduce-overhead"
            for t in self.static_inputs():
                torch._dynamo.mark_static_address(t)
            kw = dict(fullgraph=True, mode=mode) if backend is None else \
                dict(fullgraph=True, backend=backend)
            fns = tuple(torch.compile(own_code(f), **kw) for f in fns)
        self._greedy, self._sampled = fns

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def static_inputs(self) -> list[torch.Tensor]:
        """Every tensor the step reads through plain Python objects (module parameters and buffers are
        static already): the step's buffers, the lookahead rows and the draft's experts, dense or the
        packed tensors of Int4Experts. Marked static, a CUDA graph reads them where they are; any
        other tensor input would be copied into the graph's own buffer before every replay (the whole
        draft, every draft step). The KV cache is marked when a new one arrives (`step`)."""
        la = self.lookahead
        out = [self.tokens, self.base, self.row, self.noise, self.temperature, self.top_k, self.top_p, self.min_p,
               la.ids, la.weights]
        for ew in self.experts.layers:
            for w in (ew.w13, ew.w2):
                out.extend(w.tensors().values() if isinstance(w, Int4Experts) else (w,))
        return out

    # --------------------------------------------------------------------- the traced steps
    def _step_greedy(self, cache: KVCache) -> None:
        at = self.row.view(1)
        logits = self.model.run(self.tokens.index_select(0, at), self.base + self.row, cache, self.experts)  # [1, V]
        self.tokens.index_copy_(0, at + 1, logits.argmax(-1))
        self.row.add_(1)

    def _step_sampled(self, cache: KVCache) -> None:
        at = self.row.view(1)
        logits = self.model.run(self.tokens.index_select(0, at), self.base + self.row, cache, self.experts)
        p = filtered_probs(logits, self.temperature, self.top_k, self.top_p, self.min_p)  # [1, V]
        self.tokens.index_copy_(0, at + 1, (p / self.noise).argmax(-1))
        self.row.add_(1)

    # ------------------------------------------------------------------------------ host API
    def begin(self, t: int, n: int, params: SamplingParams) -> None:
        """A new cycle: pending token t at position n. Host scalars go in with fill_ (no sync).
        Penalties are not applied here: the decoder drafts eagerly when any is set."""
        self.tokens[:1].fill_(t)
        self.base.fill_(n)
        self.row.zero_()
        self._sample, self._i, self._n = not params.greedy, 0, n
        if self._sample:
            V = self.noise.shape[0]
            self.temperature.fill_(params.temperature)
            self.top_k.fill_(params.top_k if 0 < params.top_k < V else V)
            self.top_p.fill_(params.top_p if params.top_p < 1.0 else 2.0)
            self.min_p.fill_(params.min_p)
        self.lookahead.begin()

    def step(self, cache: KVCache, draws: Draws | None = None) -> None:
        """Draft one token (sampling: with `draws`' noise for its position, n + 1 + i) and publish its
        lookahead row; returns before the device is done. At most K_max steps a cycle: a step past
        them would index the step's buffers out of bounds on the device (under a CUDA graph, a
        device-side assert that kills the process), so it is refused here."""
        if self._i >= self.lookahead.k_max:
            raise RuntimeError(f"draft step: {self._i} steps this cycle already, the most its buffers hold "
                               f"(K_max = {self.lookahead.k_max}); call begin() for a new cycle")
        if cache is not self._cache:  # a new cache: its length is symbolic, not a recompile
            if self.compiled:
                for t in cache.k + cache.v:  # (v may be a view of k: the MLA latent)
                    torch._dynamo.mark_dynamic(t, 1)
                    torch._dynamo.mark_static_address(t)
            self._cache = cache
        with torch.no_grad():
            if self._sample:
                draws.fill(self.noise, self._n + 1 + self._i)
                self._sampled(cache)
            else:
                self._greedy(cache)
        self.lookahead.publish(self._i)
        self._i += 1

    def recordings(self) -> int:
        """CUDA graphs the step records per KV cache and per thread: greedy and sampled."""
        return 2

    def warmup(self, cache_len: int = 64, cache: KVCache | None = None, repeat: int = 1) -> None:
        """Compile (or trace) both steps now, on a scratch cache, so the first generation's timings
        (which the governor learns from) do not include it. With `cache` (the one generations will
        use), each step runs `repeat` times on it: under CUDA graphs repeat=2 records both graphs
        on this thread (a graph's first run is its warm-up). Rows written are scratch."""
        dev = self.tokens.device
        n = 3 if cache is None else 0
        if cache is None:
            cache = KVCache(self.model.spec, cache_len, dev, self.dtype)
        for _ in range(repeat):
            self.begin(0, n, SamplingParams())
            self.step(cache)
            self.begin(0, n, SamplingParams(temperature=1.0))
            self.step(cache, Draws(0, dev))
        self._cache = None
