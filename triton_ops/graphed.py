"""expert_rows replayed from CUDA graphs: a decode-sized MoE call's launches for one host call.

On a GPU a decode-sized `expert_rows` is host-bound: the alignment and the two GEMM launches and
their allocations cost the host several times what the device takes (docs/RESULTS.md, "moehost").
`GraphedRows` captures each kind of call once and replays it:

    rows = GraphedRows()                          # CUDA: CudaGraphs(); tests inject a stand-in
    rows(x, ids, weights, w13, w2, remap=remap)   # == expert_rows(...), bit for bit (the same kernels)
    rows.fused_moe(x, ids, weights, w13, w2)      # == fused_moe(...): the combine in the same graph

A kind of call is its key: expert_rows or fused_moe, the weights (w13, w2: the slot pool or a
layer's experts, read where they are, their addresses static), T and the dtypes, and whether there
is a remap. x [T, H], ids and weights [T, k] and the remap [E] are copied into the key's own static
buffers, so every layer of a shared slot pool replays one graph per T (its remap row is an input,
not part of the key). A key's first call runs eagerly (Triton compiles its specialization; the allocator learns the sizes) and is
then captured; every later call copies its inputs in and replays. The rows are cloned out of the
graph: all graphs share one memory pool, so a graph's output may lie in another's scratch memory and
must not outlive the next replay of any graph. Only decode-sized calls are captured (T <= max_tokens:
one-token steps and verifications; a prefill is device-bound, and its every prompt length would be
a new graph holding its own output), at most `max_graphs` kinds; any other call, or one whose
capture fails, runs eagerly, as before.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .fused_moe import expert_rows, fused_moe


class CudaGraphs:
    """The capture and replay GraphedRows uses: torch.cuda.CUDAGraph on one shared memory pool,
    captured in thread-local mode (the link's threads keep issuing copies and waiting on events)."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()
        return graph, out

    @staticmethod
    def replay(graph) -> None:
        graph.replay()


@dataclass
class _Entry:
    inputs: tuple            # the static x, ids, weights (and remap) the graph reads
    weights: tuple           # (w13, w2): held, so their ids stay theirs while the graph exists
    graph: object = None
    out: torch.Tensor | None = None


@dataclass
class GraphedRows:
    """expert_rows (and fused_moe: the rows combined in the same graph) with one CUDA graph per kind
    of call (the module docstring)."""

    graphs: object = None          # CudaGraphs() on first use unless given
    max_graphs: int = 256          # kinds of call captured at most (each holds its output and inputs)
    max_tokens: int = 64           # larger calls (prefill) run eagerly: device-bound, and of every length
    stats: dict = field(default_factory=lambda: {"graphs": 0, "replays": 0, "eager": 0})

    def __post_init__(self):
        self._entries: dict[tuple, _Entry | None] = {}  # key -> entry; None: runs eagerly

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13, w2, *,
                 remap: torch.Tensor | None = None) -> torch.Tensor:
        """[T, k, H]: expert_rows(x, ids, weights, w13, w2, remap=remap)."""
        return self._call(expert_rows, x, ids, weights, w13, w2, remap)

    def fused_moe(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13, w2, *,
                  remap: torch.Tensor | None = None) -> torch.Tensor:
        """[T, H]: fused_moe(x, ids, weights, w13, w2, remap=remap), the combine inside the graph."""
        return self._call(fused_moe, x, ids, weights, w13, w2, remap)

    def _call(self, fn, x, ids, weights, w13, w2, remap) -> torch.Tensor:
        if 0 < x.shape[0] <= self.max_tokens:
            key = (fn, id(w13), id(w2), x.shape[0], ids.shape[1], x.dtype, ids.dtype, weights.dtype,
                   None if remap is None else (remap.shape[0], remap.dtype))
            entry = self._entries.get(key, False)
            if entry is False:
                return self._first(key, fn, x, ids, weights, w13, w2, remap)
            if entry is not None:
                for static, given in zip(entry.inputs, (x, ids, weights, remap)):
                    static.copy_(given)
                self.graphs.replay(entry.graph)
                self.stats["replays"] += 1
                return entry.out.clone()
        self.stats["eager"] += 1
        return fn(x, ids, weights, w13, w2, remap=remap)

    def _first(self, key, fn, x, ids, weights, w13, w2, remap) -> torch.Tensor:
        """A new kind of call: run it eagerly, then capture it for the calls to come (None: never)."""
        out = fn(x, ids, weights, w13, w2, remap=remap)
        self.stats["eager"] += 1
        self._entries[key] = None
        if self.stats["graphs"] >= self.max_graphs:
            return out
        with torch.inference_mode(False):  # normal tensors: written by calls in and out of inference mode
            inputs = tuple(t.clone() for t in (x, ids, weights) + (() if remap is None else (remap,)))
        entry = _Entry(inputs, (w13, w2))
        if self.graphs is None:
            self.graphs = CudaGraphs()
        sx, sids, sw = inputs[:3]
        sremap = inputs[3] if remap is not None else None
        try:
            entry.graph, entry.out = self.graphs.capture(lambda: fn(sx, sids, sw, w13, w2, remap=sremap))
        except Exception:  # noqa: BLE001 -- a call that cannot be captured still runs, eagerly
            return out
        self._entries[key] = entry
        self.stats["graphs"] += 1
        return out
