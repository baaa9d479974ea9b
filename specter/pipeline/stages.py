"""Which layers each rank runs, and the fingerprint every rank must share.

Stages are contiguous ranges of decoder layers, one per rank, covering every layer, balanced by
bytes: each layer's own weights (attention, norms, router, shared or dense MLP, counted on a
meta-device model, so nothing is read) plus its routed experts (the memory plan's per-expert
size, spec.expert_numel()); the first stage also carries the embedding, the last the final norm
and lm_head. The split minimises the largest stage.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from itertools import accumulate

import torch

from ..config import ModelSpec
from ..model import MoETransformer
from ..offload.plan import kv_bytes_per_token
from .group import Group, PipelineError, all_gather_objects, comm


@dataclass(frozen=True)
class Stage:
    rank: int
    world: int
    first: int                   # decoder layers [first, last)
    last: int
    moe_first: int               # their MoE layers, as the expert provider numbers them: [moe_first, moe_last)
    moe_last: int

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world - 1


def layer_bytes(spec: ModelSpec, itemsize: int) -> tuple[list[int], int, int]:
    """(bytes of each decoder layer, of the embedding, of the final norm + lm_head) at `itemsize`."""
    with torch.device("meta"):
        model = MoETransformer(spec, max_len=1)
    expert = spec.n_experts * spec.expert_numel()
    moe = set(spec.moe_layer_ids)
    per = [(sum(p.numel() for p in layer.parameters()) + (expert if l in moe else 0)) * itemsize
           for l, layer in enumerate(model.model.layers)]
    embed = model.model.embed_tokens.weight.numel() * itemsize
    head = (model.lm_head.weight.numel() + sum(p.numel() for p in model.model.norm.parameters())) * itemsize
    return per, embed, head


def split_layers(sizes: list[int], n: int, first_extra: int = 0, last_extra: int = 0,
                 first_shared: list[int] | None = None) -> list[tuple[int, int]]:
    """n contiguous non-empty ranges [first, last) covering range(len(sizes)) whose largest total
    (the first range also counting first_extra, the last last_extra) is the least possible; ties
    go to the split whose earlier ranges end first. `first_shared[l]`: bytes of layer l that
    first_extra already counts (the first range counts them once)."""
    L = len(sizes)
    if not 1 <= n <= L:
        raise PipelineError(f"{n} ranks cannot each run at least one of the model's {L} decoder layers; "
                            f"launch at most {L} ranks (torchrun --nproc-per-node)")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)

    shared = [0]
    for s in first_shared or [0] * L:
        shared.append(shared[-1] + s)

    def cost(i: int, a: int, b: int) -> int:  # range i = layers [a, b)
        own = prefix[b] - prefix[a] - (shared[b] if i == 0 else 0)
        return own + (first_extra if i == 0 else 0) + (last_extra if i == n - 1 else 0)

    # best[i][b]: the least largest total of ranges 0..i covering layers [0, b); DP over the end of range i-1
    INF = float("inf")
    best = [[INF] * (L + 1) for _ in range(n)]
    cut = [[0] * (L + 1) for _ in range(n)]
    for b in range(1, L + 1):
        best[0][b] = cost(0, 0, b)
    for i in range(1, n):
        for b in range(i + 1, L + 1):
            for a in range(i, b):
                c = max(best[i - 1][a], cost(i, a, b))
                if c < best[i][b]:
                    best[i][b], cut[i][b] = c, a
    ranges, b = [], L
    for i in range(n - 1, 0, -1):
        a = cut[i][b]
        ranges.append((a, b))
        b = a
    ranges.append((0, b))
    return ranges[::-1]


def stage_fixed_bytes(spec: ModelSpec, stage: Stage, itemsize: int, context: int | None = None) -> tuple[int, int]:
    """(non-expert weight bytes, KV cache bytes at `context` tokens, default the model's) of a stage on
    its device, at the compute dtype's `itemsize`: what its expert pool's budget is left after."""
    per, embed, head = layer_bytes(spec, itemsize)
    expert = spec.n_experts * spec.expert_numel() * itemsize
    moe = set(spec.moe_layer_ids)
    non = sum(per[l] - (expert if l in moe else 0) for l in range(stage.first, stage.last))
    non += (embed if stage.is_first else 0) + (head if stage.is_last else 0)
    ctx = min(context or spec.max_position, spec.max_position)
    kv = kv_bytes_per_token(spec, itemsize) * ctx * (stage.last - stage.first) // spec.n_layers
    return non, kv


def stage_device_bytes(spec: ModelSpec, stage: Stage, itemsize: int, drafts: bool = False, draft_bits: int = 4,
                       context: int | None = None) -> tuple[int, int, int]:
    """(non-expert weight, KV cache, draft expert) bytes on a stage's device, before its expert pool. A
    drafting policy's first rank runs the whole draft (stage.StageModel.whole): every layer's non-expert
    weights and KV cache and every MoE layer's draft experts at `draft_bits`."""
    from ..offload.plan import draft_expert_bytes

    whole = drafts and stage.is_first
    every = Stage(0, 1, 0, spec.n_layers, 0, spec.n_moe_layers)
    non, kv = stage_fixed_bytes(spec, every if whole else stage, itemsize, context)
    draft = spec.n_moe_layers * spec.n_experts * draft_expert_bytes(spec, draft_bits) if whole else 0
    return non, kv, draft


def stage_expert_memory(spec: ModelSpec, stage: Stage, itemsize: int, device_memory, drafts: bool = False,
                        draft_bits: int = 4, context: int | None = None) -> int:
    """The bytes a rank's device of `device_memory` (bytes, or a size such as "24GiB") leaves its expert
    pool: less its stage's non-expert weights, KV cache and draft (stage_device_bytes). A BudgetError
    where they alone do not fit."""
    from ..errors import BudgetError
    from ..offload.plan import parse_budget
    from ..sizes import format_size

    total = parse_budget(device_memory, "device_memory")
    fixed = sum(stage_device_bytes(spec, stage, itemsize, drafts, draft_bits, context))
    if fixed > total:
        whole = drafts and stage.is_first  # more ranks would not help: rank 0 holds the whole draft
        raise BudgetError(f"rank {stage.rank}: device_memory {format_size(total)} cannot even hold its stage's "
                          f"non-expert weights{', KV cache and the whole draft' if whole else ' and KV cache'} "
                          f"({format_size(fixed)}); raise it, or "
                          + ("run without the draft (--k-max 0)" if whole else "run more ranks"))
    return total - fixed


def stage_budget(spec: ModelSpec, stage: Stage, itemsize: int, device: torch.device, residency=None,
                 expert_memory=None, device_memory=None, drafts: bool = False,
                 draft_bits: int = 4, context: int | None = None) -> tuple[int | str | None, bool]:
    """(the expert pool's byte budget or None, whether it is the rank's own) from one budget: a residency
    (None: the plan shares the whole model's pool), expert_memory (the rank's pool), or device_memory (the
    rank's device: stage_expert_memory); on CUDA with none, the device's 90% of its free memory."""
    from ..errors import ConfigError

    if sum(b is not None for b in (residency, expert_memory, device_memory)) > 1:
        raise ConfigError("give one budget: residency (--residency), expert_memory (--expert-memory) or "
                          "device_memory (--device-memory)")
    if device_memory is None and residency is None and expert_memory is None and device.type == "cuda":
        device_memory = int(torch.cuda.mem_get_info(device)[0] * 0.9)  # 90% of what is free
    if device_memory is not None:
        return stage_expert_memory(spec, stage, itemsize, device_memory, drafts, draft_bits, context), True
    return expert_memory, expert_memory is not None


def stage_plan(make, spec: ModelSpec, n_mine: int, own_budget: bool, coded_tier):
    """The plan a stage sizes its pool and tier from: `make(coded_tier)` (make_plan of the whole model).
    A rank's own byte budget that buys every expert of its layers raw keeps them raw, with no tier, as
    one process does when every expert fits: the whole model's plan, weighing that budget against every
    layer's experts, would split it into a layer's top-k slots and a tier that decodes each use."""
    plan = make(coded_tier)
    if plan.tier_bytes and own_budget and (raw := make(None)).pool_slots >= n_mine * spec.n_experts:
        return raw
    return plan


def stage_pool(plan, spec: ModelSpec, n_mine: int, own_budget: bool) -> int:
    """Slots in a stage's expert pool: a byte budget (expert_memory, or what a device budget leaves the
    stage) is each rank's own, so its pool takes what that buys, up to every expert of its layers; a
    residency gives the stage its layers' share of the whole model's pool."""
    if own_budget:
        return min(n_mine * spec.n_experts, plan.pool_slots)
    return min(n_mine * spec.n_experts, max(spec.top_k, plan.pool_slots * n_mine // max(spec.n_moe_layers, 1)))


def stage_tier(plan, spec: ModelSpec, n_mine: int, pool: int, own_budget: bool) -> int:
    """Bytes of a stage's compressed device tier (compress_experts on CPU): none where its `pool` holds
    every expert of its layers; else the plan's tier when the byte budget is the rank's own, or its
    layers' share of the whole model's (a residency), as stage_pool shares the pool."""
    if not plan.tier_bytes or pool >= n_mine * spec.n_experts:
        return 0
    return plan.tier_bytes if own_budget else plan.tier_bytes * n_mine // max(spec.n_moe_layers, 1)


def stage_quota(plan, spec: ModelSpec, n_mine: int, pool: int) -> int:
    """The most experts one of a stage's layers may hold in its `pool` slots: the per-layer rule's
    slots, or (shared pool) the quota rule of offload/plan.py over the stage's own layers, so two
    ranks each given one device's pool let each layer hold twice what one device's layers may."""
    from ..offload.plan import _quota

    if plan.pool == "layer":
        return plan.slots_per_layer
    return _quota(plan.pool, pool, n_mine, spec.n_experts, spec.top_k)


def partition(layers: str, world: int, n_layers: int) -> list[tuple[int, int]]:
    """Ranges [first, last) from a count of decoder layers a rank ("2,2": the first two layers on rank 0),
    as SPECTER_PIPELINE_LAYERS gives it (vLLM's VLLM_PP_LAYER_PARTITION is the same idea)."""
    try:
        counts = [int(c) for c in layers.split(",")]
    except ValueError:
        counts = []
    if len(counts) != world or min(counts, default=0) < 1 or sum(counts) != n_layers:
        raise PipelineError(f"SPECTER_PIPELINE_LAYERS={layers!r}: give {world} comma-separated counts of decoder "
                            f"layers, one a rank, each at least 1, summing to the model's {n_layers} layers")
    ends = list(accumulate(counts))
    return list(zip([0] + ends[:-1], ends))


def make_stages(spec: ModelSpec, world: int, itemsize: int, drafts: bool = False, draft_bits: int = 4) -> list[Stage]:
    """The stages of a `world`-rank pipeline, balanced by bytes, or as SPECTER_PIPELINE_LAYERS counts them
    (`partition`). `drafts` (spec-lru, specter): the first stage also holds the whole draft, every layer's
    non-expert weights and INT4 experts (stage.py), and runs it, so it takes fewer target layers (the draft's
    experts at `draft_bits`)."""
    per, embed, head = layer_bytes(spec, itemsize)
    extra, shared = embed, None
    if drafts:
        from ..offload.plan import draft_expert_bytes

        expert = spec.n_experts * spec.expert_numel() * itemsize
        moe = set(spec.moe_layer_ids)
        shared = [p - (expert if l in moe else 0) for l, p in enumerate(per)]  # its own layers' are the draft's
        extra += sum(shared) + len(moe) * spec.n_experts * draft_expert_bytes(spec, draft_bits)
    given = os.environ.get("SPECTER_PIPELINE_LAYERS")
    ranges = partition(given, world, len(per)) if given else split_layers(per, world, extra, head, shared)
    moe = spec.moe_layer_ids
    out = []
    for r, (a, b) in enumerate(ranges):
        before = sum(1 for l in moe if l < a)
        mine = sum(1 for l in moe if a <= l < b)
        out.append(Stage(r, world, a, b, before, before + mine))
    return out


def fingerprint(ckpt, options: dict, samples: int = 16, sample_bytes: int = 1 << 16) -> str:
    """A hash of what must be the same on every rank: config.json, every safetensors file's name,
    size and header (tensor names, shapes, dtypes, offsets) and `samples` evenly spaced blocks of its
    data (so two checkpoints of one shape with other weights differ without reading them whole), and
    the options that change the computation (policy, dtype, budget, ...)."""
    h = hashlib.sha256()
    h.update((ckpt.path / "config.json").read_bytes())
    for f in sorted(set(ckpt.files.values())):
        size = f.stat().st_size
        h.update(f.name.encode() + b"\0" + str(size).encode() + b"\0")
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(n, 1 << 26)))
            for i in range(samples):
                fh.seek(size * i // samples)
                h.update(fh.read(sample_bytes))
    h.update(json.dumps(options, sort_keys=True, default=str).encode())
    return h.hexdigest()


def agree(group: Group, what: dict, names: dict | None = None, derived: tuple = ()) -> None:
    """Every rank's `what` (a JSON-able dict, e.g. {"fingerprint": ..., "layers": ...}) must equal rank
    0's; otherwise every rank raises a PipelineError naming the ranks and keys that differ, in `names`'
    words where it has them ("options timeout_s": "--pipeline-timeout"); a key in `derived` (computed from
    the others) is named only when nothing else differs."""
    mine = json.dumps(what, sort_keys=True, default=str)
    with comm(group, "comparing the checkpoint and configuration between ranks"):
        got = all_gather_objects(group, mine)  # ranks reach it at their own pace
    odd = [r for r, g in enumerate(got) if g != got[0]]
    if odd:
        ref, keys = json.loads(got[0]), set()
        for r in odd:
            for k, v in json.loads(got[r]).items():
                if isinstance(v, dict) and isinstance(ref.get(k), dict):  # which of them (options: residency ...)
                    keys.update(f"{k} {n}" for n in sorted(set(v) | set(ref[k])) if v.get(n) != ref[k].get(n))
                elif ref.get(k) != v:
                    keys.add(k)
        keys = sorted(keys - set(derived)) or sorted(keys)
        said = ", ".join(dict.fromkeys((names or {}).get(k, k) for k in keys))
        raise PipelineError(f"rank {group.rank} of {group.world}: rank(s) {', '.join(map(str, odd))} differ from "
                            f"rank 0 in {said}: every rank must be given the same model directory (config.json and "
                            f"weights) and the same options")
