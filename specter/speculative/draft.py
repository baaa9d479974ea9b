"""The draft: its INT4 experts, the lookahead buffer its routers fill, and acceptance.

## Draft experts
The same model with only its routed experts in INT4 (group size 128, optimum-quanto's
quantizer, packed by `specter.triton_ops.pack_int4`). Everything else -- attention, norms, routers,
shared experts, embeddings, lm_head and the committed KV cache -- is the target's own, so the draft
costs only its packed experts.

How INT4 is multiplied is a backend choice: `unpacked` dequantises once into the compute dtype
(CPUs have no INT4 GEMV, and the values are exactly the INT4 grid; fp32 on CPU, twice the bf16
checkpoint's experts); `packed` keeps the packed codes (a quarter of bf16) and dequantizes at use:
on CUDA fused_moe's kernels do it tile by tile with scales in the compute dtype; on CPU the torch
backend dequantizes each expert it runs from fp32 scales and rounds once, which is exactly the
unpacked draft's values. Either way the draft computes with the quantised weights.

## Lookahead buffer
What the draft's routers chose, one row per drafted token.

A static device tensor (graph safe: fixed address, written in place). The draft writes rows on the
device; the planner reads a range of rows back with one device-to-host copy per chunk, never one
per token.

The sync-free draft (compiled/draft_step.py) instead `publish`es each row as it is written: a
non-blocking copy into a host mirror (pinned on CUDA) and an event, so the host learns a row
when its event has fired and never waits on the draft (`ready` / `read_host`).

## Acceptance
Which drafted tokens the target keeps.

Greedy: the longest prefix of drafted tokens equal to the target's argmax, plus the target's own
next token -- exactly the tokens of plain greedy decoding.
Sampling: standard speculative rejection sampling. Drafted token x_i (drawn from q_i) is accepted
with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the token is resampled from
normalise(max(p_i - q_i, 0)); if every token is accepted, one more is drawn from p_K. The output is
distributed exactly as the target's p (p and q already have penalties, temperature, top-k, top-p
and min-p applied alike, each row with its own history: the committed tokens plus drafted[:i]).
"""
from __future__ import annotations

import torch

from specter.triton_ops import Int4Experts, fused_moe, pack_int4

from ..moe import ExpertWeights
from ..sampling import probs

# On CPU the draft is dequantised (one GEMV an expert) while that costs at most this much memory,
# and stays packed above it: dequantised at use, a quarter of the bf16 experts instead of twice
# them, for draft steps 2% slower on the bundled model and 32% slower at Qwen3-30B-A3B's shapes
# (measured alternately in one process; the target's verification dominates either way).
DENSE_MAX_BYTES = 256 << 20


def keep_packed(device, n_weights: int, dtype: torch.dtype) -> bool:
    """Whether a draft of `n_weights` routed-expert weights stays packed INT4 on `device`: always
    on CUDA (the kernels dequantize tile by tile); on CPU once dequantising would take more than
    DENSE_MAX_BYTES."""
    return torch.device(device).type == "cuda" or n_weights * dtype.itemsize > DENSE_MAX_BYTES


def _dequantized(q: Int4Experts, dtype) -> torch.Tensor:
    """q.dequantize().to(dtype), one expert at a time: no layer-sized fp32 temporaries beside it."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)  # [E, N, K]
    for e in range(q.n_experts):
        out[e] = q[e].dequantize()[0]
    return out


class DraftExperts:
    """Expert provider of the draft. While `row` is set it records each MoE layer's routing into
    the lookahead buffer; that record is the whole point of drafting with the real routers."""

    def __init__(self, experts: list, lookahead: Lookahead, device, dtype, packed: bool = False):
        """experts: per MoE layer, the host full-precision ExpertWeights (quantised here, layer by layer
        on the device), or its (w13, w2) Int4Experts with fp32 scales (the draft cache's)."""
        self.lookahead, self.row, self.packed = lookahead, None, packed
        self.q13: list[Int4Experts] = []
        self.q2: list[Int4Experts] = []
        self.layers: list[ExpertWeights] = []
        for ew in experts:
            if isinstance(ew, ExpertWeights):
                ew = (pack_int4(ew.w13.to(device), dtype=torch.float32), pack_int4(ew.w2.to(device), dtype=torch.float32))
            q13, q2 = (q.to(device) for q in ew)
            if packed:  # CUDA: scales in the compute dtype (rounded once from fp32), the kernels multiply in it
                sdt = dtype if torch.device(device).type == "cuda" else torch.float32
                self.q13.append(q13.to(device, sdt))
                self.q2.append(q2.to(device, sdt))
            else:       # dequantised in fp32, exactly quanto's values, then rounded once
                self.layers.append(ExpertWeights(_dequantized(q13, dtype), _dequantized(q2, dtype)))

    def __call__(self, layer: int, x, ids, weights):
        if self.row is not None:  # drafting: the router's choice [1, k] goes into lookahead row `row`
            la = self.lookahead
            la.ids[self.row, layer].copy_(ids[0])
            la.weights[self.row, layer].copy_(weights[0])
        if self.packed:  # INT4 dequantized tile by tile inside the kernels' K loops
            return fused_moe(x, ids, weights, self.q13[layer], self.q2[layer])
        ew = self.layers[layer]
        return fused_moe(x, ids, weights, ew.w13, ew.w2)


# ------------------------------------------------------------------------------- lookahead buffer
class Lookahead:
    def __init__(self, k_max: int, n_layers: int, top_k: int, device):
        self.ids = torch.full((k_max, n_layers, top_k), -1, dtype=torch.int32, device=device)  # [K_max, L, k]
        self.weights = torch.zeros((k_max, n_layers, top_k), dtype=torch.float32, device=device)
        self.k_max, self.n_layers = k_max, n_layers
        cuda = self.ids.is_cuda
        self.host = torch.full_like(self.ids, -1, device="cpu", pin_memory=cuda)  # [K_max, L, k]
        self._events: list = [None] * k_max  # CUDA: one per published row
        self._published = 0

    def record(self, row: int, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        # ids, weights: [1, k] -- the router's choice for the token being drafted
        self.ids[row, layer].copy_(ids[0])
        self.weights[row, layer].copy_(weights[0])

    def read(self, start: int, end: int) -> list[list[list[int]]]:
        """Rows [start, end) on the host: [rows][layer][k]. One device-to-host transfer."""
        if end <= start:
            return []
        return self.ids[start:end].cpu().tolist()

    # ------------------------------------------------------------- sync-free publication
    def begin(self) -> None:
        self._published = 0

    def publish(self, row: int) -> None:
        """Start copying row `row` to the host mirror; never waits (CUDA: after the work queued so far)."""
        if self.ids.is_cuda:
            self.host[row].copy_(self.ids[row], non_blocking=True)
            ev = self._events[row] = self._events[row] or torch.cuda.Event()
            ev.record()
        else:
            self.host[row].copy_(self.ids[row])
        self._published = row + 1

    def ready(self) -> int:
        """How many published rows, from row 0, the host may read now (events queried, not waited on)."""
        n = 0
        while n < self._published and (self._events[n] is None or self._events[n].query()):
            n += 1
        return n

    def read_host(self, start: int, end: int) -> list[list[list[int]]]:
        """Published rows [start, end) from the host mirror (a host read, no device sync)."""
        if end <= start:
            return []
        return self.host.numpy()[start:end].tolist()


# ------------------------------------------------------------------------------------- acceptance
def accept_greedy(drafted: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """drafted [K], target_logits [K+1, V] -> (n accepted, the target's next token)."""
    best = target_logits.argmax(-1).tolist()  # one host read
    n = 0
    while n < len(drafted) and drafted[n] == best[n]:
        n += 1
    return n, best[n]


def accept_sampling(drafted: list[int], q: torch.Tensor, p: torch.Tensor, gen: torch.Generator | None
                    ) -> tuple[int, int]:
    """drafted [K], q [K, V] draft probs, p [K+1, V] target probs -> (n accepted, next token)."""
    K = len(drafted)
    if K:
        idx = torch.tensor(drafted, device=p.device)
        rows = torch.arange(K, device=p.device)
        ratio = (p[rows, idx] / q[rows, idx]).clamp(max=1.0)             # [K]
        u = torch.rand(K, generator=gen, device=p.device)
        rejected = (u >= ratio).tolist()
        for i in range(K):
            if rejected[i]:
                residual = (p[i] - q[i]).clamp(min=0)
                if residual.sum() <= 0:  # p == q where it matters: any p-sample is exact
                    residual = p[i]
                tok = torch.multinomial(residual / residual.sum(), 1, generator=gen)
                return i, int(tok)
    return K, int(torch.multinomial(p[K], 1, generator=gen))


def accept_on_device(tokens: torch.Tensor, target_logits: torch.Tensor, q: torch.Tensor | None, params,
                     gen: torch.Generator | None) -> tuple[int, int, list[int]]:
    """Both rules above computed on the device, then one host read.

    tokens [K+1] (pending token, then the K drafted), target_logits [K+1, V], q [K, V] (sampling)
    -> (n accepted, next token, the accepted drafted tokens). Sampling draws every row's
    replacement token at once (argmax(r / Exp(1)) is an exact draw from r normalised) and keeps
    the one at the first rejection, so the output has the same distribution as accept_sampling."""
    K = tokens.shape[0] - 1
    drafted = tokens[1:]                                                   # [K]
    if params.greedy:
        best = target_logits.argmax(-1)                                    # [K+1]
        m = (best[:K] == drafted).to(torch.int64).cumprod(0).sum()         # 0-d: accepted prefix
        nxt = best.gather(0, m.view(1))
    else:
        p = probs(target_logits, params)                                   # [K+1, V]
        rows = torch.arange(K, device=p.device)
        ratio = (p[rows, drafted] / q[rows, drafted]).clamp(max=1.0)       # [K]
        u = torch.rand(K, generator=gen, device=p.device)
        m = (u < ratio).to(torch.int64).cumprod(0).sum()
        residual = (p[:K] - q).clamp(min=0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:K])  # p == q: any p-sample
        choices = torch.cat((residual, p[K:]))                             # [K+1, V]
        noise = torch.empty_like(choices).exponential_(generator=gen)
        nxt = (choices / noise).argmax(-1).gather(0, m.view(1))
    host = torch.cat((drafted, m.view(1), nxt)).tolist()                   # the one read
    m = host[K]
    return m, host[K + 1], host[:m]
