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
decode_bandwidth), never this CPU's decode speed. On CPU a hit writes what a coded copy does (the
store's CodedExperts): raw rows where coded.emulate_from gave the store some (emulation_rows: a decoded
copy of the store made once, Loaded.host_rows, or past ROWS_MAX_BYTES each expert read from the
checkpoint; the same bits, tests/test_lossless.py), so that this CPU's decode, tens of times slower
than compute here, unlike a GPU's, does not stand in for the device's; else the torch decode.

On CUDA the tier keeps real bytes in device memory: a coded copy stages an expert's bytes on the device
before decoding them (lossless.stage_pair, one buffer for both tensors), and the tier keeps that buffer
when the copy lands (the fill costs no second copy). A hit decodes the kept buffer into the slot on the
decode link, a CudaLink of its own (its streams: a hit never queues behind PCIe copies), after two
events: the slot's last reader (as any copy into it) and the fill's copy (its bytes may still be in
flight when the manager marks it landed). Each hit records its stream on the buffer, so an eviction
(dropping the buffer) hands the memory back to the allocator only once the hits queued on it are done.
A member costs its staged bytes rounded up to the allocator's 512. A copy that did not stage (the
in-place experiment, SPECTER_CODED_IN_PLACE=1, or slots that are not bf16) does not fill the tier.
"""
from __future__ import annotations

import os

import torch

from specter.triton_ops import lossless

from ..loader import StoredExperts
from ..policy import get as get_policy
from .cuda_link import CudaLink
from .link import EmulatedLink, Transfer

# The coded size a plan assumes before the store is coded (builder): the fixed 3-bit exponent code's
# 11 bits of 16, escapes not counted; `specter plan --compress-experts` uses the measured one.
PLAN_RATIO = 11 / 16
DECODE_LAUNCH_S = 2e-6  # a decode kernel launched behind others on a side stream, before scaling (an assumption)
ALLOC_ROUND = 512  # CUDA: the caching allocator's granularity, what a kept buffer really takes


def tier_wanted(policy, device, dtype: torch.dtype, opt: str | None = None) -> bool:
    """Whether a compressed store's budget is split with a tier (make_plan's coded_tier, where tier_split
    finds it holds more experts). `opt` (default $SPECTER_CODED_TIER): "0" turns it off; on CUDA it is
    opt-in, "1", until a GPU run measures it (a hit costs the issuing thread a kernel launch, which a
    small expert's copy may not repay: docs/RESULTS.md). Never for a policy that copies nothing after
    warm-up (host: every miss computed on the host lane, a tier would stay empty), nor for one whose
    prefetches need raw slots to land in (next-layer, oracle: tier_split leaves a layer's top-k, so
    next-layer issued no prefetch and the oracle ran 0.75x its raw TPOT; only the drafting planner's
    prefetches land in the tier, manager.fill), nor on CUDA with slots
    that are not bf16 (those copies decode a tensor at a time and stage nothing the tier could keep) or
    in-place copies (SPECTER_CODED_IN_PLACE=1: nothing staged either)."""
    opt = os.environ.get("SPECTER_CODED_TIER") if opt is None else opt
    if opt == "0" or policy.host_lane == "misses" or policy.prefetch in ("next-layer", "oracle"):
        return False
    if torch.device(device).type == "cpu":
        return True
    return opt == "1" and dtype == torch.bfloat16 and os.environ.get("SPECTER_CODED_IN_PLACE") != "1"


def plan_tier(policy, device, dtype: torch.dtype, compressed: bool, ratio: float | None = None) -> float | None:
    """make_plan's coded_tier as the engine passes it: `ratio` (a coded expert's bytes over a bf16 one's: the
    store's measured ratio; None: PLAN_RATIO, before the store is coded) where a compressed store splits its
    budget with a tier (tier_wanted), else None. `policy`: a Policy or its name."""
    if not compressed:
        return None
    pol = get_policy(policy) if isinstance(policy, str) else policy
    return (PLAN_RATIO if ratio is None else ratio) if tier_wanted(pol, device, dtype) else None


class DecodeLink(EmulatedLink):
    """A tier hit's decode into a slot, on its own worker thread: launch + (coded read + bf16 written)
    x width / bandwidth (bandwidth = the profile's device memory bandwidth, scaled like the link)."""

    def seconds(self, dst: list[torch.Tensor], src: list) -> float:
        moved = 0.0
        for d, s in zip(dst, src):
            width = d.numel() * d.element_size() / s.raw_nbytes
            moved += (s.nbytes + s.raw_nbytes) * width
        return self.latency + moved / self.bandwidth


def make_decode_link(link, *, decode_bandwidth: float | None = None, clock=None) -> DecodeLink | CudaLink:
    """The decode engine beside `link`: for a CudaLink another on the same device (its own streams; its
    bandwidth the GPU's profile's memory bandwidth, which only sizes its metering window); for an
    EmulatedLink from make_link a DecodeLink (its decode_bandwidth and time_scale)."""
    if isinstance(link, CudaLink):
        from .calibrate import load_profile, profile_for_gpu

        gpu = profile_for_gpu(link._cuda.device_name(link.device))
        bw = decode_bandwidth or load_profile(gpu).device_memory_bandwidth
        return CudaLink(link.device, bandwidth=bw, latency=DECODE_LAUNCH_S, name="decode", cuda=link._cuda)
    bw = decode_bandwidth if decode_bandwidth is not None else getattr(link, "decode_bandwidth", None)
    bw = bw or float("inf")  # a link that charges no decode (tests' fixed links): a hit costs its launch
    scale = getattr(link, "time_scale", 1.0)
    return DecodeLink(bw, DECODE_LAUNCH_S * scale, name="decode", clock=clock)


class HeldExpert:
    """A tier hit's source on CUDA: one of expert e's two tensors, whose staged bytes (stage_pair's, both
    tensors in one buffer) the tier keeps on the device; `first`: w13, else w2."""

    dtype = torch.bfloat16

    def __init__(self, pair: lossless.CodedPair, e: int, buf: torch.Tensor, first: bool):
        self.pair, self.e, self.buf = pair, e, buf
        packed = pair.a if first else pair.b
        self.shape = torch.Size(packed.shape[1:])
        self.nbytes, self.raw_nbytes = packed.expert_nbytes(e), self.shape.numel() * 2  # read, written

    @staticmethod
    def decode_all_on(dsts: list[torch.Tensor], srcs: list["HeldExpert"]) -> None:
        """On the current (decode) stream: each expert's kept bytes into its two slots (w13, w2 side by
        side), the experts of a layer in one launch (lossless.decode_staged_pairs); slots that are not
        contiguous bf16 through temporaries, converted exactly."""
        jobs, converts, pair = [], [], srcs[0].pair
        for i in range(0, len(srcs), 2):
            s = srcs[i]
            if s.pair is not pair:  # a layer's hits share its pair (the manager's); any other, a batch each
                HeldExpert.decode_all_on(dsts[i:], srcs[i:])
                break
            if s.buf.is_cuda:  # freed on eviction only once this decode has read it
                s.buf.record_stream(torch.cuda.current_stream(s.buf.device))
            outs = [d if d.dtype == torch.bfloat16 and d.is_contiguous() else
                    torch.empty(d.shape, dtype=torch.bfloat16, device=d.device) for d in dsts[i:i + 2]]
            jobs.append((s.e, s.buf, *outs))
            converts += [(d, o) for d, o in zip(dsts[i:i + 2], outs) if o is not d]
        lossless.decode_staged_pairs(pair, jobs)
        for d, o in converts:
            d.copy_(o)


class Fill:
    """One of expert e's two coded tensors copied for the tier alone (a prefetch with no slot to land in):
    its coded bytes cross the link and nothing is decoded until a need (a tier hit). Emulated: its
    destination is on meta (the copy is timed only) and the link charges no decode (`decodes`). CUDA:
    decode_all_on stages the pair's bytes on the device (lossless.stage_pair) and keeps them (`staged`,
    what landed() hands the tier), launching nothing."""

    dtype = torch.bfloat16
    decodes = False
    staged = None

    def __init__(self, src, device):
        self.src, self.device = src, device
        self.nbytes, self.raw_nbytes, self.shape = src.nbytes, src.raw_nbytes, src.shape

    @staticmethod
    def decode_all_on(dsts: list[torch.Tensor], srcs: list["Fill"]) -> None:
        for s in srcs[::2]:  # an expert's w13, then its w2: one staging copy of both
            s.staged = lossless.stage_pair(s.src.pair, s.src.e, s.device)


class CodedTier:
    """Which (layer, expert) are held coded on the device, within `capacity` bytes (see the module doc)."""

    def __init__(self, store, capacity: int, link: EmulatedLink | CudaLink, *, width: float = 1.0):
        """`store`: the coded store (CodedLayer per MoE layer); `link`: the link hits run on, a DecodeLink
        (emulated: a hit's sources are the store's CodedExperts, written from raw rows where emulate_from
        gave the store some) or a CudaLink (real bytes kept on the device: each layer laid out for CUDA, a
        CodedPair)."""
        self.store, self.link, self.capacity = store, link, int(capacity)
        self.n_layers, self.n_experts = len(store), store[0].n_experts
        self.on_device = isinstance(link, CudaLink)
        if self.on_device:
            if any(layer.w13.pair is None for layer in store):
                raise ValueError("a CUDA coded tier needs the store laid out for CUDA (coded_store with cuda=True)")
            self.cost = [[-(-layer.w13.pair.staged_nbytes(e) // ALLOC_ROUND) * ALLOC_ROUND
                          for e in range(self.n_experts)] for layer in store]
        else:
            self.cost = [[round((layer.w13[e].nbytes + layer.w2[e].nbytes) * width) for e in range(self.n_experts)]
                         for layer in store]
        self.reset()

    def reset(self) -> None:
        L, E = self.n_layers, self.n_experts
        self._held: dict = {}     # CUDA: (layer, e) -> (its staged bytes on the device, the fill's event)
        self._landing: dict = {}  # CUDA: (layer, e) -> the w13 source of its copy in flight (sources())
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
    def copy(self, layer: int, experts: list[int], dsts: list[torch.Tensor], *, urgent: bool = False,
             after: list | None = None) -> Transfer:
        """Members `experts` of `layer` decoded into `dsts` (each one's slot w13, w2, in order) on the decode
        link, in one transfer (on CUDA one launch). `after` (CUDA): each slot's last reader, as for a copy
        into it."""
        ew, src, waits = self.store[layer], [], list(after or ())
        for e in experts:
            if not self._member[layer][e]:
                raise KeyError(f"({layer}, {e}) is not held in the coded tier")
            if self.on_device:
                buf, filled = self._held[(layer, e)]
                src += (HeldExpert(ew.w13.pair, e, buf, True), HeldExpert(ew.w13.pair, e, buf, False))
                waits.append(filled)  # the kept bytes landed
            else:
                src += (ew.w13[e], ew.w2[e])
        t = self.link.copy(dsts, src, urgent=urgent, tag=(layer, experts[0] if len(experts) == 1 else tuple(experts)),
                           after=[ev for ev in waits if ev is not None])  # CPU: none, nothing to order
        t.tier_hit = True
        self.stats["tier_hits"] += len(experts)
        self.stats["tier_decoded_bytes"] += t.nbytes
        return t

    def sources(self, layer: int, e: int) -> list:
        """The coded sources of (layer, e)'s copy over the link (the manager's); on CUDA noted, so that
        landed() finds the bytes the copy staged on the device."""
        ew = self.store[layer]
        src = [ew.w13[e], ew.w2[e]]
        if self.on_device:
            self._landing[(layer, e)] = src[0]
        return src

    def fill_sources(self, layer: int, e: int) -> list[Fill]:
        """The sources of a copy of (layer, e) for the tier alone (the manager's prefetch with no slot);
        noted, as sources() notes a copy's, so that landed() finds what it staged (CUDA)."""
        ew, device = self.store[layer], getattr(self.link, "device", None)  # CUDA: where it stages
        src = [Fill(ew.w13[e], device), Fill(ew.w2[e], device)]
        if self.on_device:
            self._landing[(layer, e)] = src[0]
        return src

    def forget(self, layer: int, e: int) -> None:
        """(layer, e)'s copy was withdrawn before it ran: nothing of it will land."""
        self._landing.pop((layer, e), None)

    def landed(self, layer: int, e: int, t: Transfer | None) -> None:
        """(layer, e)'s copy landed: one that crossed the link leaves its coded bytes in the tier (on
        CUDA the buffer it staged them in, if it staged: see the module doc)."""
        if t is None or getattr(t, "tier_hit", False):
            return
        if not self.on_device:
            self.admit(layer, e)
            return
        src = self._landing.pop((layer, e), None)
        buf = None if src is None else src.staged
        if buf is not None and self.admit(layer, e):
            self._held[(layer, e)] = (buf, t._event)

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
        self._held.pop((layer, e), None)  # CUDA: the memory goes back once the hits queued on it are done
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
        if self.on_device:
            assert sorted(self._held) == held, (sorted(self._held), held)
            assert all(buf.numel() == self.store[m].w13.pair.staged_nbytes(e)
                       for (m, e), (buf, _) in self._held.items())


ROWS_MAX_BYTES = 1 << 30  # the largest raw store kept decoded (CPU) for tier hits and coded copies to write from


def emulation_rows(loaded):
    """What tier hits and coded copies write from on CPU (`rows`; coded.emulate_from): the decoded store a
    host lane already keeps, or one made for them when the raw store is at most ROWS_MAX_BYTES; past
    that, each expert read from the checkpoint when its copy runs (loader.ExpertReads: no second copy of
    a big model's experts in host memory, and ~10x faster here than decoding); None (decode the coded
    store) where the checkpoint's experts cannot be read as they are."""
    if loaded.raw is None and sum(layer.w13.raw_nbytes + layer.w2.raw_nbytes for layer in loaded.store) > ROWS_MAX_BYTES:
        return StoredExperts(loaded.ckpt).expert_reads()
    return loaded.host_rows()


def attach(mgr, capacity: int, link, *, width: float | None = None, decode_link=None) -> CodedTier:
    """Give the offload manager `mgr` (its store coded) a tier of `capacity` device bytes."""
    from .coded import is_coded

    if not is_coded(mgr.store):
        raise ValueError("the coded device tier needs a coded store (compress_experts)")
    if width is None:  # the slot dtype's bytes over bf16's (emulated; on CUDA a member costs its real bytes)
        width = mgr.pool[0].w13.element_size() / 2
    tier = CodedTier(mgr.store, capacity, decode_link or make_decode_link(link), width=width)
    mgr.tier = tier  # on CUDA its hits' batch kernel was compiled with the store (coded.ready_on_cuda)
    return tier
