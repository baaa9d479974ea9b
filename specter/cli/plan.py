"""`specter plan`: the device memory plan and the host's needs, from the weights' headers or from
config.json alone (it answers before anything is downloaded); with --device-memory, whether it
fits and what to change."""
from __future__ import annotations

import json
import os

import torch

from .. import default_model_path, refuse_unused, resolve_device
from ..compiled.verify_step import graph_plan
from ..errors import ConfigError
from ..loader import describe
from ..offload.calibrate import emulated_host_params, load_profile
from ..offload.coded import coded_store_bytes
from ..offload.coded_tier import ROWS_MAX_BYTES, plan_tier, tier_wanted
from ..offload.plan import (DRAFT_BITS, check_context, compute_dtype, contexts_to_try, emulated_device_bytes, fit,
                            host_needs, make_plan, options_table, search, verify_scratch)
from ..offload.staging import describe as describe_staging
from ..pipeline.plan import cmd_plan_ranks
from ..policy import DEFAULT as DEFAULT_POLICY, DEFAULT_K_MAX, get as get_policy, names as policy_names
from ..sizes import format_size
from .options import (FLAG_USERS, dtype_arg, nonnegative_int, policy_help, positive_int, refuse_unused_draft_flags,
                      refuse_unused_flags)


def add_parsers(sub) -> None:
    p = sub.add_parser("plan", help="device memory plan and host needs, from config.json alone if need be; "
                                    "with --device-memory: does it fit (exit status 1 when it does not), and what "
                                    "to change")
    p.add_argument("--model", default=None, help="local Hugging Face model directory (default: the bundled model)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]: the device to plan for (default: auto)")
    dtype_arg(p)
    b = p.add_mutually_exclusive_group()
    b.add_argument("--residency", type=float, default=None, help="share of the routed experts on the device (one pool for all layers)")
    b.add_argument("--expert-memory", default=None, help="slot pool budget, e.g. 6GiB")
    b.add_argument("--device-memory", default=None, help="whole-device budget, e.g. 16GiB")
    p.add_argument("--context", type=positive_int, default=None,
                   help="KV cache tokens (default: the model's context; with --device-memory, the ways to run are "
                        "each planned at the longest context that fits, halved from the model's until one does)")
    p.add_argument("--policy", default=DEFAULT_POLICY,
                   help=policy_help(f"the policy to plan for, default {DEFAULT_POLICY}; a draft only with "
                                    f"{'/'.join(policy_names('drafts'))}", bench=True))
    p.add_argument("--k-max", type=nonnegative_int, default=None,
                   help="as generate's: 0 plans a drafting policy without its draft (the engine makes none)")
    p.add_argument("--draft-bits", type=int, choices=DRAFT_BITS, default=None,
                   help="the draft experts' width (default: with --device-memory the fastest that fits, else 4)")
    p.add_argument("--link", default=None, metavar="PROFILE",
                   help="with --device-memory: the machine (link profile, see `specter profile`) whose bandwidths "
                        "rank the ways to run (default: the default profile)")
    p.add_argument("--host-threads", type=nonnegative_int, default=None,
                   help=f"policies {' and '.join(policy_names('host_lane'))}: plan as `specter generate "
                        "--host-threads N` runs (specter on CUDA uses its host lane only when given; 0: without "
                        "it, every miss copied)")
    p.add_argument("--compress-experts", action="store_true",
                   help="the host store losslessly coded (bf16 checkpoints): its size, measured from the weights")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument("--ranks", type=positive_int, default=1,
                   help="plan a torchrun pipeline of N ranks: what each rank holds and whether it fits "
                        "(each rank's own device for --expert-memory/--device-memory)")
    p.set_defaults(func=cmd_plan)


def _host_line(host, coded: int | None) -> str:
    """What the host holds: the expert store (`coded`: its losslessly coded size) and the draft cache."""
    line = f"host memory: expert store {format_size(host.store_bytes)} (pinned {format_size(host.pinned_bytes)}), " \
           f"draft cache {format_size(host.draft_cache_bytes)} on disk"
    if coded is None:
        return line
    return line.replace("expert store", "expert store (losslessly coded: "
                        f"{coded / host.raw_store_bytes:.2f}x of bf16's {format_size(host.raw_store_bytes)})", 1) \
        + f", coded cache {format_size(coded)} on disk"


def cmd_plan(args) -> int:
    pol = get_policy(args.policy)
    pol.check_host_threads(args.host_threads)
    # as generate refuses them (--draft-bits, --compress-experts ...); plan's --link ranks every policy's ways
    refuse_unused_flags(args, [args.policy], [f for f in FLAG_USERS if f[0] != "--link"])
    refuse_unused(args.policy, residency=args.residency, expert_memory=args.expert_memory)
    refuse_unused_draft_flags(args, args.policy)  # as the load refuses them
    if args.link is not None:
        load_profile(args.link)  # an unknown name refused whichever lines read it
    if args.ranks > 1:  # a layer pipeline: per-rank table (specter/pipeline/plan.py)
        return cmd_plan_ranks(args, _plan_device(args.device, args.device_memory is not None))
    path = args.model or default_model_path()
    spec, store_dtype, numel, weights = describe(path)
    check_context(args.context, spec)
    if args.draft_bits is not None:  # a width this model cannot pack: refused, as the load refuses it
        from ..speculative.draft_cache import check_packable

        check_packable(args.draft_bits, spec.hidden, spec.expert_inter)
    device = _plan_device(args.device, args.device_memory is not None)
    dtype = compute_dtype(device, store_dtype, args.dtype)
    drafts = pol.makes_draft(args.k_max)  # (--k-max 0: the engine makes no draft)
    k_max = DEFAULT_K_MAX if args.k_max is None else args.k_max
    host = host_needs(spec, store_dtype, device.type, draft=drafts, draft_bits=args.draft_bits or 4)
    sizes = _coded_store(path, weights) if args.compress_experts else None
    coded = _as_coded(host, sizes)
    head = f"model {path} ({spec.arch}), stored {str(store_dtype)[6:]} " \
           f"({'weights' if weights else 'config.json only'}), computed {str(dtype)[6:]} on {device.type}"
    hosts = _host_line(host, coded)
    copies = f"host->device copies: {host.h2d_path}"
    if host.h2d_path == "pinned store":
        copies += f" (if the host cannot pin it: {describe_staging(host.staging_bytes)})"
    graphs = _graph_plan(spec, device, pol, dtype, drafts, k_max)
    if graphs is not None:  # one more line under the copies
        steps = (f"compiled draft and verifier): {graphs['recordings']} recorded per generating thread and KV "
                 f"cache size, before its first generation there (verifier {graphs['widths']} widths x "
                 f"({spec.n_layers} layers + 2), draft 2)") if drafts else \
                (f"compiled one-token step): {graphs['recordings']} recorded per generating thread and KV cache "
                 f"size, before its first generation there ({spec.n_layers} layers + 2)")
        copies += f"\nCUDA graphs ({steps}; one pool per thread, ~{format_size(graphs['pool_bytes'])} (estimate; " \
                  f"measured: stats cuda_graphs); the MoE calls' own graphs, one a width, beside them"
    if args.device_memory is not None:
        profile = load_profile(args.link)
        store = dict(store_dtype=store_dtype, compressed=args.compress_experts,
                     coded_ratio=coded / host.raw_store_bytes if coded else None)  # the pool as the engine plans it
        f = fit(spec, numel, dtype, args.device_memory, policy=args.policy, context=args.context,
                draft_bits=args.draft_bits, profile=profile, device=device, host_threads=args.host_threads,
                k_max=k_max, **store)
        width = f.draft_bits or f.minimum_bits  # the width the fit chose (or its need is for): its cache's size
        if width and width != (args.draft_bits or 4):
            host = host_needs(spec, store_dtype, device.type, draft=drafts, draft_bits=width)
            _as_coded(host, sizes)
            hosts = _host_line(host, coded)
        ways = search(spec, numel, dtype, args.device_memory, context=args.context, profile=profile,
                      device=device, host_threads=args.host_threads, **store)
        if f.fits:  # what the host holds beside the store, for the plan that runs (as below)
            every = f.plan.pool_slots >= spec.n_moe_layers * spec.n_experts
            hosts = _host_beside_store(host, hosts, f.plan, spec, store_dtype, dtype, device, coded,
                                       pol.computes_on_host(device.type, args.host_threads, every_expert=every))
        if args.json:
            print(json.dumps({**f.as_dict(), "host": vars(host), "dtype": str(dtype)[6:], "cuda_graphs": graphs,
                              "options": [o.as_dict() for o in ways], "profile": profile.name}))
            return 0 if f.fits else 1
        print(head)
        if f.fits:
            print(f.plan.table())
            draft = f", draft INT{f.draft_bits}" if f.draft_bits else ""
            if f.draft_bits and args.draft_bits is None and f.draft_bits != 4:  # not what the load does unasked
                # (the table above is that width's plan; at K 0 a tip says --k-max 0 does better)
                draft += f": run it with --draft-bits {f.draft_bits}"
            bench = " (specter bench only: a bound, not a way to run)" if pol.bench_only else ""
            print(f"{args.policy}{bench} runs in {format_size(f.device_memory)}: residency {f.plan.residency:.1%} "
                  f"({f.plan.pool_slots} of {spec.n_moe_layers * spec.n_experts} routed experts on the device, "
                  f"one pool for all layers{draft})")
        else:
            shorter = [o.plan.context for o in ways if o.policy == args.policy  # (at the width asked for, and
                       and args.draft_bits in (None, o.draft_bits) and o.no_draft == (pol.drafts and not drafts)]
            # with a draft where it makes one: not --k-max 0's row)
            need = format_size(f.minimum, up=True)
            if need == format_size(f.device_memory):  # the same at this precision: say by how much
                need += f" ({f.minimum - f.device_memory:,} bytes more)"
            narrow = f" with --draft-bits {f.minimum_bits}" if f.minimum_bits and f.minimum_bits != 4 else ""
            if drafts and not f.minimum_bits:  # no width packs: what runs is the policy without a draft
                print(f"{args.policy} cannot draft this model (no draft width packs its sizes): with --k-max 0 it "
                      f"needs at least {need} at {f.context} tokens of context")
            else:
                print(f"{args.policy} does NOT fit in {format_size(f.device_memory)}: it needs at least "
                      f"{need} at {f.context} tokens of context{narrow}"
                      + (f" (it runs at {max(shorter)}: see the ways to run below)" if shorter else ""))
        print(hosts)
        print(copies)
        for tip in f.suggestions:
            print(f"  - {tip}")
        if ways:
            at = f"at --context {args.context}" if args.context else \
                f"each at the longest context tried that fits: {f.context}, halved until one does; a tip above may " \
                f"give a longer one"
            print(f"ways to run in {format_size(f.device_memory)}, fastest predicted first ({at}):")
            print(options_table(ways, profile.name))
            if lane_note := _with_lane(ways, spec, numel, dtype, args, profile, device, store):
                print(lane_note)
        else:
            tried = contexts_to_try(spec, args.context)  # (a tip above may fit a shorter one)
            span = f"{tried[0]}" + (f" down to {tried[-1]}" if len(tried) > 1 else "")
            print(f"no policy runs in {format_size(f.device_memory)} at a context of {span} tokens; a shorter "
                  f"--context (a tip above may name one) lists the ways that fit it")
        return 0 if f.fits else 1  # (a script's `specter plan ... && specter serve ...`)
    def plan_at(tier):  # the engine's plan, its budget split with a coded tier at `tier` (None: none)
        return make_plan(spec, numel, dtype, residency=args.residency, expert_memory=args.expert_memory,
                         context=args.context, draft=drafts, device=device, store_dtype=store_dtype,
                         compressed=args.compress_experts, coded_tier=tier, draft_bits=args.draft_bits or 4,
                         kv_scratch=verify_scratch(pol, device, k_max=k_max))  # (compiled on CUDA)

    plan = plan_at(tier_ratio(coded, host, device, pol, dtype))
    every = plan.pool_slots >= spec.n_moe_layers * spec.n_experts
    lane = pol.computes_on_host(device.type, args.host_threads, every_expert=every)  # (none: nothing misses)
    lanes = _lane_split(spec, store_dtype, plan.residency, pol.host_lane, profile=args.link) if lane else None
    if pol.host_lane and every:
        copies += "\nno host lane: every expert is on the device, so nothing misses"
    elif pol.host_lane and not lane:
        copies += f"\nno host lane (policy {args.policy} on {device.type}" + \
                  (", --host-threads 0" if args.host_threads == 0 else ": opt-in there with --host-threads") + \
                  "): every miss copied over PCIe"
    if lanes is not None and pol.host_lane == "misses":
        copies += f"\nhost lane (policy {args.policy}): ~{format_size(lanes['host_bytes_per_token'])} of expert weights a " \
                  f"token read in place on the host ({1 - plan.residency:.0%} of expert uses if routing were " \
                  f"uniform), 0 B over PCIe after warm-up"
    elif lanes is not None:
        v = lanes["verification"]
        copies += f"\ntwo lanes (policy {args.policy}): each layer's misses split so that " \
                  f"both lanes finish together, the ones the draft predicts reuse for copied first " \
                  f"({lanes['profile']}'s link and host, routing uniform): a plain step " \
                  f"~{format_size(lanes['pcie_bytes_per_token'])} over PCIe and " \
                  f"~{format_size(lanes['host_bytes_per_token'])} read in place on the host; a verification of " \
                  f"{v['tokens']} tokens ~{format_size(v['pcie_bytes_per_token'])} and " \
                  f"~{format_size(v['host_bytes_per_token'])} a token (the host's per-job latency is paid once " \
                  f"for all of them)"
    if coded and os.environ.get("SPECTER_CODED_TIER") is None and not tier_wanted(pol, device, dtype) \
            and tier_wanted(pol, device, dtype, opt="1"):  # the CUDA tier is opt-in: say what it would hold
        opt = plan_at(coded / host.raw_store_bytes)
        if opt.tier_bytes:
            copies += f"\ncoded device tier: opt-in on CUDA; SPECTER_CODED_TIER=1 would keep ~{opt.tier_experts} " \
                      f"experts coded beside {opt.pool_slots} raw slots in the same budget"
    hosts = _host_beside_store(host, hosts, plan, spec, store_dtype, dtype, device, coded, lane)
    if args.json:
        print(json.dumps({**plan.as_dict(), "host": vars(host), "cuda_graphs": graphs, "host_lane": lane,
                          "lanes": lanes}))
    else:
        print(head)
        print(plan.table())
        print(hosts)
        print(copies)
    return 0


def _host_beside_store(host, hosts: str, plan, spec, store_dtype, dtype, device, coded, lane: bool) -> str:
    """What the host holds beside the store, set in `host` and added to its line `hosts`: a coded store's
    raw copy (a host lane's rows; CPU: the emulated link's, up to ROWS_MAX_BYTES) and, on CPU, the
    emulated device (`plan`'s, in host memory)."""
    if coded and (lane or (device.type == "cpu" and host.raw_store_bytes <= ROWS_MAX_BYTES)):
        host.raw_rows_bytes = host.raw_store_bytes  # kept beside the coded store (coded.py: the lane's price)
        why = "the host lane reads raw weights" if lane else "coded copies on the emulated link write from it"
        hosts += f", raw copy of the store {format_size(host.raw_rows_bytes)} ({why})"
    if device.type == "cpu":  # the emulated device lives in host memory
        host.device_bytes = emulated_device_bytes(plan, spec, store_dtype, dtype)
        hosts += f", emulated device {format_size(host.device_bytes)} (host memory on cpu" + \
            ("" if coded else ": a big model's slot pool aliases the store") + ")"  # (a coded store: no alias)
    return hosts


def _with_lane(ways, spec, numel, dtype, args, profile, device, store: dict) -> str:
    """Where a lane policy was ranked without its host lane (CUDA, no --host-threads): how fast the best of
    it would be predicted with the lane (opt-in there), so the choice is the user's."""
    opt_in = sorted({o.policy for o in ways if o.without_its_lane})
    if not opt_in or args.host_threads == 0:
        return ""
    best = search(spec, numel, dtype, args.device_memory, context=args.context, profile=profile,
                  policies=opt_in, device=device, host_threads=1, **store)[0]
    draft = f" INT{best.draft_bits}" if best.draft_bits else ""
    return f"with its host lane (`--host-threads N`, opt-in on {device.type}), {best.policy}{draft} would be " \
           f"predicted at {best.tokens_per_s:.2f} tok/s"


def tier_ratio(coded: int | None, host, device, pol, dtype) -> float | None:
    """--compress-experts: the coded store's measured ratio, which sizes the compressed device tier
    where the engine builds one (coded_tier.tier_wanted), else None."""
    return plan_tier(pol, device, dtype, bool(coded), coded / host.raw_store_bytes if coded else None)


def _coded_store(path, weights: bool) -> tuple[int, int]:
    """--compress-experts: (the coded store's bytes, its bf16 bytes), every expert read once."""
    if not weights:
        raise ConfigError("--compress-experts: the coded size is measured from the weights, and this "
                          "model directory has config.json only")
    return coded_store_bytes(path)


def _as_coded(host, sizes: tuple[int, int] | None) -> int | None:
    """host's store and pinned bytes made the coded store's (`sizes`, _coded_store's; host.raw_store_bytes
    keeps the bf16 size); the coded bytes, or None (no sizes: nothing coded)."""
    if sizes is None:
        return None
    coded, host.raw_store_bytes = sizes
    if host.pinned_bytes == host.store_bytes:
        host.pinned_bytes = coded
    host.store_bytes = coded
    return coded


def _lane_split(spec, store_dtype, residency: float, host_lane: str = "misses", profile: str | None = None,
                verify_tokens: int = 8) -> dict:
    """Expected expert traffic a decoded token sends each lane, if routing were uniform. host_lane
    "misses" (policy host): the non-resident share of its top-k uses is computed on the host from
    the store. "split" (specter): each
    layer's m misses are split as LaneChoice splits them, c copied and the rest hosted so that both
    lanes finish together on the link profile's machine (memory-bound host):

        c (latency + b / pcie) = host_latency + (m - c) b / host_bandwidth,   0 <= c <= m

    b an expert's bytes; for a plain step (one token, m = top_k (1 - residency)) and for a verification
    of `verify_tokens` tokens (m = the non-resident share of the E (1 - (1 - top_k / E)^T) distinct
    experts they route to), the latter per token verified."""
    per_token = spec.n_moe_layers * spec.top_k * spec.expert_numel() * store_dtype.itemsize
    off = per_token * (1 - residency)
    out = {"host_bytes_per_token": int(off), "pcie_bytes_per_token": 0, "device_bytes_per_token": int(per_token * residency)}
    if host_lane != "split":
        return out
    p = load_profile(profile)
    h = emulated_host_params(p, 1.0)  # the profiled machine's own seconds
    b = spec.expert_numel() * store_dtype.itemsize
    copy_s, host_s = p.latency + b / p.pcie_bandwidth, b / h.bandwidth

    def split(m: float) -> tuple[int, int]:  # (copied, hosted) bytes of one layer call with m misses
        c = min(m, max(0.0, (h.latency + m * host_s) / (copy_s + host_s))) if m > 0 else 0.0
        return int(c * b), int((m - c) * b)

    L, E, k = spec.n_moe_layers, spec.n_experts, spec.top_k
    pcie, hosted = split(k * (1 - residency))
    T = verify_tokens
    vp, vh = split(E * (1 - (1 - k / E) ** T) * (1 - residency))
    out.update(pcie_bytes_per_token=L * pcie, host_bytes_per_token=L * hosted, profile=p.name,
               verification={"tokens": T, "pcie_bytes_per_token": L * vp // T, "host_bytes_per_token": L * vh // T})
    return out


def _graph_plan(spec, device, pol, dtype, drafts: bool, k_max: int) -> dict | None:
    """CUDA graphs a policy's compiled steps record on CUDA (compiled by default there): a speculative
    one's at `k_max` (`drafts`), a plain one's (or --k-max 0's) one-token step; None elsewhere (CPU, the
    oracle)."""
    if device.type != "cuda" or not pol.compiles:
        return None
    if drafts:
        return graph_plan(spec.n_layers, spec.vocab_size, spec.hidden, k_max, dtype.itemsize)
    return graph_plan(spec.n_layers, spec.vocab_size, spec.hidden, 0, dtype.itemsize, draft=False)


def _plan_device(device: str, sized: bool):
    """A plan is arithmetic: `cuda` needs no GPU here. auto = cuda when present or when a device size
    is given (the question is then "will it run on that GPU"), else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() or sized else "cpu")
    if device.startswith("cuda"):
        return torch.device("cuda")
    return resolve_device(device)
