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
from dataclasses import asdict, dataclass

import torch

from ..config import ModelSpec
from ..errors import BudgetError, ConfigError
from ..policy import get as get_policy
from ..sizes import format_size, parse_size
from .staging import aligned, describe as describe_staging
from .store import pin_wanted, store_bytes

INT4_GROUP = 128

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def compute_dtype(device: torch.device, storage: torch.dtype, dtype=None) -> torch.dtype:
    """fp32 on CPU (exact, and what CPUs are fast at); the checkpoint's 16-bit dtype on CUDA."""
    if dtype is not None:
        if isinstance(dtype, str):
            if dtype not in _DTYPES:
                raise ConfigError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
            return _DTYPES[dtype]
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


def draft_expert_bytes(spec: ModelSpec) -> int:
    """One routed expert in INT4, group size 128: 4 bits a weight + a bf16 scale and shift per group."""
    numel = spec.expert_numel()
    return numel // 2 + math.ceil(numel / INT4_GROUP) * 2 * 2


@dataclass
class MemoryPlan:
    dtype: str
    non_expert_bytes: int
    expert_bytes: int            # one routed expert in the compute dtype
    draft_bytes: int             # every routed expert, INT4
    kv_bytes: int
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
    pool: str = "shared"         # "shared" | "layer" (the per-layer rule)
    tier_bytes: int = 0          # the compressed device tier (offload/coded_tier.py): experts kept coded
    tier_experts: int = 0        # ... about this many, at coded_ratio of a slot each
    coded_ratio: float = 0.0     # a coded expert's bytes over a slot's (0: no tier)

    @property
    def aliased(self) -> bool:
        """The pool holds no copies of its own (OffloadedExperts(alias=True))."""
        return self.pool_rows != "own"

    @property
    def residency(self) -> float:
        return self.pool_slots / max(1, self.n_moe_layers * self.n_experts)

    def as_dict(self) -> dict:
        return {**asdict(self), "residency": self.residency}

    def table(self) -> str:
        rows = [
            ("non-expert weights (always on device)", self.non_expert_bytes),
            (f"draft experts (INT4, g{INT4_GROUP})", self.draft_bytes),
            (f"KV cache ({self.context} tokens)", self.kv_bytes),
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


POOLS = ("shared", "layer")


def make_plan(spec: ModelSpec, total_numel: int, dtype: torch.dtype, *, residency: float | None = None,
              expert_memory=None, device_memory=None, context: int | None = None, draft: bool = True,
              device=None, store_dtype: torch.dtype | None = None, compressed: bool = False,
              pool: str = "shared", coded_tier: float | None = None) -> MemoryPlan:
    """`total_numel`: parameters in the checkpoint. At most one of the three budgets; none = all resident.
    `device`, `store_dtype`, `compressed` (the store losslessly coded): what the pool decisions depend
    on. On CPU a big pool holds the store's narrower dtype (pool_dtype: a byte budget then buys more
    slots) and aliases the store (alias_pool); elsewhere, or with `device` None, the pool holds its
    own copies in the compute dtype. `pool`: "shared" (one pool, floor top-k slots) or "layer" (the
    per-layer rule: the same slots in every layer, floor top-k in each). `coded_tier`: a coded expert's
    bytes over a bf16 one's (the store's measured ratio, or an estimate): the budget is split between
    raw slots and a compressed device tier (tier_split), shared pool only."""
    if pool not in POOLS:
        raise ConfigError(f"pool must be one of {POOLS}, got {pool!r}")
    given = [b for b in (residency, expert_memory, device_memory) if b is not None]
    if len(given) > 1:
        raise ConfigError("give one budget: residency, expert_memory or device_memory")
    item = torch.empty((), dtype=dtype).element_size()
    E, k, L, numel = spec.n_experts, spec.top_k, spec.n_moe_layers, spec.expert_numel()
    context = min(context or spec.max_position, spec.max_position)
    fixed = dict(non=non_expert_numel(spec, total_numel) * item,
                 draft=L * E * draft_expert_bytes(spec) if draft else 0,
                 kv=kv_bytes_per_token(spec, item) * context)
    per = max(L, 1) if pool == "layer" else 1  # a slot is counted in every layer (the per-layer rule) or once
    most = E * (L // per)                       # slots in a layer (the rule), or in the pool, for every expert
    slots, what = _slots(most, per * numel * item, fixed, residency, expert_memory, device_memory)
    store = store_dtype if store_dtype is not None else dtype
    pdt = pool_dtype(device, store, dtype, per * slots, numel)
    if pdt != dtype:  # the same budget in bytes holds more experts of the narrower dtype
        slots, what = _slots(most, per * numel * pdt.itemsize, fixed, residency, expert_memory, device_memory)
    expert = numel * pdt.itemsize
    if L and slots < k:
        need = k * per * expert
        where = "expert slot(s) per layer" if pool == "layer" else "expert slot(s) in the shared pool"
        raise BudgetError(
            f"{what} gives {slots} {where}, but one layer needs its top-{k} = {k} experts at once: at least "
            f"{format_size(need)} of slot pool ({k * per / (L * E):.3f} residency) is required")
    tier_bytes = tier_n = 0
    ratio = 0.0
    if coded_tier and pool == "shared":
        raw = tier_split(slots, k, E, L, coded_tier)
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
                      n_experts=E, top_k=k, slots_per_layer=slots if pool == "layer" else min(E, slots),
                      slot_pool_bytes=n_pool * expert, total_bytes=n_pool * expert + tier_bytes + sum(fixed.values()),
                      pool_dtype=_name(pdt), pool_rows=rows, pool_slots=n_pool, pool=pool,
                      tier_bytes=tier_bytes, tier_experts=tier_n, coded_ratio=round(ratio, 4) if tier_bytes else 0.0)


def tier_split(slots: int, k: int, E: int, L: int, ratio: float) -> int:
    """The raw slots of a budget of `slots` when the rest may hold coded experts at `ratio` of a slot.

    The tier is inclusive (a raw slot's expert stays coded in the tier, offload/coded_tier.py), so the
    device holds about max(raw, tier) distinct experts: each raw slot beyond the floor costs 1 / ratio
    coded experts, i.e. PCIe copies, and buys only hits that would otherwise be decodes, each a launch
    plus (1 + ratio) x an expert's bytes at device memory bandwidth, tens of times cheaper than the
    copy on every profile. So the raw slots are the floor, one layer's top-k (a verification's larger
    working set runs in batches through them, each batch decoded from the tier), and the rest is the
    tier. No tier (all raw) when it would hold no more experts than the raw slots it replaces, or when
    every expert fits raw."""
    raw = min(E, k)
    if slots >= L * E or slots <= raw or (slots - raw) / ratio <= slots:
        return slots
    return raw


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _slots(E: int, layer_bytes: int, fixed: dict, residency, expert_memory, device_memory) -> tuple[int, str]:
    """Expert slots (at most E: every expert a layer, or of the model) that the budget buys, a slot
    taking `layer_bytes` (one expert in every layer, or one in the shared pool); and the budget in words."""
    if residency is not None:
        if isinstance(residency, bool) or not (isinstance(residency, (int, float)) and 0 < residency <= 1):
            raise ConfigError(f"residency must be a fraction in (0, 1], got {residency!r}")
        return min(math.ceil(residency * E - 1e-9), E), f"residency {residency}"
    if expert_memory is not None:
        budget = parse_budget(expert_memory, "expert_memory")
        return min(budget // max(layer_bytes, 1), E), f"expert_memory {format_size(budget)}"
    if device_memory is not None:
        budget = parse_budget(device_memory, "device_memory")
        left = budget - sum(fixed.values())
        if left < 0:
            raise BudgetError(
                f"device_memory {format_size(budget)} cannot even hold the non-expert weights, draft and KV cache "
                f"({format_size(sum(fixed.values()))}); raise it or shorten the context")
        return min(left // max(layer_bytes, 1), E), f"device_memory {format_size(budget)}"
    return E, "all resident"


def parse_budget(value, name: str) -> int:
    try:
        return parse_size(value)
    except ValueError as e:
        raise ConfigError(f"{name}: {e}") from None


# ------------------------------------------------------------------------------ will it run here?
@dataclass
class HostNeeds:
    store_bytes: int        # every routed expert once, in the checkpoint's dtype
    pinned_bytes: int       # page-locked (CUDA: the store, exactly, or two staging buffers; CPU: none)
    draft_cache_bytes: int  # the INT4 draft on disk (0 without a draft)
    device_bytes: int = 0   # CPU: the emulated device's share of host memory (emulated_device_bytes)
    h2d_path: str = ""      # how expert bytes reach the device: "pinned store" | "staging buffers (2 x N)" | emulated
    staging_bytes: int = 0  # CUDA: one staging buffer (the largest expert), used if the store is not pinned


def emulated_device_bytes(plan: MemoryPlan, spec: ModelSpec, store_dtype: torch.dtype, compute: torch.dtype) -> int:
    """On CPU the device is host memory: what the emulated device adds beside the expert store. The
    plan counts what a GPU would hold; the CPU keeps a narrower checkpoint's input embedding in its
    own dtype (model.Embedding), and a pool that reads the store's rows in place (plan.pool_rows,
    from a plan made for the CPU) adds nothing."""
    embed = spec.vocab_size * spec.hidden * max(0, compute.itemsize - store_dtype.itemsize)
    return plan.total_bytes - embed - (plan.slot_pool_bytes if plan.pool_rows == "store" else 0)


def host_needs(spec: ModelSpec, store_dtype: torch.dtype, device_type: str, draft: bool = True,
               pin: bool | None = None) -> HostNeeds:
    """`pin`: whether a CUDA load pins the store (default: unless SPECTER_PIN_STORE=0); if not, copies go
    through CudaLink's two staging buffers, each one expert of the store."""
    store = store_bytes(spec, store_dtype)
    drafts = spec.n_moe_layers * spec.n_experts * draft_expert_bytes(spec) if draft else 0
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
    full: int                     # device bytes for every expert resident
    suggestions: list[str]

    @property
    def fits(self) -> bool:
        return self.plan is not None

    def as_dict(self) -> dict:
        return dict(policy=self.policy, device_memory=self.device_memory, context=self.context, fits=self.fits,
                    minimum_bytes=self.minimum, all_resident_bytes=self.full, suggestions=self.suggestions,
                    plan=self.plan.as_dict() if self.plan else None)


def fit(spec: ModelSpec, total_numel: int, dtype: torch.dtype, device_memory, *, policy: str = "specter",
        context: int | None = None) -> Fit:
    draft = get_policy(policy).drafts
    budget = parse_budget(device_memory, "device_memory")
    item = torch.empty((), dtype=dtype).element_size()
    L, E, k, expert = spec.n_moe_layers, spec.n_experts, spec.top_k, spec.expert_numel() * item
    context = min(context or spec.max_position, spec.max_position)
    non = non_expert_numel(spec, total_numel) * item
    draft_b = L * E * draft_expert_bytes(spec) if draft else 0
    kv_tok = kv_bytes_per_token(spec, item)
    minimum = lambda d, c: non + d + kv_tok * c + k * expert  # noqa: E731  (one layer's top-k slots)
    full = non + draft_b + kv_tok * context + L * E * expert
    try:
        plan = make_plan(spec, total_numel, dtype, device_memory=budget, context=context, draft=draft)
    except BudgetError:
        plan = None
    tips = []
    if plan is None:
        if draft and non + draft_b >= budget:
            tips.append(f"the INT4 draft alone takes {format_size(draft_b)}, leaving too little of "
                        f"{format_size(budget)}: run without a draft (--policy on-demand or next-layer), which "
                        f"needs {format_size(minimum(0, context))}")
        elif draft and minimum(0, context) <= budget:
            tips.append(f"--policy on-demand or next-layer (no draft) runs in {format_size(minimum(0, context))}")
        c = (budget - minimum(draft_b, 0)) // max(kv_tok, 1)
        if 512 <= c < context:  # a context too short to be useful is no advice
            tips.append(f"a shorter context fits: --context {int(c)} (KV cache {format_size(kv_tok * int(c))})")
        tips.append(f"a device with at least {format_size(minimum(draft_b, context))} runs {policy} at "
                    f"{context} tokens of context (one layer's top-{k} slots)")
    elif plan.pool_slots < L * E:
        tips.append(f"every expert resident needs {format_size(full)}")
    return Fit(policy, budget, context, plan, minimum(draft_b, context), full, tips)
