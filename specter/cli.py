"""`specter` command line. User errors print one line on stderr and exit 2, never a traceback."""
from __future__ import annotations

import argparse
import json
import sys

from .errors import SpecterError


def _model_args(p: argparse.ArgumentParser, policy: bool = True) -> None:
    p.add_argument("--model", default=None, help="local Hugging Face model directory (default: the bundled model)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (default: auto)")
    if policy:
        p.add_argument("--policy", default="specter", help="resident | on-demand | next-layer | spec-lru | specter")
    p.add_argument("--residency", type=float, default=None, help="fraction of each layer's experts kept on the device")
    p.add_argument("--expert-memory", default=None, help="device bytes for the expert slot pool, e.g. 6GiB")
    p.add_argument("--link", default=None, help="CPU only: link profile of the emulated PCIe link (see `specter profile`)")
    p.add_argument("--k-max", type=int, default=None,
                   help="longest draft the governor may choose (default 32; 0 = never speculate)")
    p.add_argument("--compile", action="store_true",
                   help="CPU: compile the draft's one-token step with torch.compile (10-30 s at load, then "
                        "faster drafts)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this much mass, in (0, 1] "
                                                            "(default 1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the K likeliest tokens (default 0 = off)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below MIN_P x the likeliest token's probability, in [0, 1] (default 0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 1 discourages tokens of the prompt and output (default 1 = off)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="[-2, 2]: subtracted once from each generated token's logit (default 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="[-2, 2]: subtracted per occurrence among generated tokens (default 0)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: a fresh one each run)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def sampling_kwargs(args) -> dict:
    """generate()'s sampling keywords from _sampling_args' flags."""
    return dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specter", description="Lossless speculative expert offloading for MoE LLMs")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a continuation, streamed to the terminal")
    g.add_argument("prompt", nargs="?", help="the prompt (default: read standard input)")
    _model_args(g)
    _sampling_args(g)
    g.add_argument("--json", action="store_true", help='print one JSON object {"text", "token_ids", "stats"}')
    g.set_defaults(func=cmd_generate)

    from . import commands

    commands.add_subcommands(sub, _model_args, _sampling_args)
    return ap


def engine_options(args) -> dict:
    """specter.load options from _model_args' flags that have no value of their own by default."""
    opts = {} if args.k_max is None else {"k_max": args.k_max}
    if args.compile:
        opts["compile"] = True
    return opts


def _load(args, policy: str | None = None):
    import specter

    return specter.load(args.model, device=args.device, policy=policy or args.policy, residency=args.residency,
                        expert_memory=args.expert_memory, link=args.link, **engine_options(args))


def summary_line(stats: dict) -> str:
    """One line after a streamed generation: speed, then what offloading and speculation did."""
    n, tpot = stats.get("new_tokens", 0), stats.get("tpot_s", 0.0)
    parts = [f"{n} tokens", f"TTFT {stats.get('ttft_s', 0) * 1e3:.0f} ms",
             f"TPOT {tpot * 1e3:.1f} ms ({1 / tpot if tpot else 0:.1f} tok/s)", f"policy {stats.get('policy')}"]
    uses = stats.get("expert_hits", 0) + stats.get("expert_misses", 0)
    if stats.get("expert_misses"):
        parts.append(f"expert hit rate {stats['expert_hits'] / uses:.0%}, "
                     f"{stats.get('h2d_bytes', 0) / 1e6:.0f} MB copied")
    if stats.get("drafted_tokens"):
        parts.append(f"{stats['accepted_per_cycle']:.1f} drafted tokens accepted a cycle "
                     f"(alpha {stats['acceptance_rate']:.2f})")
    return "[" + ", ".join(parts) + "]"


def cmd_generate(args) -> int:
    prompt = args.prompt
    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise SpecterError('no prompt: pass one, e.g. specter generate "def add(a, b):", or pipe it on stdin')
        prompt = sys.stdin.read()
    engine = _load(args)
    kw = dict(max_new_tokens=args.max_new_tokens, stop=args.stop, **sampling_kwargs(args))
    try:
        if args.json:
            out = engine.generate(prompt, **kw)
            print(json.dumps({"text": out.text, "token_ids": out.token_ids, "stats": out.stats}))
            return 0
        stats: dict = {}
        for piece in engine.stream(prompt, stats=stats, **kw):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        print(summary_line(stats), file=sys.stderr)
        return 0
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecterError as e:
        print(f"specter: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
