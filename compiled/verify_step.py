"""Verification in pieces: the target's forward compiled between its MoE layers.

A verification runs the target over T = K+1 tokens at positions n .. n+K. Everything but the routed
experts is static work, so it is compiled (torch.compile, fullgraph; CUDA graphs on CUDA) in
segments; each MoE layer's routed experts run eagerly between two segments, through the offload
manager (its one small routing read, its waits for late copies) and the fused MoE op:

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
import torch.nn.functional as F

from specter import sansio
from specter.compiled.capture import own_code
from specter.layers import KVCache
from specter.model import MoETransformer
from specter.moe import ExpertProvider
from specter.profiling import span


def width_buckets(k_max: int) -> tuple[int, ...]:
    """Verification widths the step pads to: powers of two up to half of K_max+1, then K_max+1
    itself (K_max 32: 1, 2, 4, 8, 16, 33, as the issue asked). Padding costs the non-expert pieces
    only: the routed experts run on the real rows."""
    top, w, out = k_max + 1, 1, []
    while 2 * w <= top:
        out.append(w)
        w *= 2
    return tuple(out) + (top,)


def graph_plan(n_layers: int, vocab: int, hidden: int, k_max: int, itemsize: int) -> dict:
    """The CUDA graphs a speculative engine records per generating thread and KV cache: the
    verifier's widths x (layers + 2) (VerifyStep.recordings) and the draft step's two. Their memory
    is one pool per thread that every graph reuses (each verification one path through it), so it
    is about the widest verification's working set: its fp32 logits (and their clone) and a few
    [W, hidden] activations; attention keeps no scores (fused SDPA). An estimate: the engine
    measures what the recordings took (stats["cuda_graphs"]["bytes"])."""
    widths = width_buckets(k_max)
    W = widths[-1]
    verify = len(widths) * (n_layers + 2)
    pool = 2 * W * vocab * 4 + 16 * W * hidden * itemsize
    return dict(recordings=verify + 2, verify=verify, draft=2, widths=len(widths), pool_bytes=pool)


class LayerKV(KVCache):
    """One layer's K/V buffers seen as a cache: what a segment's attention writes. The layer index
    the attention module passes is ignored, so one graph serves every layer."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, max_len: int):
        self.k, self.v, self.max_len = [k], [v], max_len

    def update(self, layer: int, start, k: torch.Tensor, v: torch.Tensor | None):
        return super().update(0, start, k, v)


class VerifyStep:
    """`step(tokens [T], n, cache, experts) -> logits [T, V]` (fp32): the target's forward at positions
    n .. n+T-1, as `MoETransformer.forward` computes it, with the non-expert work compiled.

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
        self.zeros = torch.zeros(W, H, dtype=model.dtype, device=dev)        # the first segment's mlp_out
        self._cache, self._kv = None, []
        fns = (self._enter, self._dense, self._moe_in, self._head)
        if compile:
            for t in (self.tokens, self.base, self.zeros):
                torch._dynamo.mark_static_address(t)
            kw = dict(fullgraph=True, backend=backend) if backend is not None else \
                dict(fullgraph=True, mode="reduce-overhead" if self.graphs else mode)
            fns = tuple(torch.compile(own_code(f), **kw) for f in fns)
        self.enter, self.dense, self.moe_in, self.head = fns

    # --------------------------------------------------------------------- the traced pieces
    def _enter(self, tokens):
        x = self.model.model.embed_tokens(tokens)                                 # [W, H]
        pos = torch.arange(tokens.shape[0], device=tokens.device) + self.base     # [W]
        cos, sin = self.model.rope.cos_sin(pos, x.dtype)
        return x, cos, sin

    def _dense(self, layer, x, mlp_out, cos, sin, kv: LayerKV):
        return layer(x + mlp_out, self.model.rope, cos, sin, kv, self.base, None)  # [W, H]

    def _moe_in(self, layer, x, mlp_out, cos, sin, kv: LayerKV):
        x = x + mlp_out
        x = x + layer.self_attn(layer.input_layernorm(x), self.model.rope, cos, sin, kv, self.base)
        h = layer.post_attention_layernorm(x)
        shared, ids, w = layer.mlp.prepare(h)
        return x, h, ids, w, shared

    def _head(self, x, mlp_out):
        return self.model.logits(x + mlp_out)                                      # [W, V] fp32

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

    def _layer_kv(self, cache: KVCache) -> list[LayerKV]:
        if cache is not self._cache:  # a new cache: its length is symbolic, not a recompile
            if self.compiled:
                for t in cache.k + cache.v:
                    torch._dynamo.mark_dynamic(t, 1)
                    torch._dynamo.mark_static_address(t)
            self._kv = [LayerKV(k, v, cache.max_len) for k, v in zip(cache.k, cache.v)]
            self._cache = cache
        return self._kv

    def _out(self, t):
        """A piece's output, cloned when the next replay of a CUDA graph would overwrite it."""
        if not self.graphs or t is None:
            return t
        return t.clone()

    def step(self, tokens: torch.Tensor, n: int, cache: KVCache, experts: ExpertProvider) -> torch.Tensor:
        return sansio.drive(self.body(tokens, n, cache, experts))

    @torch.no_grad()
    def body(self, tokens: torch.Tensor, n: int, cache: KVCache, experts: ExpertProvider, only=None):
        """`step` as a body (specter/sansio.py): each MoE layer's routing read and copy waits are
        yielded, so an asyncio driver awaits exactly the copies each layer needs. `only`: run just
        these layers (indices; the compile warm-up under CUDA graphs)."""
        T = tokens.shape[0]
        W = self.width(T)
        if n + W > cache.max_len:
            raise IndexError(f"positions up to {n + W} exceed the KV cache ({cache.max_len}): "
                             f"verification pads to {W} and needs {self.headroom} rows of headroom")
        kv = self._layer_kv(cache)
        self.tokens[:T].copy_(tokens)  # host-to-device at most (tokens built on the host): no sync
        self.base.fill_(n)
        if self.graphs:  # one path of graphs per verification (see the module docstring)
            torch.compiler.cudagraph_mark_step_begin()
        x, cos, sin = map(self._out, self.enter(self.tokens[:W]))
        mlp_out = self.zeros[:W]
        model = self.model.model
        layers = zip(model.layers, model.span_names, kv)
        if only is not None:
            layers = [entry for i, entry in enumerate(layers) if i in only]
        for layer, name, lkv in layers:
            with span(name):
                if not layer.is_moe:
                    x = self._out(self.dense(layer, x, mlp_out, cos, sin, lkv))
                    mlp_out = self.zeros[:W]
                    continue
                x, h, ids, w, shared = map(self._out, self.moe_in(layer, x, mlp_out, cos, sin, lkv))
                y = yield from sansio.call(experts, layer.mlp.moe_index, h[:T], ids[:T], w[:T])  # [T, H], eagerly
                mlp_out = F.pad(y, (0, 0, 0, W - T)) if W > T else y
                if shared is not None:
                    mlp_out = mlp_out + shared
        return self._out(self.head(x, mlp_out))[:T]                             # [T, V]

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
        only = None
        if cache is None:
            cache = KVCache(self.model.spec, max(cache_len, 3 + self.buckets[-1]), dev, self.model.dtype)
            runs = [(T, 3) for T in (1, 2, 3) if T <= self.buckets[-1]]
            if self.graphs:  # compiling needs one layer of each kind; none is recorded
                kinds = {layer.is_moe: i for i, layer in reversed(list(enumerate(self.model.model.layers)))}
                only = set(kinds.values())
        else:
            runs = [(W, 0) for W in self.buckets if W <= cache.max_len] * repeat
        for T, n in runs:
            sansio.drive(self.body(torch.zeros(T, dtype=torch.int64, device=dev), n, cache, _no_experts, only))
        self._cache, self._kv = None, []


def _no_experts(layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x)
