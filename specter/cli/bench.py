"""`specter bench`: several policies side by side on the same prompts (specter/bench.py runs them)."""
from __future__ import annotations

import json
import os

from .. import pipeline
from ..bench import budget_words, format_table, read_prompts, run_bench
from ..errors import ConfigError
from ..plot import residency_sweep
from ..policy import BENCH_POLICIES, get as get_policy
from .options import (check_sampling, count, engine_options, model_args, output_file, pipeline_args, policy_help,
                      policy_list, refuse_unused_draft_flags, refuse_unused_flags)


def add_parsers(sub) -> None:
    bn = sub.add_parser("bench", help="run several policies side by side on the same prompts")
    bn.add_argument("--policies", default=None,
                    help="comma-separated policies to compare; the first is the reference for token equality "
                         f"(default: all {len(BENCH_POLICIES)}: {policy_help(bench=True)})")
    model_args(bn, policy=False, residency="; default 0.25 when no budget is given")
    pipeline_args(bn)
    bn.add_argument("--max-new-tokens", type=int, default=64, help="tokens per generation (default 64)")
    bn.add_argument("--prompts", default=None, help="file: one prompt a line, or a .json list")
    bn.add_argument("--workload", default=None,
                    help="built-in prompt set: default (4 short prompts) | diverse (12 prompts in domains the "
                         "bundled model never saw; run it sampled too, as docs/RESULTS.md does: --temperature 0.7 "
                         "--top-p 0.95 --top-k 50 --seed 0)")
    bn.add_argument("--repeat", type=int, default=1, help="passes over the prompts (default 1)")
    bn.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default; tokens are compared)")
    bn.add_argument("--top-p", type=float, default=1.0, help="nucleus mass kept when sampling (default 1 = off)")
    bn.add_argument("--top-k", type=int, default=0, help="likeliest tokens kept when sampling (default 0 = off)")
    bn.add_argument("--seed", type=int, default=0, help="sampling seed of every generation (default 0)")
    bn.add_argument("--plot", default=None, help="PNG: TPOT per policy across residencies 1/8, 1/4, 1/2, 1")
    bn.add_argument("--json", action="store_true", help="print the results as one JSON object")
    bn.add_argument("--compare-compressed", action="store_true",
                    help="run each offloading policy twice in this process, on the raw store and on the losslessly "
                         "coded one (POLICY+coded), alternating prompt by prompt; report coded against raw "
                         "(bytes a token, TPOT, tokens). Not with --compress-experts or --plot")
    bn.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    check_sampling(args, sampling, least=2)  # before a load (and under torchrun, on every rank)
    if args.compare_compressed and (args.compress_experts or args.plot or pipeline.launched()):
        raise ConfigError("--compare-compressed runs both stores itself, in one process: "
                          "not with --compress-experts, --plot or under torchrun")
    if pipeline.launched():  # one rank of several (torchrun): specter/pipeline/bench.py
        return pipeline.bench(args)
    if args.pipeline_backend is not None or args.pipeline_timeout is not None:
        raise ConfigError("--pipeline-backend and --pipeline-timeout apply under torchrun only "
                          "(torchrun --nproc-per-node N -m specter bench ...)")
    policies = list(BENCH_POLICIES) if args.policies is None else policy_list(args.policies)
    if args.repeat < 1:
        raise ConfigError("--repeat must be >= 1")
    if args.compare_compressed and not any(get_policy(p).offloads for p in policies):
        raise ConfigError(f"--compare-compressed compares what offloading policies copy, and --policies "
                          f"{','.join(policies)} copies nothing: add one (e.g. on-demand, specter)")
    refuse_unused_flags(args, policies)  # a flag that no policy of the run reads would be ignored
    refuse_unused_draft_flags(args, policies)
    prompts = read_prompts(args.prompts, args.workload)
    kw = dict(prompts=prompts, max_new_tokens=args.max_new_tokens, repeat=args.repeat, device=args.device,
              link=args.link)
    kw["sampling"] = sampling
    kw.update(engine_options(args))
    if args.plot:
        given = [f for f in ("residency", "expert_memory", "device_memory") if getattr(args, f) is not None]
        if given:
            raise ConfigError(f"--plot sweeps the residency itself (1/8, 1/4, 1/2, 1): drop --"
                              f"{given[0].replace('_', '-')}")
        if not os.path.splitext(args.plot)[1] and not os.path.isdir(args.plot):  # matplotlib writes NAME.png:
            # say that name, check that one (a directory: output_file says it is one)
            args.plot += ".png"
        output_file(args.plot, "--plot")  # before the sweep, not after it
        sweep = residency_sweep(args.model, policies, args.plot, **kw)
        if args.json:
            print(json.dumps(sweep))
        return 0
    residency = args.residency
    if residency is None and args.expert_memory is None and args.device_memory is None \
            and any(get_policy(p).offloads for p in policies):
        residency = 0.25  # a budget where offloading matters; everything resident would tie every policy
    if args.compare_compressed:
        kw["compare_compressed"] = True
    res = run_bench(args.model, policies, residency=residency, expert_memory=args.expert_memory,
                    device_memory=args.device_memory, **kw)
    if args.json:
        print(json.dumps(res))
    else:
        budget = budget_words(args, residency) if res["link"] is not None else "every expert on the device"
        mode = "greedy" if not args.temperature else f"sampling (temperature {args.temperature:g}, " \
            f"top-p {args.top_p:g}, top-k {args.top_k}, seed {args.seed})"
        workload = f"workload {args.workload or 'default'}" if args.prompts is None else args.prompts
        bits = {r["draft_bits"] for r in res["policies"].values() if "draft_bits" in r}
        drafts = f", draft INT{bits.pop()}" if bits else ""
        print(f"link: {res['link']}, {budget}, {workload}: {count(res['prompts'], 'prompt')} x {res['repeat']}, "
              f"{res['max_new_tokens']} new tokens, {mode}{drafts}")
        if (c := res.get("link_calibration")) is not None:
            slot, store = c.get("slot_dtype"), c.get("store_dtype")
            of = f" of {slot} slot bytes (H2D MB counts the {store} store's)" if slot and slot != store else ""
            print(f"calibrated on this CPU at load: {c['expert_throughput_GBps']:.1f} GB/s of expert compute -> "
                  f"{c['bandwidth_GBps'] * 1e3:.0f} MB/s{of} + {c['latency_us']:.0f} us a transfer (a busy machine "
                  f"calibrates slower; SPECTER_EXPERT_THROUGHPUT fixes it)")
        print(format_table(res))
    return 0
