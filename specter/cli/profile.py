"""`specter profile`: link profiles, this machine's emulated-link calibration and host lane; with
--trace, a torch.profiler trace of a short generation."""
from __future__ import annotations

import json

import torch

import specter

from .. import default_model_path
from ..builder import configure_threads
from ..errors import ConfigError
from ..loader import open_checkpoint
from ..offload import calibrate, host_measure  # modules, not names: tests stand in for their measurements
from ..offload.calibrate import available_profiles, emulated_host_params, emulated_link_params, load_profile
from ..offload.cuda_link import pinned_throughput
from ..offload.host_lane import default_host_threads
from ..policy import DEFAULT as DEFAULT_POLICY, get as get_policy
from ..profiling import trace
from .options import count, output_file, policy_help, positive_int


def add_parsers(sub) -> None:
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
    pr.add_argument("--device", default=None, help="--trace: auto | cpu | cuda[:N] (default: auto)")
    pr.add_argument("--policy", default=None,
                    help="--trace: the policy traced, " + policy_help(f"default: {DEFAULT_POLICY}"))
    pr.add_argument("--residency", type=float, default=None,
                    help="--trace: share of the routed experts kept on the device (default 0.25; offloading "
                         "policies)")
    pr.add_argument("--max-new-tokens", type=int, default=None, help="--trace: tokens generated (default 16)")
    pr.add_argument("--prompt", default=None, help="--trace: the prompt (default: def fibonacci(n):)")
    pr.set_defaults(func=cmd_profile)


TRACE_ONLY = ("device", "policy", "residency", "max_new_tokens", "prompt")  # flags only --trace reads


def cmd_profile(args) -> int:
    if args.trace:
        return cmd_trace(args)
    given = [f for f in TRACE_ONLY if getattr(args, f) is not None]
    if given:
        raise ConfigError(f"--{given[0].replace('_', '-')} applies to --trace only (the calibration measures this "
                          f"machine, not a generation); add --trace FILE.json or drop it")
    spec = open_checkpoint(args.model or default_model_path()).spec
    configure_threads(torch.device("cpu"), None)  # calibrate exactly as the engine does
    pinned = pinned_throughput()  # (the engine's links take it, so the rows below describe them)
    tput = pinned or calibrate.measure_expert_throughput(spec.hidden, spec.expert_inter)
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
        lane = host_measure.measure(args.host_threads or default_host_threads())
    if args.json:
        print(json.dumps({"expert_throughput_GBps": tput / 1e9, "expert_throughput_Bps": tput,
                          "pinned": pinned is not None, "profiles": rows, "host_lane": lane}))
        return 0
    if pinned:
        print(f"expert throughput pinned by SPECTER_EXPERT_THROUGHPUT: {tput / 1e9:.2f} GB/s ({tput:.4g} bytes/s)")
    else:
        print(f"this machine's expert throughput (fp32, {spec.hidden}x{spec.expert_inter}): {tput / 1e9:.2f} GB/s "
              f"(SPECTER_EXPERT_THROUGHPUT={tput:.3g} pins it)")
    print(f"{'profile':<18} {'mem GB/s':>9} {'PCIe GB/s':>9} {'ratio':>6} {'emulated MB/s':>13} {'latency us':>10}")
    for r in rows:
        print(f"{r['name']:<18} {r['device_memory_GBps']:>9.0f} {r['pcie_GBps']:>9.1f} "
              f"{r['device_memory_GBps'] / r['pcie_GBps']:>6.0f} {r['emulated_MBps']:>13.1f} {r['emulated_latency_us']:>10.0f}")
    print(f"\n{'profile':<18} {'host GB/s':>9} {'cores':>5} {'emulated host MB/s':>18} {'latency us':>10}  host")
    for r in rows:
        print(f"{r['name']:<18} {r['host_memory_GBps']:>9.1f} {r['host_cores']:>5} {r['emulated_host_MBps']:>18.1f} "
              f"{r['emulated_host_latency_us']:>10.0f}  {r['host']}")
    if lane is not None:
        print(f"\nthis machine's host lane ({count(lane['threads'], 'thread')}): STREAM-like triad "
              f"{lane['stream_GBps']:.1f} GB/s on {lane['stream_cores']} cores, "
              f"{lane['stream_lane_threads_GBps']:.1f} GB/s on the lane's threads")
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


CALIBRATION_ONLY = (("json", "--json"), ("no_host", "--no-host"), ("host_threads", "--host-threads"))


def cmd_trace(args) -> int:
    policy, new = args.policy or DEFAULT_POLICY, 16 if args.max_new_tokens is None else args.max_new_tokens
    if new < 1:
        raise ConfigError("--max-new-tokens must be >= 1")
    given = [flag for name, flag in CALIBRATION_ONLY if getattr(args, name, None) not in (None, False)]
    if given:  # (silently ignored: --json printed the "wrote" line, not JSON)
        raise ConfigError(f"{given[0]} applies to the calibration, not to --trace; drop it")
    if policy not in specter.POLICIES:  # (bench's oracle: a trace of one generation runs what generate runs)
        raise ConfigError(f"--policy {policy!r}: --trace runs one of {', '.join(specter.POLICIES)}")
    if args.prompt is not None and not args.prompt.strip():
        raise ConfigError("--prompt is empty; give one, or drop it for the default")
    output_file(args.trace, "--trace")
    # the default share for an offloading policy; one given to resident is refused by load, as everywhere
    residency = args.residency if args.residency is not None or not get_policy(policy).offloads else 0.25
    engine = specter.load(args.model, device=args.device or "auto", policy=policy, residency=residency)
    try:
        if engine.tokenizer is None and args.prompt is not None:
            raise ConfigError(f"{engine.path} has no tokenizer, so --prompt cannot be encoded; drop it (the trace "
                              f"then runs token ids 1, 2, 3)")
        prompt = (args.prompt or "def fibonacci(n):") if engine.tokenizer is not None else [1, 2, 3]
        engine.generate(prompt, max_new_tokens=2)  # warm up outside the trace
        out = trace(args.trace, lambda: engine.generate(prompt, max_new_tokens=new),
                    cuda=engine.device.type == "cuda")
    finally:
        engine.close()
    print(f"wrote {args.trace}: {count(out.stats['new_tokens'], 'token')}, policy {policy} on {engine.device} "
          f"(open in https://ui.perfetto.dev or chrome://tracing)")
    return 0
