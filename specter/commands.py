"""Subcommands beyond `generate`: plan, bench, profile, serve."""
from __future__ import annotations

import json
import os

from .cli import positive_int
from .errors import ConfigError


def add_subcommands(sub, model_args, sampling_args) -> None:
    p = sub.add_parser("plan", help="device memory plan and host needs, from config.json alone if need be; "
                                    "with --device-memory: does it fit, and what to change")
    p.add_argument("--model", default=None, help="local Hugging Face model directory (default: the bundled model)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]: the device to plan for (default: auto)")
    b = p.add_mutually_exclusive_group()
    b.add_argument("--residency", type=float, default=None, help="fraction of each layer's experts on device")
    b.add_argument("--expert-memory", default=None, help="slot pool budget, e.g. 6GiB")
    b.add_argument("--device-memory", default=None, help="whole-device budget, e.g. 16GiB")
    p.add_argument("--context", type=positive_int, default=None, help="KV cache tokens (default: the model's context)")
    p.add_argument("--policy", default="specter", help="the policy to plan for (a draft only with spec-lru/specter)")
    p.add_argument("--compress-experts", action="store_true",
                   help="the host store losslessly coded (bf16 checkpoints): its size, measured from the weights")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=cmd_plan)

    bn = sub.add_parser("bench", help="run several policies side by side on the same prompts")
    bn.add_argument("--policies", default="resident,on-demand,next-layer,host,spec-lru,specter,oracle",
                    help="comma-separated policies to compare; the first is the reference for token equality "
                         "(default: all seven)")
    model_args(bn, policy=False)
    bn.add_argument("--max-new-tokens", type=int, default=64, help="tokens per generation (default 64)")
    bn.add_argument("--prompts", default=None, help="file: one prompt a line, or a .json list")
    bn.add_argument("--workload", default=None,
                    help="built-in prompt set: default (4 short prompts) | diverse (12 prompts in domains the "
                         "bundled model never saw; run it sampled too: --temperature 1.0 --top-p 0.95)")
    bn.add_argument("--repeat", type=int, default=1, help="passes over the prompts (default 1)")
    bn.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default; tokens are compared)")
    bn.add_argument("--top-p", type=float, default=1.0, help="nucleus mass kept when sampling (default 1 = off)")
    bn.add_argument("--top-k", type=int, default=0, help="likeliest tokens kept when sampling (default 0 = off)")
    bn.add_argument("--seed", type=int, default=0, help="sampling seed of every generation (default 0)")
    bn.add_argument("--plot", default=None, help="PNG: TPOT per policy across residencies 1/8, 1/4, 1/2, 1")
    bn.add_argument("--json", action="store_true", help="print the results as one JSON object")
    bn.set_defaults(func=cmd_bench)

    pr = sub.add_parser("profile", help="list link profiles (GPU, link, host) and this machine's emulated-link "
                                        "calibration and measured host lane; --trace: a torch.profiler trace of a "
                                        "short generation")
    pr.add_argument("--model", default=None, help="local Hugging Face model directory (default: the bundled model)")
    pr.add_argument("--json", action="store_true", help="print the calibration as one JSON object")
    pr.add_argument("--host-threads", type=positive_int, default=None,
                    help="threads of the host lane measured (default: physical cores less one)")
    pr.add_argument("--no-host", action="store_true", help="skip measuring this machine's host lane")
    pr.add_argument("--trace", default=None, metavar="FILE.json",
                    help="write a Chrome/Perfetto trace (open in ui.perfetto.dev) of a short generation, with the "
                         "ranges draft step, plan, copy issue, verify, layer N, accept")
    pr.add_argument("--device", default="auto", help="--trace: auto | cpu | cuda[:N] (default: auto)")
    pr.add_argument("--policy", default="specter", help="--trace: the policy traced (default: specter)")
    pr.add_argument("--residency", type=float, default=0.25,
                    help="--trace: fraction of each layer's experts on the device (default 0.25)")
    pr.add_argument("--max-new-tokens", type=int, default=16, help="--trace: tokens generated (default 16)")
    pr.add_argument("--prompt", default="def fibonacci(n):", help="--trace: the prompt (default: def fibonacci(n):)")
    pr.set_defaults(func=cmd_profile)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                      "/v1/models, /health, /metrics)")
    model_args(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    sv.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    sv.add_argument("--max-queue", type=int, default=32,
                    help="requests that may wait for the engine; more get 503 + Retry-After (default 32)")
    sv.add_argument("--model-name", default=None, help="model id clients send (default: the model directory's name)")
    sv.add_argument("--api-key", action="append", default=None, metavar="KEY",
                    help="require `Authorization: Bearer KEY` on /v1 routes (repeat for several keys; default: "
                         "SPECTER_API_KEY, comma-separated, else none)")
    sv.add_argument("--api-key-all-routes", action="store_true",
                    help="require the key on /health and /metrics too")
    sv.add_argument("--allowed-hosts", default=None, metavar="HOSTS",
                    help="comma-separated Host header values to accept, e.g. api.example.com,*.example.com "
                         "(default: any)")
    sv.add_argument("--docs", action="store_true", help="serve /docs and /openapi.json (default: off)")
    sv.add_argument("--max-request-bytes", type=int, default=None, metavar="N",
                    help="largest request body; larger ones get 413 (default 4 MiB; 0 = no limit)")
    sv.add_argument("--max-tokens-default", type=positive_int, default=None, metavar="N",
                    help="tokens a request without max_tokens may generate (default: 16 for completions, the "
                         "rest of the context for chat)")
    sv.add_argument("--shutdown-grace", type=float, default=None, metavar="S",
                    help="on SIGINT/SIGTERM, seconds the running generation may go on before it is stopped "
                         "(default 10)")
    sv.add_argument("--timeout-keep-alive", type=float, default=5, metavar="S",
                    help="close a connection idle this long between requests (default 5)")
    sv.add_argument("--request-timeout", type=float, default=60, metavar="S",
                    help="close a connection whose request (headers and body) takes longer than this to arrive "
                         "(default 60)")
    sv.add_argument("--limit-concurrency", type=positive_int, default=None, metavar="N",
                    help="most open connections and tasks; more get 503 (default: no limit)")
    sv.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from .cli import _load
    from .server import serve

    if args.max_queue < 0 or not 0 <= args.port <= 65535:
        raise ConfigError("--max-queue must be >= 0 and --port in [0, 65535]")
    if args.max_request_bytes is not None and args.max_request_bytes < 0:
        raise ConfigError("--max-request-bytes must be >= 0 (0 = no limit)")
    if args.shutdown_grace is not None and not args.shutdown_grace >= 0:
        raise ConfigError("--shutdown-grace must be a number of seconds >= 0")
    if not (args.timeout_keep_alive > 0 and args.request_timeout > 0):
        raise ConfigError("--timeout-keep-alive and --request-timeout must be a number of seconds > 0")
    keys = args.api_key if args.api_key else [k.strip() for k in os.environ.get("SPECTER_API_KEY", "").split(",")]
    keys = [k for k in keys if k]
    if args.api_key and len(keys) < len(args.api_key):
        raise ConfigError("--api-key must not be empty")
    options = dict(api_keys=keys, protect_all=args.api_key_all_routes, docs=args.docs,
                   max_tokens_default=args.max_tokens_default, timeout_keep_alive=args.timeout_keep_alive,
                   request_timeout=args.request_timeout, limit_concurrency=args.limit_concurrency)
    if args.allowed_hosts:
        options["allowed_hosts"] = [h.strip() for h in args.allowed_hosts.split(",") if h.strip()]
    if args.max_request_bytes is not None:
        options["max_request_bytes"] = args.max_request_bytes or None
    if args.shutdown_grace is not None:
        options["shutdown_grace"] = args.shutdown_grace
    engine = _load(args)
    try:
        serve(engine, host=args.host, port=args.port, model_name=args.model_name, max_queue=args.max_queue,
              **options)
    finally:
        engine.close()
    return 0


def cmd_plan(args) -> int:
    """The device plan (and, with --device-memory, whether it fits and what to change), from the weights'
    headers or from config.json alone: it answers before anything is downloaded."""
    import torch

    from . import default_model_path
    from .builder import compute_dtype
    from .loader import describe
    from .offload.plan import emulated_device_bytes, fit, host_needs, make_plan
    from .offload.staging import describe as describe_staging
    from .sizes import format_size

    path = args.model or default_model_path()
    spec, store_dtype, numel, weights = describe(path)
    device = _plan_device(args.device, args.device_memory is not None)
    dtype = compute_dtype(device, store_dtype)
    host = host_needs(spec, store_dtype, device.type, draft=args.policy in ("spec-lru", "specter"))
    coded = _coded_store(path, weights, host) if args.compress_experts else None
    head = f"model {path} ({spec.arch}), stored {str(store_dtype)[6:]} " \
           f"({'weights' if weights else 'config.json only'}), computed {str(dtype)[6:]} on {device.type}"
    hosts = f"host memory: expert store {format_size(host.store_bytes)} (pinned {format_size(host.pinned_bytes)}), " \
            f"draft cache {format_size(host.draft_cache_bytes)} on disk"
    if coded is not None:  # the store's size above is the coded one
        hosts = hosts.replace("expert store", "expert store (losslessly coded: "
                              f"{coded / host.raw_store_bytes:.2f}x of bf16's {format_size(host.raw_store_bytes)})", 1)
    copies = f"host->device copies: {host.h2d_path}"
    if host.h2d_path == "pinned store":
        copies += f" (if the host cannot pin it: {describe_staging(host.staging_bytes)})"
    graphs = _graph_plan(spec, device, args.policy, dtype)
    if graphs is not None:  # one more line under the copies
        copies += f"\nCUDA graphs (compiled draft and verifier): {graphs['recordings']} recorded per generating " \
                  f"thread and KV cache size, before its first generation there (verifier {graphs['widths']} " \
                  f"widths x ({spec.n_layers} layers + 2), draft 2); one pool per thread, " \
                  f"~{format_size(graphs['pool_bytes'])} (estimate; measured: stats cuda_graphs)"
    if args.device_memory is not None:
        f = fit(spec, numel, dtype, args.device_memory, policy=args.policy, context=args.context)
        if args.json:
            print(json.dumps({**f.as_dict(), "host": vars(host), "dtype": str(dtype)[6:], "cuda_graphs": graphs}))
            return 0
        print(head)
        if f.fits:
            print(f.plan.table())
            print(f"{args.policy} runs in {format_size(f.device_memory)}: residency {f.plan.residency:.1%} "
                  f"({f.plan.slots_per_layer} of {spec.n_experts} experts a layer on the device)")
        else:
            print(f"{args.policy} does NOT fit in {format_size(f.device_memory)}: it needs at least "
                  f"{format_size(f.minimum)} at {f.context} tokens of context")
        print(hosts)
        print(copies)
        for tip in f.suggestions:
            print(f"  - {tip}")
        return 0
    plan = make_plan(spec, numel, dtype, residency=args.residency, expert_memory=args.expert_memory,
                     context=args.context, draft=args.policy in ("spec-lru", "specter"))
    lanes = _lane_split(spec, store_dtype, plan.residency, args.policy) if args.policy in ("host", "specter") else None
    if lanes is not None and args.policy == "host":
        copies += f"\nhost lane (policy host): ~{format_size(lanes['host_bytes_per_token'])} of expert weights a " \
                  f"token read in place on the host ({1 - plan.residency:.0%} of expert uses if routing were " \
                  f"uniform), 0 B over PCIe after warm-up"
    elif lanes is not None:
        v = lanes["verification"]
        copies += f"\ntwo lanes (policy specter; on CUDA with --host-threads): each layer's misses split so that " \
                  f"both lanes finish together, the ones the draft predicts reuse for copied first " \
                  f"({lanes['profile']}'s link and host, routing uniform): a plain step " \
                  f"~{format_size(lanes['pcie_bytes_per_token'])} over PCIe and " \
                  f"~{format_size(lanes['host_bytes_per_token'])} read in place on the host; a verification of " \
                  f"{v['tokens']} tokens ~{format_size(v['pcie_bytes_per_token'])} and " \
                  f"~{format_size(v['host_bytes_per_token'])} a token (the host's per-job latency is paid once " \
                  f"for all of them)"
    if device.type == "cpu":  # the emulated device lives in host memory
        host.device_bytes = emulated_device_bytes(plan, spec, store_dtype, dtype)
        hosts += f", emulated device {format_size(host.device_bytes)} (host memory on cpu: a big model's slot " \
                 f"pool aliases the store)"
    if args.json:
        print(json.dumps({**plan.as_dict(), "host": vars(host), "cuda_graphs": graphs, "lanes": lanes}))
    else:
        print(head)
        print(plan.table())
        print(hosts)
        print(copies)
    return 0


def _coded_store(path, weights: bool, host) -> int:
    """--compress-experts: the coded store's bytes (every expert read once); host's store and pinned
    bytes become the coded ones (host.raw_store_bytes keeps the bf16 size)."""
    from .offload.coded import coded_store_bytes

    if not weights:
        raise ConfigError("--compress-experts: the coded size is measured from the weights, and this "
                          "model directory has config.json only")
    coded, raw = coded_store_bytes(path)
    host.raw_store_bytes = raw
    if host.pinned_bytes == host.store_bytes:
        host.pinned_bytes = coded
    host.store_bytes = coded
    return coded


def _lane_split(spec, store_dtype, residency: float, policy: str = "host", profile: str | None = None,
                verify_tokens: int = 8) -> dict:
    """Expected expert traffic a decoded token sends each lane, if routing were uniform. host: the
    non-resident share of its top-k uses is computed on the host from the store. specter: each
    layer's m misses are split as LaneChoice splits them, c copied and the rest hosted so that both
    lanes finish together on the link profile's machine (memory-bound host):

        c (latency + b / pcie) = host_latency + (m - c) b / host_bandwidth,   0 <= c <= m

    b an expert's bytes; for a plain step (one token, m = top_k (1 - residency)) and for a verification
    of `verify_tokens` tokens (m = the non-resident share of the E (1 - (1 - top_k / E)^T) distinct
    experts they route to), the latter per token verified."""
    per_token = spec.n_moe_layers * spec.top_k * spec.expert_numel() * store_dtype.itemsize
    off = per_token * (1 - residency)
    out = {"host_bytes_per_token": int(off), "pcie_bytes_per_token": 0, "device_bytes_per_token": int(per_token * residency)}
    if policy != "specter":
        return out
    from .offload.calibrate import emulated_host_params, load_profile

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


def _graph_plan(spec, device, policy: str, dtype) -> dict | None:
    """CUDA graphs a speculative policy records on CUDA (compiled by default there), at the default
    K_max; None elsewhere."""
    if device.type != "cuda" or policy not in ("spec-lru", "specter"):
        return None
    from .compiled.verify_step import graph_plan

    return graph_plan(spec.n_layers, spec.vocab_size, spec.hidden, 32, dtype.itemsize)


def _plan_device(device: str, sized: bool):
    """A plan is arithmetic: `cuda` needs no GPU here. auto = cuda when present or when a device size
    is given (the question is then "will it run on that GPU"), else cpu."""
    import torch

    from . import resolve_device

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() or sized else "cpu")
    if device.startswith("cuda"):
        return torch.device("cuda")
    return resolve_device(device)


def cmd_bench(args) -> int:
    from .bench import format_table, read_prompts, run_bench
    from .cli import engine_options

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise ConfigError("--policies is empty")
    if args.repeat < 1 or args.max_new_tokens < 1:
        raise ConfigError("--repeat and --max-new-tokens must be >= 1")
    prompts = read_prompts(args.prompts, args.workload)
    kw = dict(prompts=prompts, max_new_tokens=args.max_new_tokens, repeat=args.repeat, device=args.device,
              link=args.link)
    kw["sampling"] = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    kw.update(engine_options(args))
    if args.plot:
        from .plot import residency_sweep

        sweep = residency_sweep(args.model, policies, args.plot, **kw)
        if args.json:
            print(json.dumps(sweep))
        return 0
    residency = args.residency
    if residency is None and args.expert_memory is None:
        residency = 0.25  # a budget where offloading matters; everything resident would tie every policy
    res = run_bench(args.model, policies, residency=residency, expert_memory=args.expert_memory, **kw)
    if args.json:
        print(json.dumps(res))
    else:
        budget = f"expert_memory {args.expert_memory}" if args.expert_memory else f"residency {residency:g}"
        mode = "greedy" if not args.temperature else f"sampling (temperature {args.temperature:g}, " \
            f"top-p {args.top_p:g}, top-k {args.top_k}, seed {args.seed})"
        workload = f"workload {args.workload or 'default'}" if args.prompts is None else args.prompts
        print(f"link: {res['link']}, {budget}, {workload}: {res['prompts']} prompts x {res['repeat']}, "
              f"{res['max_new_tokens']} new tokens, {mode}")
        print(format_table(res))
    return 0


def cmd_profile(args) -> int:
    if args.trace:
        return cmd_trace(args)
    from .offload.calibrate import (available_profiles, emulated_host_params, emulated_link_params, load_profile,
                                    measure_expert_throughput)
    from .loader import open_checkpoint
    from . import default_model_path

    from .builder import configure_threads
    import torch

    spec = open_checkpoint(args.model or default_model_path()).spec
    configure_threads(torch.device("cpu"), None)  # calibrate exactly as the engine does
    tput = measure_expert_throughput(spec.hidden, spec.expert_inter)
    rows = []
    for name in available_profiles():
        p = load_profile(name)
        bw, lat = emulated_link_params(p, tput)
        h = emulated_host_params(p, p.device_memory_bandwidth / tput)
        rows.append(dict(name=name, gpu=p.gpu, device_memory_GBps=p.device_memory_bandwidth / 1e9,
                         pcie_GBps=p.pcie_bandwidth / 1e9, emulated_MBps=bw / 1e6, emulated_latency_us=lat * 1e6,
                         host=p.host, host_memory_GBps=p.host_memory_bandwidth / 1e9, host_cores=p.host_cores,
                         emulated_host_MBps=h.bandwidth / 1e6, emulated_host_latency_us=h.latency * 1e6))
    lane = None
    if not args.no_host:
        from .offload.host_lane import default_host_threads
        from .offload.host_measure import measure

        lane = measure(args.host_threads or default_host_threads())
    if args.json:
        print(json.dumps({"expert_throughput_GBps": tput / 1e9, "profiles": rows, "host_lane": lane}))
        return 0
    print(f"this machine's expert throughput (fp32, {spec.hidden}x{spec.expert_inter}): {tput / 1e9:.2f} GB/s")
    print(f"{'profile':<18} {'mem GB/s':>9} {'PCIe GB/s':>9} {'ratio':>6} {'emulated MB/s':>13} {'latency us':>10}")
    for r in rows:
        print(f"{r['name']:<18} {r['device_memory_GBps']:>9.0f} {r['pcie_GBps']:>9.1f} "
              f"{r['device_memory_GBps'] / r['pcie_GBps']:>6.0f} {r['emulated_MBps']:>13.1f} {r['emulated_latency_us']:>10.0f}")
    print(f"\n{'profile':<18} {'host GB/s':>9} {'cores':>5} {'emulated host MB/s':>18} {'latency us':>10}  host")
    for r in rows:
        print(f"{r['name']:<18} {r['host_memory_GBps']:>9.1f} {r['host_cores']:>5} {r['emulated_host_MBps']:>18.1f} "
              f"{r['emulated_host_latency_us']:>10.0f}  {r['host']}")
    if lane is not None:
        print(f"\nthis machine's host lane ({lane['threads']} threads): STREAM-like triad {lane['stream_GBps']:.1f} GB/s "
              f"on {lane['stream_cores']} cores, {lane['stream_lane_threads_GBps']:.1f} GB/s on the lane's threads")
        print(host_lane_table(lane))
    return 0


def host_lane_table(lane: dict) -> str:
    """The lane's achieved GB/s per model shape, mode and T, and as a share of the triad on its threads."""
    ref = lane["stream_lane_threads_GBps"]
    modes = list(dict.fromkeys(r["mode"] for r in lane["lane"]))
    Ts = sorted({r["T"] for r in lane["lane"]})
    head = f"{'expert shape':<28} " + " ".join(f"{m + ' T=' + str(t):>15}" for m in modes for t in Ts)
    lines = [head]
    for model in dict.fromkeys(r["model"] for r in lane["lane"]):
        got = {(r["mode"], r["T"]): r for r in lane["lane"] if r["model"] == model}
        any_row = next(iter(got.values()))
        cells = " ".join(f"{got[m, t]['GBps']:>6.1f} ({got[m, t]['GBps'] / ref:>4.0%})" for m in modes for t in Ts)
        lines.append(f"{model + ' ' + str(any_row['hidden']) + 'x' + str(any_row['intermediate']):<28} {cells}")
    return "\n".join(lines + ["GB/s of expert weights read (as stored); (%): of the triad on the lane's threads. "
                               "fp32 rows are batch-invariant GEMVs, which read the weights once a token."])


def cmd_trace(args) -> int:
    import specter
    from .profiling import trace

    if args.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens must be >= 1")
    engine = specter.load(args.model, device=args.device, policy=args.policy,
                          residency=None if args.policy == "resident" else args.residency)
    try:
        prompt = args.prompt if engine.tokenizer is not None else [1, 2, 3]
        engine.generate(prompt, max_new_tokens=2)  # warm up outside the trace
        out = trace(args.trace, lambda: engine.generate(prompt, max_new_tokens=args.max_new_tokens),
                    cuda=engine.device.type == "cuda")
    finally:
        engine.close()
    print(f"wrote {args.trace}: {out.stats['new_tokens']} tokens, policy {args.policy} on {engine.device} "
          f"(open in https://ui.perfetto.dev or chrome://tracing)")
    return 0
