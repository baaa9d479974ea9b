"""Verification in pieces: the target's forward compiled between its MoE layers.

A verification runs the target over T = K+1 tokens at positions n .. n+K. Everything but the routed
experts is static work, so it is compiled (torch.compile, fullgraph; CUDA graphs on CUDA) in
segments; each MoE layer's routed experts run eagerly between two segments, through the offload
manager (its one small routing read, its waits for late copies) and the fused MoE op. The loop is
the model's own (`MoETransformer.run(..., pieces=step, rows=T)`); the segments are the model's piece
methods (enter, dense, pre_experts, head), compiled:

    tokens [T] -> padded to a width bucket W (1, 2, 4, 8, 16, ..., K_max+1)     rows T..W-1: scratch
    enter         embed [W, H]; cos/sin of positions base + arange(W)           (base: 0-d, on the device)
    per layer l   dense: x = layer(x + mlp_out)                                   -> x [W, H]
                  MoE:   x += mlp_out; x += attn(norm(x)); h = norm2(x);          -> x, h [W, H], ids/w [W, k],
                         shared expert(h); router(h)                                 shared [W, H] | None
                         then eagerly: y = experts(moe, h[:T], ids[:T], w[:T])     (the real rows only)
                                       mlp_out = pad(y, W) (+ shared)
    head          x += mlp_out; fp32 norm + lm_head -> logits [W, V] -> [:T]

One traced function per kind of piece serves every layer: a segment takes the layer's K/V buffers
(`LayerKV`), not the cache object, so the layer index is never a constant of the graph. The width
is dynamic after W = 1 (Dynamo's automatic dynamic shapes: two graphs per piece, W = 1 and W >= 2);
on CUDA the buckets bound how many CUDA graphs are recorded (see below). KV is
written at base + i for all W rows, so the cache needs W - 1 rows of headroom past n + T (`headroom`);
rows past n + T are scratch, as a rejected draft's are, and every query attends only positions up to
its own, so padding never reaches a real row. Attention masks the whole static buffer by position
(as the draft step does), so nothing depends on a host integer.

Outputs a later replay overwrites (CUDA graphs) are cloned before the next piece runs; on CPU
nothing is replayed and nothing is cloned.

CUDA graphs read every weight and K/V buffer where it is (parameters and marked buffers: static
inputs, never copied), so a graph is recorded per static address set: one per layer (each has its
own weights and K/V), per width bucket, per KV cache and per thread (cudagraph trees keep their
graphs per thread). `recordings()` is that bound per cache and thread, len(buckets) x (layers + 2);
`warmup(cache=...)` records them all on the calling thread before a generation times anything
(the speculative decoder does it on each thread and cache it generates with). A verification is one
step of cudagraph trees (marked at its start, not between pieces), so its pieces form one path of
the tree, as graphs split by graph breaks do: each piece's graph is found among the children of the
piece before it, one candidate per layer, rather than among every layer's recordings of that piece
(a root per layer: a scan of up to `layers` candidates at each call).
"""
from __future__ import annotations

import torch

from specter.compiled.capture import own_code
from specter.layers import KVCache
from specter.model import MoETransformer
from specter.moe import ExpertProvider


def width_buckets(k_max: int) -> tuple[int, ...]:
    """Verification widths the step pads to: powers of two up to half of K_max+1, then K_max+1
    itself (K_max 32: 1, 2, 4, 8, 16, 33, as the issue asked). Padding costs the non-expert pieces
    only: the routed experts run on the real rows."""
    top, w, out = k_max + 1, 1, []
    while 2 * w <= top:
        out.append(w)
        w *= 2
    return tuple(out) + (top,)


def graph_plan(n_layers: int, vocab: int, hidden: int, k_max: int, itemsize: int, draft: bool = True) -> dict:
    """The CUDA graphs an engine records per generating thread and KV cache: the verifier's widths x
    (layers + 2) (VerifyStep.recordings) and the draft step's two; a plain engine (draft False,
    k_max 0) its one-token step's layers + 2. Their memory
    is one pool per thread that every graph reuses (each verification one path through it), so it
    is about the widest verification's working set: its fp32 logits (and their clone) and a few
    [W, hidden] activations; attention keeps no scores (fused SDPA). An estimate: the engine
    measures what the recordings took (stats["cuda_graphs"]["bytes"])."""
    widths = width_buckets(k_max)
    W = widths[-1]
    verify = len(widths) * (n_layers + 2)
    pool = 2 * W * vocab * 4 + 16 * W * hidden * itemsize
    drafts = 2 if draft else 0
    return dict(recordings=verify + drafts, verify=verify, draft=drafts, widths=len(widths), pool_bytes=pool)


# Lossless means the verifier computes what plain eager decoding computes, to the bit: Inductor
# must round each 16-bit op's output as eager does (not keep fused intermediates in fp32), and not
# fold a residual add into its matmul (x + mm -> addmm: one rounding instead of two).
EAGER_NUMERICS = {"emulate_precision_casts": True, "pattern_matcher": False}


def eager_numerics(mode: str | None) -> dict:
    """torch.compile options: `mode`'s (torch.compile takes a mode or options, not both) and
    EAGER_NUMERICS, applied to these compiles only (the process's Inductor config is untouched)."""
    from torch._inductor import list_mode_options

    return {**(list_mode_options(mode) if mode not in (None, "default") else {}), **EAGER_NUMERICS}


class LayerKV(KVCache):
    """One layer's K/V buffers seen as a cache: what a segment's attention writes. The layer index
    the attention module passes is ignored, so one graph serves every layer."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, max_len: int):
        self.k, self.v, self.max_len = [k], [v], max_len

    def update(self, layer: int, start, k: torch.Tensor, v: torch.Tensor | None):
        return super().update(0, start, k, v)


class VerifyStep:
    """`step(tokens [T], n, cache, experts) -> logits [T, V]` (fp32): the target's forward at positions
    n .. n+T-1, as `MoETransformer.forward` computes it: the model's own layer loop (`run`) over its
    own pieces, here compiled, on a width padded to a bucket.

    compile=False runs the same pieces eagerly (the reference for tests); compile=True runs them
    under torch.compile(fullgraph=True): Inductor on CPU, mode="reduce-overhead" (CUDA graphs) on
    CUDA. `backend` overrides (tests pass a capture-checking one)."""

    def __init__(self, model: MoETransformer, k_max: int, *, compile: bool = False, backend=None,
                 mode: str | None = None):
        dev, H = model.lm_head.weight.device, model.spec.hidden
        self.model, self.compiled = model, compile
        self.buckets = width_buckets(k_max)
        self.headroom = self.buckets[-1] - 1      # KV rows written past n + T at most
        self.graphs = compile and (mode == "reduce-overhead" or (mode is None and backend is None and dev.type == "cuda"))
        W = self.buckets[-1]
        self.tokens = torch.zeros(W, dtype=torch.int64, device=dev)      # the padded input
        self.base = torch.zeros((), dtype=torch.int64, device=dev)       # position of tokens[0]
        self.zeros = torch.zeros(W, H, dtype=model.dtype, device=dev)    # the first piece's `out`
        self._cache, self._kv, self._only = None, [], None
        fns = (model.enter, model.dense, model.pre_experts, model.head)  # the model's pieces, bound to it
        if compile:
            for t in (self.tokens, self.base, self.zeros):
                torch._dynamo.mark_static_address(t)
            kw = dict(fullgraph=True, backend=backend) if backend is not None else \
                dict(fullgraph=True, options=eager_numerics("reduce-overhead" if self.graphs else mode))
            fns = tuple(torch.compile(own_code(f), **kw) for f in fns)
        if self.graphs:  # a replay overwrites the outputs of the one before: clone them first
            fns = tuple(_cloned(f) for f in fns)
        self.enter, self.dense, self.pre_experts, self.head = fns

    # ------------------------------------------------------------------------------ host API
    def recordings(self) -> int:
        """CUDA graphs the pieces record per KV cache and per thread: every width bucket of enter and
        head, and of each layer's segment (one per layer: its weights and K/V are its static inputs)."""
        return len(self.buckets) * (len(self.model.model.layers) + 2)  # = graph_plan(...)["verify"]

    def width(self, T: int) -> int:
        for w in self.buckets:
            if w >= T:
                return w
        raise ValueError(f"verification of {T} tokens exceeds the largest width bucket {self.buckets[-1]}")

    def layers(self, cache: KVCache):
        """(layer, its LayerKV) for the model's loop: every layer, or the warm-up's `_only`."""
        if cache is not self._cache:  # a new cache: its length is symbolic, not a recompile
            if self.compiled:
                for t in cache.k + cache.v:
                    torch._dynamo.mark_dynamic(t, 1)
                    torch._dynamo.mark_static_address(t)
            self._kv = [LayerKV(k, v, cache.max_len) for k, v in zip(cache.k, cache.v)]
            self._cache = cache
        pairs = zip(self.model.model.layers, self._kv)
        return pairs if self._only is None else [p for i, p in enumerate(pairs) if i in self._only]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, n: int, cache: KVCache, experts: ExpertProvider) -> torch.Tensor:
        T = tokens.shape[0]
        W = self.width(T)
        if n + W > cache.max_len:
            raise IndexError(f"positions up to {n + W} exceed the KV cache ({cache.max_len}): "
                             f"verification pads to {W} and needs {self.headroom} rows of headroom")
        self.tokens[:T].copy_(tokens)  # host-to-device at most (tokens built on the host): no sync
        self.base.fill_(n)
        if self.graphs:  # one path of graphs per verification (see the module docstring)
            torch.compiler.cudagraph_mark_step_begin()
        return self.model.run(self.tokens[:W], self.base, cache, experts, pieces=self, rows=T)[:T]  # [T, V]

    def warmup(self, cache_len: int = 64, cache: KVCache | None = None, repeat: int = 1) -> None:
        """Compile every piece now (widths 1 and 2: the second makes the width dynamic, so no later
        width recompiles), on a scratch cache with stand-in experts (zeros: the offload manager is
        not touched), so the first generation's timings exclude it. Under CUDA graphs only the
        first layer of each kind runs: a graph's first run is its warm-up and a second one records
        it, and graphs recorded on the scratch cache would never replay.

        With `cache` (the one generations will use), run every width bucket that fits it `repeat`
        times on it instead: under CUDA graphs, the first run of a graph is its warm-up and the
        second records it, so repeat=2 records all `recordings()` graphs, on this thread. Rows
        written are scratch (past any committed length a generation reaches before writing them)."""
        dev = self.tokens.device
        if cache is None:
            cache = KVCache(self.model.spec, max(cache_len, 3 + self.buckets[-1]), dev, self.model.dtype)
            runs = [(T, 3) for T in (1, 2, 3) if T <= self.buckets[-1]]
            if self.graphs:  # compiling needs one layer of each kind; none is recorded
                kinds = {layer.is_moe: i for i, layer in reversed(list(enumerate(self.model.model.layers)))}
                self._only = set(kinds.values())
        else:
            runs = [(W, 0) for W in self.buckets if W <= cache.max_len] * repeat
        try:
            for T, n in runs:
                self.step(torch.zeros(T, dtype=torch.int64, device=dev), n, cache, _no_experts)
        finally:
            self._only = None
        self._cache, self._kv = None, []


def _cloned(fn):
    """A compiled piece whose outputs are cloned (CUDA graphs: the next replay overwrites them)."""
    def call(*args):
        out = fn(*args)
        if isinstance(out, torch.Tensor):
            return out.clone()
        return tuple(None if t is None else t.clone() for t in out)
    return call


def _no_experts(layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x)
