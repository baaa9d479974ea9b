"""Memory plan: what the device holds, and how many expert slots a budget buys.

    device = non-expert weights (always resident) + draft experts (INT4) + KV cache + slot pool
    slot pool = pool_slots x bytes_per_expert, one pool every MoE layer shares (offload/slots.py)

A budget is a residency fraction, a slot-pool byte budget, or a whole-device byte budget. The floor
is one layer's working set, top-k slots: a layer runs its experts in as many calls as the pool
needs, so a verification of K + 1 tokens fits too. `pool="layer"` is the per-layer rule instead
(every layer top-k slots or more, the same count in each: n_moe_layers x top-k at least).

The plan also makes the dtype decisions, once, for whoever builds from it: the compute dtype
(compute_dtype), the slot pool's dtype (pool_dtype) and whether the pool has bytes of its own or
reads rows in place (alias_pool, MemoryPlan.pool_rows).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass

import torch

from ..config import ModelSpec
from ..errors import BudgetError, ConfigError
from ..policy import DEFAULT_K_MAX, get as get_policy
from ..sizes import format_size, parse_size
from .staging import aligned, describe as describe_staging
from .store import pin_wanted, store_bytes

INT4_GROUP = 128
DRAFT_BITS = (4, 3, 2)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def compute_dtype(device: torch.device, storage: torch.dtype, dtype=None) -> torch.dtype:
    """fp32 on CPU (exact, and what CPUs are fast at); the checkpoint's 16-bit dtype on CUDA."""
    if dtype is not None:
        if isinstance(dtype, str):
            if dtype not in _DTYPES:
                raise ConfigError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
            return _DTYPES[dtype]
        if dtype not in _DTYPES.values():  # float64, int8 ...: no kernel, reference or test computes in them
            raise ConfigError(f"dtype must be one of {', '.join(_DTYPES)} (or that torch.dtype), got {dtype!r}")
        return dtype
    if device.type == "cpu":
        return torch.float32
    return storage if storage in (torch.float16, torch.bfloat16) else torch.bfloat16


# On CPU a slot pool that would take more than this in the compute dtype holds the store's narrower
# dtype instead. Below it the pool stays in the compute dtype: converting an expert as it runs costs
# little at real shapes, into a reused buffer, but its per-call overhead slows a small model's decode
# (and the emulated link calibrated on it) several times over (docs/RESULTS.md).
POOL_UPCAST_MIN_BYTES = 256 << 20


def _is_cpu(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def pool_dtype(device, storage: torch.dtype, compute: torch.dtype, slots: int = 0,
               expert_numel: int = 0) -> torch.dtype:
    """The slot pool's dtype. CUDA: the compute dtype (the kernels read it; copies convert on the
    device). CPU: the store's dtype when it is narrower and a compute-dtype pool of `slots` experts
    would pass POOL_UPCAST_MIN_BYTES; the torch backend converts each expert it runs into the compute
    dtype, which gives the very values a converting copy would have put in the pool (bf16 -> fp32
    is exact), and the emulated device's memory is the host's."""
    if not _is_cpu(device) or storage.itemsize >= compute.itemsize:
        return compute
    return storage if slots * expert_numel * compute.itemsize > POOL_UPCAST_MIN_BYTES else compute


def alias_pool(device, compute: torch.dtype, slots: int, expert_numel: int, every_expert: bool = False) -> bool:
    """Whether the slot pool aliases the host store (OffloadedExperts(alias=True)): on CPU, past the
    same POOL_UPCAST_MIN_BYTES, the emulated device is host memory and a pool would be a second copy
    of experts the store already holds, so compute reads the store's rows and copies are only timed.
    Small models keep a real pool, so the slot and copy races stay exercised by real bytes -- except
    when the budget holds `every_expert`: nothing is ever copied after warm-up then, and compute
    reads the very tensors the resident policy reads (Loaded.resident_experts), not a pool copy of
    them whose speed depends on where its pages fell."""
    return _is_cpu(device) and (every_expert or slots * expert_numel * compute.itemsize > POOL_UPCAST_MIN_BYTES)


def draft_widths(spec: ModelSpec) -> tuple[int, ...]:
    """The draft widths of DRAFT_BITS this model's experts pack at (the load refuses the others)."""
    from specter.triton_ops.int4 import packable_widths

    return tuple(b for b in DRAFT_BITS if b in packable_widths(spec.hidden, spec.expert_inter))


def draft_expert_bytes(spec: ModelSpec, bits: int = 4, scale_bytes: int = 2) -> int:
    """One routed draft expert at `bits` (4, 3 or 2), group size 128: b/8 bytes a weight + a scale and shift
    per group of `scale_bytes` each (2: the CUDA draft's bf16; 4: the cache on disk's fp32), as
    speculative.draft_cache.draft_expert_nbytes (the draft's own packing) counts them."""
    from ..speculative.draft_cache import draft_expert_nbytes

    return draft_expert_nbytes(spec, bits, scale_bytes=scale_bytes)


@dataclass
class MemoryPlan:
    dtype: str
    non_expert_bytes: int
    expert_bytes: int            # one routed expert in the compute dtype
    draft_bytes: int             # every routed expert of the draft, at draft_bits
    kv_bytes: int                # the context's rows, and kv_scratch more
    context: int
    n_moe_layers: int
    n_experts: int
    top_k: int
    slots_per_layer: int         # the most one layer may hold (its quota; the per-layer rule: all it has)
    slot_pool_bytes: int
    total_bytes: int
    pool_dtype: str              # the slot pool's (pool_dtype): the compute dtype, or a CPU pool in the store's
    pool_rows: str               # what compute reads: "own" (the pool's copies) | "store" (the store's rows in
    #                              place, alias_pool) | "resident" (every expert, in place in the resident copy)
    pool_slots: int = 0          # slots in the pool all layers share
    pool: str = "shared"         # "shared" | "open" (no per-layer share) | "layer" (the per-layer rule)
    tier_bytes: int = 0          # the compressed device tier (offload/coded_tier.py): experts kept coded
    tier_experts: int = 0        # ... about this many, at coded_ratio of a slot each
    coded_ratio: float = 0.0     # a coded expert's bytes over a slot's (0: no tier)
    draft_bits: int = 4          # the draft's experts' width (every one on the device)
    kv_scratch: int = 0          # KV rows past the context a compiled verifier writes (verify_scratch)

    @property
    def aliased(self) -> bool:
        """The pool holds no copies of its own (OffloadedExperts(alias=True))."""
        return self.pool_rows != "own"

    @property
    def residency(self) -> float:
        return self.pool_slots / max(1, self.n_moe_layers * self.n_experts)

    def as_dict(self) -> dict:  # (draft_bits: None without a draft, as the fit's and the ranks' JSON say it)
        return {**asdict(self), "residency": self.residency,
                "draft_bits": self.draft_bits if self.draft_bytes else None}

    def table(self) -> str:
        rows = [
            ("non-expert weights (always on device)", self.non_expert_bytes),
            (f"draft experts (INT{self.draft_bits}, g{INT4_GROUP})" if self.draft_bytes else "draft experts (none)",
             self.draft_bytes),
            (f"KV cache ({self.context} tokens" + (f" + {self.kv_scratch} scratch" if self.kv_scratch else "") + ")",
             self.kv_bytes),
            (self._pool_row(), self.slot_pool_bytes),
            ("total on device", self.total_bytes),
        ]
        w = max(len(r[0]) for r in rows)
        if self.tier_bytes:
            rows.insert(3, (f"coded tier (~{self.tier_experts} experts x {self.coded_ratio:.2f} of a slot)",
                            self.tier_bytes))
            w = max(len(r[0]) for r in rows)
        lines = [f"{name:<{w}}  {format_size(b):>11}" for name, b in rows]
        if self.pool == "layer":
            lines.append(f"{'slots per layer':<{w}}  {self.slots_per_layer:>5} of {self.n_experts} "
                         f"({self.residency:.1%} of routed experts resident, top-{self.top_k})")
        else:
            lines.append(f"{'slots (all layers)':<{w}}  {self.pool_slots:>5} of {self.n_moe_layers * self.n_experts} "
                         f"({self.residency:.1%} of routed experts resident; a layer runs top-{self.top_k})")
        if self.tier_bytes:
            n = self.n_moe_layers * self.n_experts
            lines.append(f"{'coded tier (all layers)':<{w}}  {self.tier_experts:>5} of {n} ({self.tier_experts / n:.1%} held "
                         f"coded on the device, the slots' experts among them; a miss there is decoded into a slot)")
        return "\n".join(lines)

    def _pool_row(self) -> str:
        size = format_size(self.expert_bytes) + (f" {self.pool_dtype}" if self.pool_dtype != self.dtype else "")
        if self.pool == "layer":
            return f"slot pool ({self.n_moe_layers} layers x {self.slots_per_layer} slots x {size})"
        return f"slot pool (shared: {self.pool_slots} slots x {size})"


def kv_bytes_per_token(spec: ModelSpec, itemsize: int) -> int:
    if spec.attention == "mla":  # the latent cache: normalised KV latent + rotary key
        per_layer = spec.kv_lora_rank + spec.qk_rope_dim
    else:
        per_layer = 2 * spec.n_kv_heads * spec.head_dim
    return spec.n_layers * per_layer * itemsize


def non_expert_numel(spec: ModelSpec, total_numel: int) -> int:
    return total_numel - spec.n_moe_layers * spec.n_experts * spec.expert_numel()


POOLS = ("shared", "open", "layer")


def make_plan(spec: ModelSpec, total_numel: int, dtype: torch.dtype, *, residency: float | None = None,
              expert_memory=None, device_memory=None, context: int | None = None, draft: bool = True,
              device=None, store_dtype: torch.dtype | None = None, compressed: bool = False,
              pool: str = "shared", coded_tier: float | None = None, draft_bits: int = 4,
              kv_scratch: int = 0, verifies: bool | None = None) -> MemoryPlan:
    """`total_numel`: parameters in the checkpoint. At most one of the three budgets; none = all resident.
    `device`, `store_dtype`, `compressed` (the store losslessly coded): what the pool decisions depend
    on. On CPU a big pool holds the store's narrower dtype (pool_dtype: a byte budget then buys more
    slots) and aliases the store (alias_pool); elsewhere, or with `device` None, the pool holds its
    own copies in the compute dtype. `pool`: "shared" (one pool, floor top-k slots; a layer holds at
    most its share, ceil(slots / layers), or top-k if more), "open" (the same pool, no share: a layer
    holds what eviction lets it) or "layer" (the per-layer rule: the same slots in every layer, floor
    top-k in each). `coded_tier`: a coded expert's bytes over a bf16 one's (the store's measured ratio,
    or an estimate): the budget is split between raw slots and a compressed device tier (tier_split),
    shared pool only. `draft_bits`: the width of the draft's experts (4, 3 or 2). `kv_scratch`: KV rows
    past the context the verifier writes (verify_scratch). `verifies`: the policy verifies drafts, whose
    working set sizes a tier's raw slots (default: `draft`; a pipeline rank's plan holds no draft but
    verifies)."""
    if pool not in POOLS:
        raise ConfigError(f"slot_pool must be one of {POOLS}, got {pool!r}")
    if draft_bits not in DRAFT_BITS:
        raise ConfigError(f"draft_bits must be one of {DRAFT_BITS}, got {draft_bits!r}")
    check_budget(residency, expert_memory, device_memory)
    item = torch.empty((), dtype=dtype).element_size()
    E, k, L, numel = spec.n_experts, spec.top_k, spec.n_moe_layers, spec.expert_numel()
    context = min(context or spec.max_position, spec.max_position)
    fixed = dict(non=non_expert_numel(spec, total_numel) * item,
                 draft=L * E * draft_expert_bytes(spec, draft_bits) if draft else 0,
                 kv=kv_bytes_per_token(spec, item) * (context + kv_scratch))
    per = max(L, 1) if pool == "layer" else 1  # a slot is counted in every layer (the per-layer rule) or once
    most = E * (L // per)                       # slots in a layer (the rule), or in the pool, for every expert
    store = store_dtype if store_dtype is not None else dtype
    least = pool_dtype(device, store, dtype, k * per, numel).itemsize  # a pool of top-k slots: in its own dtype
    floor = (k * per * numel * least, f"one layer's top-{k} expert slots") if L else (0, "")
    slots, what = _slots(most, per * numel * item, fixed, residency, expert_memory, device_memory, context, floor)
    pdt = pool_dtype(device, store, dtype, per * slots, numel)
    if pdt != dtype:  # the same budget in bytes holds more experts of the narrower dtype
        slots, what = _slots(most, per * numel * pdt.itemsize, fixed, residency, expert_memory, device_memory,
                             context, floor)
    expert = numel * pdt.itemsize
    if L and slots < k:
        need = k * per * expert
        where = "expert slot(s) per layer" if pool == "layer" else "expert slot(s) in the shared pool"
        total = f": device_memory (--device-memory) {_exactly(need + sum(fixed.values()))} in all" \
            if device_memory is not None else ""
        raise BudgetError(
            f"{what} gives {slots} {where}, but one layer needs its top-{k} = {k} experts at once: at least "
            f"{_exactly(need)} of slot pool ({_up(k * per / (L * E))} residency) is required{total}")
    tier_bytes = tier_n = 0
    ratio = 0.0
    if coded_tier and pool == "shared":
        raw = tier_split(slots, k, E, L, coded_tier, verify=VERIFY_TOKENS if (draft if verifies is None else verifies)
                         else 1)
        if raw < slots:
            # a member is charged its coded bytes x the slot dtype's width over bf16 (coded_tier.py), so
            # the split is the GPU's at any pool dtype: `ratio` of a slot each
            tier_bytes, ratio = (slots - raw) * numel * pdt.itemsize, coded_tier
            tier_n, slots = min(L * E, int((slots - raw) / ratio)), raw
    n_pool = per * slots
    every = n_pool >= L * E
    # compute cannot read coded rows: a compressed store's pool copies (and decodes) into its own slots
    rows = "own" if compressed or not alias_pool(device, dtype, n_pool, numel, every_expert=every) else \
        "resident" if every and pdt != store else "store"
    return MemoryPlan(dtype=_name(dtype), non_expert_bytes=fixed["non"], expert_bytes=expert,
                      draft_bytes=fixed["draft"], kv_bytes=fixed["kv"], context=context, n_moe_layers=L,
                      n_experts=E, top_k=k, slots_per_layer=_quota(pool, slots, L, E, k),
                      slot_pool_bytes=n_pool * expert, total_bytes=n_pool * expert + tier_bytes + sum(fixed.values()),
                      pool_dtype=_name(pdt), pool_rows=rows, pool_slots=n_pool, pool=pool,
                      tier_bytes=tier_bytes, tier_experts=tier_n, coded_ratio=round(ratio, 4) if tier_bytes else 0.0,
                      draft_bits=draft_bits, kv_scratch=kv_scratch)


def verify_scratch(policy, device, compile: bool | None = None, k_max: int = DEFAULT_K_MAX) -> int:
    """KV rows past the context that a speculative policy's compiled verifier may write: it pads a
    verification to a width bucket, at most K_max + 1 rows from the last position (compiled/verify_step.py,
    `headroom`), scratch the cache must hold. 0 where the verifier runs eagerly (compile False, or None
    off CUDA) or the policy does not speculate. `policy`: a Policy or its name."""
    pol = get_policy(policy) if isinstance(policy, str) else policy
    compiled = compile if compile is not None else torch.device(device).type == "cuda"
    return k_max if pol.decoder == "speculative" and compiled else 0


# Tokens of a verification whose working set a drafting policy's raw slots hold (K = 4 drafted + 1).
VERIFY_TOKENS = 5


def tier_split(slots: int, k: int, E: int, L: int, ratio: float, verify: int = 1) -> int:
    """The raw slots of a budget of `slots` when the rest may hold coded experts at `ratio` of a slot.

    The tier is inclusive (a raw slot's expert stays coded in the tier, offload/coded_tier.py), so the
    device holds about max(raw, tier) distinct experts: each raw slot beyond what a layer reads at
    once costs 1 / ratio coded experts, i.e. PCIe copies, and buys only hits that would otherwise be
    decodes, each a launch plus (1 + ratio) x an expert's bytes at device memory bandwidth, tens of
    times cheaper than the copy on every profile. So the raw slots are one layer's working set: top-k
    for plain decoding, min(E, top-k x `verify`) for a drafting policy's verification of `verify`
    tokens (run through fewer slots, it waits for a decode per batch: specter measured slower so,
    docs/RESULTS.md), and the rest is the tier. No tier (all raw) when it would hold no more experts
    than the raw slots it replaces (whole experts: 9 slots at 0.6875 hold 13, not 13.09), or when every
    expert fits raw."""
    raw = min(E, k * verify)
    if slots >= L * E or slots <= raw or int((slots - raw) / ratio) <= slots:
        return slots
    return raw


def _quota(pool: str, slots: int, L: int, E: int, k: int) -> int:
    """The most experts one layer may hold: the per-layer rule's slots; in the shared pool its share of
    the pool (at least one layer's top-k); in the open pool all it can get."""
    if pool == "layer":
        return slots
    if pool == "open" or not L:
        return min(E, slots)
    return min(E, slots, max(k, -(-slots // L)))


def _exactly(nbytes: int) -> str:
    """format_size and, past a KiB, the exact bytes (a budget one byte short rounds to the same figure)."""
    return format_size(nbytes) + (f" ({nbytes:,} bytes)" if nbytes >= 1024 else "")


def _up(x: float, digits: int = 3) -> str:
    """x > 0 rounded up to `digits` significant digits: a figure that, given back, is enough."""
    q = 10.0 ** (math.floor(math.log10(x)) - digits + 1)
    return f"{math.ceil(x / q - 1e-9) * q:.{digits}g}"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_budget(residency=None, expert_memory=None, device_memory=None) -> None:
    """At most one budget, and that one well formed: checked from the arguments alone, before a load."""
    given = [b for b in (residency, expert_memory, device_memory) if b is not None]
    if len(given) > 1:
        raise ConfigError("give one budget: residency (--residency), expert_memory (--expert-memory) or "
                          "device_memory (--device-memory)")
    if residency is not None and (isinstance(residency, bool) or not (isinstance(residency, numbers.Real)
                                                                      and 0 < residency <= 1)):  # (numpy's too)
        raise ConfigError(f"residency must be a fraction in (0, 1], got {residency!r}")
    for value, name in ((expert_memory, "expert_memory"), (device_memory, "device_memory")):
        if value is not None:
            parse_budget(value, name)


def _slots(E: int, layer_bytes: int, fixed: dict, residency, expert_memory, device_memory,
           context: int, floor: tuple[int, str] = (0, "")) -> tuple[int, str]:
    """Expert slots (at most E: every expert a layer, or of the model) that the budget buys, a slot
    taking `layer_bytes` (one expert in every layer, or one in the shared pool); and the budget in words.
    `floor`: the least slot pool a generation runs with, in bytes and words (a device budget that cannot
    hold it and `fixed` says the whole need)."""
    if residency is not None:  # (check_budget checked it)
        return min(math.ceil(residency * E - 1e-9), E), f"residency (--residency) {residency}"
    if expert_memory is not None:
        budget = parse_budget(expert_memory, "expert_memory")
        return min(budget // max(layer_bytes, 1), E), f"expert_memory (--expert-memory) {_exactly(budget)}"
    if device_memory is not None:
        budget = parse_budget(device_memory, "device_memory")
        left = budget - sum(fixed.values())
        if left < floor[0]:
            parts = ", ".join(f"{what} {format_size(n)}" for n, what in
                              ((fixed["non"], "non-expert weights"), (fixed["draft"], "draft"),
                               (fixed["kv"], "KV cache"), floor) if n)
            raise BudgetError(
                f"device_memory (--device-memory) {_exactly(budget)} cannot hold what a generation needs on the "
                f"device ({parts}: {_exactly(sum(fixed.values()) + floor[0])} in all); raise it, or give a shorter "
                f"context (--context; the KV cache is planned for {context} tokens)")
        return min(left // max(layer_bytes, 1), E), f"device_memory (--device-memory) {_exactly(budget)}"
    return E, "all resident"


def check_device_room(plan: MemoryPlan, free: int) -> None:
    """CUDA: a plan of more than the device's free memory would fail with an out-of-memory error part way
    through the load (a budget is the caller's word, not checked against the device): refused before it."""
    if plan.total_bytes > free:
        raise BudgetError(
            f"the plan needs {_exactly(plan.total_bytes)} of device memory and the GPU has {_exactly(free)} free; "
            f"give a smaller budget, e.g. device_memory (--device-memory) {format_size(int(free * 0.9))}, 90% of "
            f"what is free as with no budget (the rest: the CUDA context, activations and graphs), or free the GPU")


def check_context(context, spec) -> int | None:
    """`context` (specter.load, --context): the most positions a generation may hold, prompt and new
    tokens together, and what the plan reserves KV cache for (None: the model's whole context)."""
    if context is None:
        return None
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ConfigError(f"context must be an integer >= 1 (tokens: prompt + generated), got {context!r}")
    if context > spec.max_position:
        raise ConfigError(f"context {context} exceeds the model's context of {spec.max_position} tokens"
                          f"{spec.context_note}; give at most {spec.max_position}, or drop it")
    return context


def parse_budget(value, name: str) -> int:
    try:
        return parse_size(value)
    except ValueError as e:
        raise ConfigError(f"{name} (--{name.replace('_', '-')}): {e}") from None


# ------------------------------------------------------------------------------ will it run here?
@dataclass
class HostNeeds:
    store_bytes: int        # every routed expert once, in the checkpoint's dtype
    pinned_bytes: int       # page-locked (CUDA: the store, exactly, or two staging buffers; CPU: none)
    draft_cache_bytes: int  # the INT4 draft on disk (0 without a draft)
    device_bytes: int = 0   # CPU: the emulated device's share of host memory (emulated_device_bytes)
    h2d_path: str = ""      # how expert bytes reach the device: "pinned store" | "staging buffers (2 x N)" | emulated
    staging_bytes: int = 0  # CUDA: one staging buffer (the largest expert), used if the store is not pinned
    raw_rows_bytes: int = 0  # a coded store's raw copy beside it: a host lane's rows (CPU: also the emulated
                             # link's, up to coded_tier.ROWS_MAX_BYTES); builder.Loaded.host_rows


def emulated_device_bytes(plan: MemoryPlan, spec: ModelSpec, store_dtype: torch.dtype, compute: torch.dtype) -> int:
    """On CPU the device is host memory: what the emulated device adds beside the expert store. The
    plan counts what a GPU would hold; the CPU keeps a narrower checkpoint's input embedding in its
    own dtype (MoETransformer.enter), a pool that reads the store's rows in place (plan.pool_rows, from a
    plan made for the CPU) adds nothing, and a small draft is held dequantised (speculative/draft.py
    keep_packed: the compute dtype's bytes a weight, not the packed codes')."""
    from ..speculative.draft import keep_packed

    embed = spec.vocab_size * spec.hidden * max(0, compute.itemsize - store_dtype.itemsize)
    weights = spec.n_moe_layers * spec.n_experts * spec.expert_numel()
    held_dense = plan.draft_bytes and not keep_packed("cpu", weights, compute)
    dense = weights * compute.itemsize - plan.draft_bytes if held_dense else 0
    return plan.total_bytes - embed - (plan.slot_pool_bytes if plan.pool_rows == "store" else 0) + dense


def host_needs(spec: ModelSpec, store_dtype: torch.dtype, device_type: str, draft: bool = True,
               pin: bool | None = None, draft_bits: int = 4) -> HostNeeds:
    """`pin`: whether a CUDA load pins the store (default: unless SPECTER_PIN_STORE=0); if not, copies go
    through CudaLink's two staging buffers, each one expert of the store. `draft_bits`: the cached
    draft's width."""
    store = store_bytes(spec, store_dtype)
    drafts = spec.n_moe_layers * spec.n_experts * draft_expert_bytes(spec, draft_bits, scale_bytes=4) if draft else 0
    if device_type != "cuda":
        return HostNeeds(store, 0, drafts, h2d_path="emulated (host memory)")
    item = store_dtype.itemsize
    staging = aligned(2 * spec.expert_inter * spec.hidden * item) + aligned(spec.hidden * spec.expert_inter * item)
    if pin_wanted() if pin is None else pin:
        return HostNeeds(store, store, drafts, h2d_path="pinned store", staging_bytes=staging)
    return HostNeeds(store, 2 * staging, drafts, h2d_path=describe_staging(staging), staging_bytes=staging)


@dataclass
class Fit:
    """The answer to "does this model run in `device_memory` with `policy`", and what to change if not."""

    policy: str
    device_memory: int
    context: int
    plan: MemoryPlan | None       # None when it does not fit
    minimum: int                  # device bytes the policy needs at this context (one layer's top-k slots)
    full: int                     # device bytes for every expert resident, beside the policy's narrowest draft
    suggestions: list[str]
    draft_bits: int | None = None  # the draft's width chosen (the drafting policies)
    minimum_bits: int | None = None  # ... and the one `minimum` is for (the narrowest tried)
    predicted_k: int | None = None  # the draft length predicted at the chosen width (0: plain steps faster)

    @property
    def fits(self) -> bool:
        return self.plan is not None

    def as_dict(self) -> dict:
        return dict(policy=self.policy, device_memory=self.device_memory, context=self.context, fits=self.fits,
                    draft_bits=self.draft_bits, minimum_bytes=self.minimum, minimum_draft_bits=self.minimum_bits,
                    predicted_k=self.predicted_k, all_resident_bytes=self.full, suggestions=self.suggestions,
                    plan=self.plan.as_dict() if self.plan else None)


def _engine_args(policy: str, device, dtype: torch.dtype, store_dtype, compressed: bool, coded_ratio,
                 k_max: int = DEFAULT_K_MAX) -> dict:
    """make_plan's arguments as the engine passes them for `policy` on `device` (builder.build_engine, at
    `k_max` and the default compile): the pool's dtype and rows, a compressed store's device tier
    (`coded_ratio`: its measured ratio), the verifier's KV scratch."""
    from .coded_tier import plan_tier  # (it imports the kernels' module: not for every plan)

    device = torch.device(device)
    return dict(device=device, store_dtype=store_dtype, compressed=compressed,
                coded_tier=plan_tier(policy, device, dtype, compressed, coded_ratio),
                kv_scratch=verify_scratch(policy, device, k_max=k_max))


def fit(spec: ModelSpec, total_numel: int, dtype: torch.dtype, device_memory, *, policy: str = "specter",
        context: int | None = None, draft_bits: int | None = None, profile=None, device="cpu",
        host_threads: int | None = None, store_dtype: torch.dtype | None = None, compressed: bool = False,
        coded_ratio: float | None = None, k_max: int = DEFAULT_K_MAX) -> Fit:
    """`draft_bits` None: of the draft widths that fit (the drafting policies), the one predicted
    fastest (predict_tpot on `profile`, a LinkProfile or its name; None: the default profile), with the
    host lane where the policy runs one on a `device` ("cpu", "cuda") device with `host_threads`.
    `store_dtype`, `compressed`, `coded_ratio`: the checkpoint's, as the engine plans (_engine_args);
    `k_max` 0: a drafting policy without its draft (the engine makes none)."""
    draft = get_policy(policy).makes_draft(k_max)
    lane = get_policy(policy).computes_on_host(torch.device(device).type, host_threads)
    pool = _engine_args(policy, device, dtype, store_dtype, compressed, coded_ratio, k_max)
    budget = parse_budget(device_memory, "device_memory")
    if not get_policy(policy).offloads:  # every expert on the device, whatever the budget (search's rule)
        plan = make_plan(spec, total_numel, dtype, context=context, draft=False)
        tips = [] if plan.total_bytes <= budget else [
            f"{policy} keeps every expert on the device; an offloading policy runs in {format_size(budget)} "
            f"(the ways to run below)"]
        return Fit(policy, budget, plan.context, plan if not tips else None, plan.total_bytes, plan.total_bytes, tips)
    item = torch.empty((), dtype=dtype).element_size()
    L, E, k = spec.n_moe_layers, spec.n_experts, spec.top_k
    context = min(context or spec.max_position, spec.max_position)
    non = non_expert_numel(spec, total_numel) * item
    if draft and draft_bits is not None:  # as the load refuses it
        from ..speculative.draft_cache import check_packable

        check_packable(draft_bits, spec.hidden, spec.expert_inter)
    widths = (draft_bits,) if draft_bits is not None else draft_widths(spec) if draft else (4,)
    if not widths:  # what runs is the policy without its draft: its need is --k-max 0's
        bare = fit(spec, total_numel, dtype, budget, policy=policy, context=context, profile=profile, device=device,
                   host_threads=host_threads, store_dtype=store_dtype, compressed=compressed,
                   coded_ratio=coded_ratio, k_max=0)
        return Fit(policy, budget, context, None, bare.minimum, bare.full, [
            f"no draft width packs this model's sizes ({spec.hidden}, {spec.expert_inter}): --k-max 0 runs {policy} "
            f"without one" + (" here" if bare.fits else "") + ", as a policy without a draft does (the ways to run "
            f"below)"])
    narrow = min(widths)  # (the widths this model packs)
    draft_b = L * E * draft_expert_bytes(spec, narrow) if draft else 0
    kv_tok, scratch = kv_bytes_per_token(spec, item), pool["kv_scratch"]
    store, numel = pool["store_dtype"] or dtype, spec.expert_numel()  # slots in the pool's dtype (make_plan's)
    least, every = (numel * pool_dtype(pool["device"], store, dtype, n, numel).itemsize for n in (k, L * E))
    minimum = lambda d, c: non + d + kv_tok * (c + scratch) + k * least  # noqa: E731  (one layer's top-k slots)
    full = non + draft_b + kv_tok * (context + scratch) + L * E * every
    profile = _profile(profile)
    fitting = []
    for b in widths:
        try:
            plan = make_plan(spec, total_numel, dtype, device_memory=budget, context=context, draft=draft, draft_bits=b,
                             **pool)
        except BudgetError:
            continue
        fitting.append((*predict_tpot(spec, plan, policy, b if draft else None, profile, lane), -b, plan))
    t, K, _, plan = min(fitting, key=lambda f: (f[0], f[2])) if fitting else (None, None, None, None)
    width = f"INT{narrow} " if draft else ""
    tips = []
    if plan is None:
        bare = minimum(0, context)  # (a policy without a draft)
        if draft and non + draft_b >= budget:
            tips.append(f"the {width}draft alone takes {format_size(draft_b)}, leaving too little of "
                        f"{format_size(budget)}: " + (
                            f"run without a draft (--policy host, on-demand or next-layer), which needs "
                            f"{format_size(bare, up=True)}" if bare <= budget else
                            f"without a draft (--policy host, on-demand or next-layer) it needs "
                            f"{format_size(bare, up=True)}, which does not fit either"))
        elif draft and bare <= budget:
            tips.append(f"--policy host, on-demand or next-layer (no draft) runs in {format_size(bare, up=True)}")
        c = (budget - minimum(draft_b, 0)) // max(kv_tok, 1)
        if 512 <= c < context:  # a context too short to be useful is no advice
            tips.append(f"a shorter context fits: --context {int(c)} (KV cache {format_size(kv_tok * int(c))})")
        tips.append(f"a device with at least {format_size(minimum(draft_b, context), up=True)} runs {policy} at "
                    f"{context} tokens of context ({'an ' + width + 'draft, ' if draft else ''}"
                    f"one layer's top-{k} slots)")
    else:
        if draft and K == 0:  # the width then only buys slots: no draft buys more
            bare = make_plan(spec, total_numel, dtype, device_memory=budget, context=context, draft=False,
                             **_engine_args(policy, device, dtype, store_dtype, compressed, coded_ratio, 0))
            t0 = predict_tpot(spec, bare, policy, None, profile, lane)[0]
            tips.append(f"the draft is predicted not to pay here (K 0: plain steps faster than any draft length, at "
                        f"its assumed acceptance): " + ("--policy resident runs without it" if plan.pool_slots == L * E
                        else f"--k-max 0 runs {policy} without one (no draft is made): {bare.pool_slots} slots, "
                             f"predicted {1 / t0:.3g} tok/s against {1 / t:.3g}"))
        elif draft and plan.draft_bits != max(widths):
            wider = sorted(-f[2] for f in fitting if -f[2] > plan.draft_bits)
            tips.append(f"the draft at INT{plan.draft_bits}: " + (
                "no wider one fits" if not wider else
                f"predicted faster than INT{wider[-1]} (more slots for the target; acceptance assumed)"))
        if plan.pool_slots < L * E:
            tips.append(f"every expert resident needs {format_size(full, up=True)}" + (
                f" beside the {width}draft ({format_size(full - draft_b, up=True)} without it: --policy resident)"
                if draft else ""))
        if plan.pool_slots < L * E and context > TIP_CONTEXT:  # the KV cache of a long context, planned whole
            short = make_plan(spec, total_numel, dtype, device_memory=budget, context=TIP_CONTEXT, draft=draft,
                              draft_bits=plan.draft_bits, **pool)
            if short.pool_slots > plan.pool_slots:
                tips.append(f"the KV cache for {context} tokens takes {format_size(plan.kv_bytes)}; with --context "
                            f"{TIP_CONTEXT} (a generation's prompt and output) it takes {format_size(short.kv_bytes)} "
                            f"and the pool holds {short.pool_slots} slots ({short.pool_slots - plan.pool_slots} more)")
    return Fit(policy, budget, context, plan, minimum(draft_b, context), full, tips,
               draft_bits=plan.draft_bits if plan is not None and draft else None,
               minimum_bits=narrow if draft else None, predicted_k=K if draft else None)
# ------------------------------------------------------------------------------ a way to run (specter plan)
# Ranking inputs that are assumptions, not measurements on these models: the share of drafted tokens
# the target accepts at each draft width, and the share of a verification's misses the draft's
# lookahead predicts early enough to copy while it drafts (specter's planner).
ASSUMED_ACCEPTANCE = {4: 0.80, 3: 0.75, 2: 0.65}
ASSUMED_COVERAGE = 0.8
MIN_CONTEXT = 2048
TIP_CONTEXT = 8192  # a long-context model's plan (fit) says what --context this long would give the pool


def _profile(profile):
    """A LinkProfile from one, its name, or None (the default profile)."""
    from .calibrate import load_profile

    return profile if profile is not None and not isinstance(profile, str) else load_profile(profile)


@dataclass
class Option:
    """One way to run: a policy (and its draft's width), the plan it gets, and its predicted speed."""

    policy: str
    draft_bits: int | None
    plan: MemoryPlan
    tpot_s: float               # predicted seconds a token (see predict_tpot)
    k: int                      # the draft length the prediction chose (0: plain steps pay more)
    acceptance: float | None    # assumed (ASSUMED_ACCEPTANCE)
    host_lane: bool = False     # predicted with its host lane (Policy.computes_on_host)

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.tpot_s if self.tpot_s > 0 else math.inf

    @property
    def without_its_lane(self) -> bool:
        """A policy with a host lane, predicted without it (specter on CUDA unless --host-threads is given)."""
        return not self.host_lane and bool(get_policy(self.policy).host_lane)

    @property
    def no_draft(self) -> bool:
        """A drafting policy run without its draft (--k-max 0)."""
        return self.draft_bits is None and get_policy(self.policy).drafts

    def as_dict(self) -> dict:
        return dict(policy=self.policy, draft_bits=self.draft_bits, k_max=0 if self.no_draft else None,
                    context=self.plan.context,
                    pool_slots=self.plan.pool_slots, residency=self.plan.residency, draft_bytes=self.plan.draft_bytes,
                    slot_pool_bytes=self.plan.slot_pool_bytes, total_bytes=self.plan.total_bytes,
                    predicted_tpot_s=self.tpot_s, predicted_tokens_per_s=self.tokens_per_s, k=self.k,
                    assumed_acceptance=self.acceptance, host_lane=self.host_lane)


def predict_tpot(spec: ModelSpec, plan: MemoryPlan, policy: str, bits: int | None, profile,
                 host_lane: bool = True) -> tuple[float, int]:
    """(seconds a token, K) on `profile`'s machine (a LinkProfile), if routing were uniform. A step is
    memory-bound: it reads the non-expert weights and each expert its tokens route to once,
    (non_expert + L x u(T) x expert bytes) / device bandwidth, u(T) = E (1 - (1 - k/E)^T) the
    distinct experts a layer's T tokens route to. A share `residency` of them is on the device; the
    m others of a layer are copies in series with compute, latency + expert bytes / PCIe each, or
    with a host lane computed on the host at its roofline (host_lane "misses": all of them; "split":
    c copied and m - c hosted so that both lanes finish together, as LaneChoice splits them; `host_lane`
    False: specter's lane does not run, every miss copied, as on CUDA without --host-threads).
    Speculative (draft at `bits`, acceptance a assumed): a cycle drafts K tokens (K draft steps over
    the draft's expert bytes), then verifies K + 1 tokens; it yields (1 - a^(K+1)) / (1 - a) tokens;
    with the planner ASSUMED_COVERAGE of the verification's miss time is spent while the draft runs
    (hidden up to the draft's time). K in 1..16 or plain steps (K = 0), whichever is faster, as the
    governor would."""
    pol = get_policy(policy)
    L, E, k = spec.n_moe_layers, spec.n_experts, spec.top_k
    hbm, pcie, lat = profile.device_memory_bandwidth, profile.pcie_bandwidth, profile.latency
    eb, ne, miss = plan.expert_bytes, plan.non_expert_bytes, 1.0 - plan.residency

    def u(T: int) -> float:
        return E * (1.0 - (1.0 - k / E) ** T) if E else 0.0

    def read(T: int, b: float) -> float:
        return (ne + L * u(T) * b) / hbm

    if not pol.offloads or not L:
        return read(1, eb), 0
    copy = lat + eb / pcie
    host = None
    if pol.host_lane and host_lane:
        from .calibrate import emulated_host_params

        try:
            host = emulated_host_params(profile, 1.0)
        except ConfigError:  # a profile that describes no host: the lane's misses are copied instead
            host = None
    h = eb / host.bandwidth if host is not None else 0.0  # an expert read on the host (memory-bound)

    def misses(m: float) -> float:
        """Seconds a layer's m missing experts take (one call)."""
        if m <= 0:
            return 0.0
        if host is None:
            return m * copy
        if pol.host_lane == "misses":
            return host.latency + m * h
        c = min(m, (host.latency + m * h) / (copy + h))  # copies = host: both lanes finish together
        return c * copy

    plain = read(1, eb * (1.0 - miss) if pol.host_lane == "misses" else eb) + L * misses(k * miss)
    if not pol.drafts or bits is None:  # (a drafting policy at --k-max 0: no draft)
        return plain, 0
    a = ASSUMED_ACCEPTANCE[bits]
    db = plan.draft_bytes / max(1, L * E)
    best, best_k = plain, 0
    for K in range(1, 17):
        drafting = K * read(1, db)
        wait = L * misses(u(K + 1) * miss)
        hidden = min(ASSUMED_COVERAGE * wait, drafting) if pol.prefetch == "planner" else 0.0
        t = (drafting + read(K + 1, eb) + wait - hidden) / ((1.0 - a ** (K + 1)) / (1.0 - a))
        if t < best:
            best, best_k = t, K
    return best, best_k


def contexts_to_try(spec: ModelSpec, context: int | None) -> list[int]:
    """The context asked for (or the model's), then halved down to MIN_CONTEXT when none was asked for."""
    top = min(context or spec.max_position, spec.max_position)
    out = [top]
    while context is None and out[-1] // 2 >= min(MIN_CONTEXT, top) and out[-1] > MIN_CONTEXT:
        out.append(max(out[-1] // 2, MIN_CONTEXT))
    return out


def search(spec: ModelSpec, total_numel: int, dtype: torch.dtype, device_memory, *, context: int | None = None,
           profile=None, policies=None, device="cpu", host_threads: int | None = None,
           store_dtype: torch.dtype | None = None, compressed: bool = False,
           coded_ratio: float | None = None) -> list[Option]:
    """Every way to run in `device_memory` bytes: each policy (the drafted ones at each draft width)
    at the longest context that fits (the one asked for, or the model's halved down to MIN_CONTEXT),
    with the shared pool taking what is left; fastest predicted first. Nothing that does not fit. Each
    policy with its host lane where it runs one on a `device` device with `host_threads` (given for
    specter and host alike: 0 is specter's no-lane shape and leaves host its lane). `store_dtype`,
    `compressed`, `coded_ratio`: as fit's."""
    from ..policy import POLICIES

    profile = _profile(profile)
    budget = parse_budget(device_memory, "device_memory")
    out = []
    for policy in policies or POLICIES:
        pol = get_policy(policy)  # a drafting policy with a host lane runs it without a draft too (--k-max 0)
        for bits in ((*draft_widths(spec), *((None,) if pol.host_lane else ())) if pol.drafts else (None,)):
            for ctx in contexts_to_try(spec, context):
                try:
                    if not pol.offloads:
                        plan = make_plan(spec, total_numel, dtype, context=ctx, draft=False)
                        if plan.total_bytes > budget:
                            continue
                    else:
                        plan = make_plan(spec, total_numel, dtype, device_memory=budget, context=ctx,
                                         draft=bits is not None, draft_bits=bits or 4,
                                         **_engine_args(policy, device, dtype, store_dtype, compressed, coded_ratio,
                                                        DEFAULT_K_MAX if bits else 0))
                except BudgetError:
                    continue
                lane = pol.computes_on_host(torch.device(device).type, host_threads)
                t, K = predict_tpot(spec, plan, policy, bits, profile, lane)
                out.append(Option(policy, bits, plan, t, K, ASSUMED_ACCEPTANCE.get(bits), lane))
                break
    out.sort(key=lambda o: (o.tpot_s, -o.plan.context))
    return out


def options_table(options: list[Option], profile_name: str) -> str:
    """The ranked options as text: one row each, fastest predicted first."""
    head = (f"{'#':>2}  {'policy':<10} {'draft':>6} {'context':>8} {'draft experts':>13} {'slot pool':>11} "
            f"{'slots':>6} {'resident':>8} {'tok/s':>7} {'K':>3}")
    rows = [head]
    for i, o in enumerate(options, 1):
        p = o.plan
        draft = f"INT{o.draft_bits}" if o.draft_bits else "none" if o.no_draft else "-"
        rows.append(f"{i:>2}  {o.policy:<10} {draft:>6} {p.context:>8} {format_size(p.draft_bytes):>13} "
                    f"{format_size(p.slot_pool_bytes):>11} {p.pool_slots:>6} {p.residency:>8.1%} "
                    f"{o.tokens_per_s:>7.2f} {o.k:>3}")
    rows.append(f"predicted on {profile_name}'s device, link and host bandwidths, routing uniform (tok/s: a model "
                f"to rank by, not a measurement); drafted policies at assumed acceptance "
                f"{', '.join(f'INT{b} {a:.2f}' for b, a in ASSUMED_ACCEPTANCE.items())}, specter with "
                f"{ASSUMED_COVERAGE:.0%} of a verification's misses fetched while it drafts; K 0: plain steps predicted "
                f"faster than any draft length." + _lanes_note(options)
                + (" draft none: --k-max 0 (no draft is made)." if any(o.no_draft for o in options) else ""))
    return "\n".join(rows)


def _lanes_note(options: list[Option]) -> str:
    """Which ranked policies were predicted computing misses on the host, and which without their lane."""
    hosted = sorted({o.policy for o in options if o.host_lane})
    copied = sorted({o.policy for o in options if o.without_its_lane})
    note = f" {' and '.join(hosted)} compute{'s' if len(hosted) == 1 else ''} misses on the host too." if hosted else ""
    if copied:
        note += f" {' and '.join(copied)} without its host lane (on CUDA unless --host-threads is given; " \
                f"--host-threads 0): every miss copied."
    return note
