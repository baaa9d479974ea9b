"""The compressed device tier (issue 24 item 3): part of the expert budget holds experts kept losslessly
coded on the device, and a miss whose expert is there is a decode into a slot (a device-to-device
step at the device's memory bandwidth) instead of a copy over PCIe.

    device budget = raw slots (the pool compute reads)  +  tier (coded experts, CodedTier)
    miss (layer, e), e in the tier     -> DecodeLink: decode into the slot, no PCIe bytes
    miss (layer, e), e not in the tier -> the link: its coded bytes over PCIe, decoded as they land;
                                          the coded bytes then stay in the tier (a fill)

The tier is inclusive (an expert may be both in a raw slot and in the tier: its coded bytes are what
landed) and is filled by every copy that crosses the link, on first use or by a prefetch alike, so
every policy runs on it unchanged. It evicts the coldest member first, with the slot cache's
cross-layer prediction (offload/slots.py): after layer `now` was read, a member of layer m whose
layer's last `age` calls did not use it is next used about (m - now - 1) mod L + L x age layer calls
from now; the farthest goes first.

Sizes are charged in the emulated device's bytes: a member costs its coded bytes times `width`, the
slot dtype's size over bf16's (2 for the CPU's fp32 pool, 1 on a GPU), the same scaling the emulated
link applies to the bytes it times, so the split between the tiers is the GPU's.

DecodeLink is the engine a tier hit runs on, separate from the PCIe link (a decode does not queue
behind copies): it charges a kernel launch plus the coded bytes read and the bf16 bytes written at
the profile's device memory bandwidth, scaled to this machine like the link (make_link's
decode_bandwidth), never this CPU's decode speed. On CPU the bytes a hit writes come either from the
coded store through the torch decode (`rows=None`), or from a decoded copy of the store made once
(`rows`, Loaded.host_rows: the same bits, tests/test_lossless.py), so that this CPU's decode, tens of
times slower than compute here, unlike a GPU's, does not stand in for the device's.

On CUDA the tier is not built yet (its coded bytes would have to stay in device memory after the
copy stream's decode): `plan(coded_tier=...)` is asked for on CPU only (builder).
"""
from __future__ import annotations

import torch

from .link import EmulatedLink, Transfer

# The coded size a plan assumes before the store is coded (builder): the fixed 3-bit exponent code's
# 11 bits of 16, escapes not counted; `specter plan --compress-experts` uses the measured one.
PLAN_RATIO = 11 / 16
DECODE_LAUNCH_S = 2e-6  # a decode kernel launched behind others on a side stream, before scaling (an assumption)


class DecodeLink(EmulatedLink):
    """A tier hit's decode into a slot, on its own worker thread: launch + (coded read + bf16 written)
    x width / bandwidth (bandwidth = the profile's device memory bandwidth, scaled like the link)."""

    def seconds(self, dst: list[torch.Tensor], src: list) -> float:
        moved = 0.0
        for d, s in zip(dst, src):
            width = d.numel() * d.element_size() / s.raw_nbytes
            moved += (s.nbytes + s.raw_nbytes) * width
        return self.latency + moved / self.bandwidth


def make_decode_link(link, *, decode_bandwidth: float | None = None, clock=None) -> DecodeLink:
    """The decode engine beside `link` (an EmulatedLink from make_link: its decode_bandwidth and time_scale)."""
    bw = decode_bandwidth if decode_bandwidth is not None else getattr(link, "decode_bandwidth", None)
    bw = bw or float("inf")  # a link that charges no decode (tests' fixed links): a hit costs its launch
    scale = getattr(link, "time_scale", 1.0)
    return DecodeLink(bw, DECODE_LAUNCH_S * scale, name="decode", clock=clock)


class _Decoded:
    """A tier hit's source on CPU with `rows`: the expert's coded size (what the decode is charged for)
    and its decoded bf16 rows (what is written)."""

    def __init__(self, coded, raw: torch.Tensor):
        self.nbytes, self.raw_nbytes, self.shape = coded.nbytes, coded.raw_nbytes, coded.shape
        self.raw = raw

    def decode_into(self, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(self.raw)


class CodedTier:
    """Which (layer, expert) are held coded on the device, within `capacity` bytes (see the module doc)."""

    def __init__(self, store, capacity: int, link: EmulatedLink, *, width: float = 1.0, rows=None):
        """`store`: the coded store (CodedLayer per MoE layer); `link`: the DecodeLink hits run on;
        `rows`: a decoded copy of the store (ExpertWeights per layer) a hit copies instead of decoding."""
        self.store, self.link, self.rows, self.capacity = store, link, rows, int(capacity)
        self.n_layers, self.n_experts = len(store), store[0].n_experts
        self.cost = [[round((layer.w13[e].nbytes + layer.w2[e].nbytes) * width) for e in range(self.n_experts)]
                     for layer in store]
        self.reset()

    def reset(self) -> None:
        L, E = self.n_layers, self.n_experts
        self._member = [[False] * E for _ in range(L)]
        self._stamp = [[0] * E for _ in range(L)]   # the layer's call count at the member's last use
        self._reads = [0] * L
        self._now = L - 1
        self.used = self.members = 0
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = dict(tier_hits=0, tier_fills=0, tier_evictions=0, tier_decoded_bytes=0)

    # ---- queries
    def has(self, layer: int, e: int) -> bool:
        return self._member[layer][e]

    @property
    def mean_cost(self) -> float:
        return sum(map(sum, self.cost)) / (self.n_layers * self.n_experts)

    # ---- the manager's calls
    def copy(self, layer: int, e: int, dst: list[torch.Tensor], *, urgent: bool = False) -> Transfer | None:
        """A member's decode into `dst` (the slot's w13, w2) on the decode link; None if not a member."""
        if not self._member[layer][e]:
            return None
        ew = self.store[layer]
        src = [ew.w13[e], ew.w2[e]]
        if self.rows is not None:
            raw = self.rows[layer]
            src = [_Decoded(src[0], raw.w13[e]), _Decoded(src[1], raw.w2[e])]
        t = self.link.copy(dst, src, urgent=urgent, tag=(layer, e))
        t.tier_hit = True
        self.stats["tier_hits"] += 1
        self.stats["tier_decoded_bytes"] += t.nbytes
        return t

    def landed(self, layer: int, e: int, t: Transfer | None) -> None:
        """(layer, e)'s copy landed: one that crossed the link leaves its coded bytes in the tier."""
        if t is not None and not getattr(t, "tier_hit", False):
            self.admit(layer, e)

    def admit(self, layer: int, e: int) -> bool:
        """Keep (layer, e) coded, evicting the coldest members until it fits. False if it cannot fit."""
        if self._member[layer][e]:
            return True
        cost = self.cost[layer][e]
        if cost > self.capacity:
            return False
        while self.used + cost > self.capacity:
            self._evict(*self.victim())
        self._member[layer][e] = True
        self._stamp[layer][e] = self._reads[layer]
        self.used += cost
        self.members += 1
        self.stats["tier_fills"] += 1
        return True

    def touch(self, layer: int, experts) -> None:
        """A call of `layer` used `experts` (the slot cache's touch, for the same prediction)."""
        self._reads[layer] = now = self._reads[layer] + 1
        self._now = layer
        member, stamp = self._member[layer], self._stamp[layer]
        for e in experts:
            if member[e]:
                stamp[e] = now

    def victim(self) -> tuple[int, int]:
        """The member predicted to be used farthest from now (ties: the lowest layer, then expert)."""
        L, now, best, far = self.n_layers, self._now, None, -1
        for m in range(L):
            d, reads, stamp = (m - now - 1) % L, self._reads[m], self._stamp[m]
            for e, held in enumerate(self._member[m]):
                if held and (f := d + L * (reads - stamp[e])) > far:
                    best, far = (m, e), f
        return best

    def _evict(self, layer: int, e: int) -> None:
        self._member[layer][e] = False
        self.used -= self.cost[layer][e]
        self.members -= 1
        self.stats["tier_evictions"] += 1

    def close(self) -> None:
        self.link.close()

    def check(self) -> None:
        """Invariants (tests)."""
        held = [(m, e) for m in range(self.n_layers) for e in range(self.n_experts) if self._member[m][e]]
        assert len(held) == self.members, (len(held), self.members)
        assert sum(self.cost[m][e] for m, e in held) == self.used <= self.capacity, (self.used, self.capacity)


ROWS_MAX_BYTES = 1 << 30  # the largest raw store kept decoded (CPU) for tier hits and coded copies to write from


def emulation_rows(loaded):
    """What tier hits and coded copies write from on CPU (`rows`; coded.emulate_from): the decoded store a
    host lane already keeps, or one made for them when the raw store is at most ROWS_MAX_BYTES; None
    past that (each then decodes the coded store: slower here, the same bits, no second copy of a big
    model's experts in host memory)."""
    if loaded.raw is None and sum(layer.w13.raw_nbytes + layer.w2.raw_nbytes for layer in loaded.store) > ROWS_MAX_BYTES:
        return None
    return loaded.host_rows()


def attach(mgr, capacity: int, link, *, rows=None, width: float | None = None, decode_link=None) -> CodedTier:
    """Give the offload manager `mgr` (its store coded) a tier of `capacity` device bytes."""
    from .coded import is_coded

    if not is_coded(mgr.store):
        raise ValueError("the coded device tier needs a coded store (compress_experts)")
    if width is None:  # the slot dtype's bytes over bf16's
        width = mgr.pool[0].w13.element_size() / 2
    tier = CodedTier(mgr.store, capacity, decode_link or make_decode_link(link), width=width, rows=rows)
    mgr.tier = tier
    return tier
