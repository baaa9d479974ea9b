"""`specter` command line. User errors print one line on stderr and exit 2, never a traceback."""
from __future__ import annotations

import argparse
import json
import os
import sys

from .errors import ConfigError, SpecterError

DTYPES = ("float32", "bfloat16", "float16")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


def token_ids(text: str) -> list[int]:
    """argparse type: "1,2,3" or "1 2 3" -> [1, 2, 3]."""
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids such as 1,2,3, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def _model_args(p: argparse.ArgumentParser, policy: bool = True) -> None:
    p.add_argument("--model", default=None, help="local Hugging Face model directory (default: the bundled model)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (default: auto)")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="compute dtype (default: float32 on CPU, the checkpoint's 16-bit dtype on CUDA)")
    if policy:
        p.add_argument("--policy", default="specter",
                       help="resident | on-demand | next-layer | host | spec-lru | specter (default: specter)")
    p.add_argument("--residency", type=float, default=None,
                   help="fraction of each layer's experts kept on the device, in (0, 1] (offloading policies)")
    p.add_argument("--expert-memory", default=None,
                   help="device bytes for the expert slot pool, e.g. 6GiB (offloading policies)")
    p.add_argument("--link", default=None, help="CPU only: link profile of the emulated PCIe link (see `specter profile`)")
    p.add_argument("--host-threads", type=positive_int, default=None,
                   help="policies host and specter: threads of the host lane that computes experts not on the "
                        "device (default: physical cores less one; specter on CUDA uses the lane only when given)")
    p.add_argument("--k-max", type=int, default=None,
                   help="longest draft the governor may choose (default 32; 0 = never speculate)")
    p.add_argument("--draft-cache", default=None,
                   help="directory of the INT4 draft cache, or 'off' (default: $SPECTER_DRAFT_CACHE, else "
                        "~/.cache/specter/drafts)")
    p.add_argument("--compress-experts", action="store_true",
                   help="keep the host store's experts losslessly coded (bf16 checkpoints): copies move the coded "
                        "bytes and decode into the slot as they land; the same tokens")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the draft's one-token step and the verifier's non-expert pieces with "
                        "torch.compile (default: on CUDA, with CUDA graphs; off on CPU, where it costs 5-60 s "
                        "at load for ~20%% faster decode)")
    p.add_argument("--driver", choices=("sync", "async"), default=None,
                   help="how a generation is driven: blocking waits, or an asyncio event loop that awaits "
                        "copies and plans in a task while the draft runs (default: async on CUDA, sync on CPU, "
                        "where it measured no faster)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    s = p.add_argument_group("sampling", "With none of these (--seed aside), the model's own settings apply: its "
                                         "generation_config.json, greedy if it has none. With any, exactly those "
                                         "apply, the rest at the neutral values shown.")
    t = s.add_mutually_exclusive_group()
    t.add_argument("--greedy", action="store_true", help="always the likeliest token (the same as --temperature 0)")
    t.add_argument("--temperature", type=float, default=None, help="0 = greedy (neutral value 0)")
    s.add_argument("--top-p", type=float, default=None, help="nucleus sampling: keep this much mass, in (0, 1] "
                                                             "(neutral 1 = off)")
    s.add_argument("--top-k", type=int, default=None, help="keep the K likeliest tokens (neutral 0 = off)")
    s.add_argument("--min-p", type=float, default=None,
                   help="drop tokens below MIN_P x the likeliest token's probability, in [0, 1] (neutral 0 = off)")
    s.add_argument("--repetition-penalty", type=float, default=None,
                   help="> 1 discourages tokens of the prompt and output (neutral 1 = off)")
    s.add_argument("--presence-penalty", type=float, default=None,
                   help="[-2, 2]: subtracted once from each generated token's logit (neutral 0)")
    s.add_argument("--frequency-penalty", type=float, default=None,
                   help="[-2, 2]: subtracted per occurrence among generated tokens (neutral 0)")
    s.add_argument("--seed", type=int, default=None, help="sampling seed (default: a fresh one each run)")
    p.add_argument("--stop", action="append", default=None,
                   help="stop string: the text ends before it (repeatable)")


def sampling_kwargs(args) -> dict:
    """generate()'s sampling keywords from _sampling_args' flags; None = not given (the engine then
    applies the model's own settings if no flag was given at all)."""
    return dict(temperature=0.0 if args.greedy else args.temperature, top_p=args.top_p, top_k=args.top_k,
                min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    ap = argparse.ArgumentParser(prog="specter", description="Lossless speculative expert offloading for MoE LLMs")
    ap.add_argument("--version", action="version", version=f"specter {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a continuation, streamed to the terminal")
    g.add_argument("prompt", nargs="?", help="the prompt (default: read standard input)")
    g.add_argument("--prompt-ids", type=token_ids, default=None, metavar="IDS",
                   help="the prompt as token ids, e.g. 1,2,3 (for checkpoints without a tokenizer; output is then "
                        "token ids too)")
    g.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the checkpoint's chat template")
    g.add_argument("--system", default=None, help="a system message before the prompt (implies --chat)")
    _model_args(g)
    _sampling_args(g)
    g.add_argument("--json", action="store_true", help='print one JSON object {"text", "token_ids", "stats"}')
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="an interactive chat through the checkpoint's chat template")
    c.add_argument("--system", default=None, help="a system message at the start of the conversation")
    _model_args(c)
    _sampling_args(c)
    c.set_defaults(func=cmd_chat)

    from . import commands

    commands.add_subcommands(sub, _model_args, _sampling_args)
    return ap


def engine_options(args) -> dict:
    """specter.load options from _model_args' flags that have no value of their own by default."""
    opts = {} if args.k_max is None else {"k_max": args.k_max}
    if args.compile is not None:
        opts["compile"] = args.compile
    if getattr(args, "driver", None):
        opts["driver"] = args.driver
    if getattr(args, "dtype", None):
        opts["dtype"] = args.dtype
    if getattr(args, "draft_cache", None) is not None:
        opts["draft_cache"] = args.draft_cache
    if getattr(args, "compress_experts", False):
        opts["compress_experts"] = True
    if getattr(args, "host_threads", None) is not None:
        opts["host_threads"] = args.host_threads
    return opts


def _load(args, policy: str | None = None):
    import specter

    policy = policy or args.policy
    ignored = [flag for flag, given, used in (("--k-max", args.k_max is not None, ("spec-lru", "specter")),
                                              ("--compile", args.compile, ("spec-lru", "specter")),
                                              ("--host-threads", args.host_threads is not None, ("host", "specter")),
                                              ("--link", args.link is not None, ("on-demand", "next-layer", "host",
                                                                                 "spec-lru", "specter")))
               if given and policy not in used]
    if ignored:
        raise ConfigError(f"policy {policy!r} does not use {ignored[0]}, so it would be ignored; drop it or pick a "
                          "policy that does (--k-max/--compile: spec-lru, specter; --host-threads: host, specter; --link: any offloading "
                          "policy)")
    return specter.load(args.model, device=args.device, policy=policy, residency=args.residency,
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
    if stats.get("sampling"):
        parts.append(stats["sampling"] + (" (the model's generation_config.json)"
                                          if stats.get("sampling_from") == "model" else ""))
    return "[" + ", ".join(parts) + "]"


def _prompt(args):
    """The prompt from the arguments: text, --prompt-ids, or standard input; --chat/--system wrap it."""
    if args.prompt_ids is not None:
        if args.prompt is not None:
            raise ConfigError("give the prompt as text or as --prompt-ids, not both")
        if args.chat or args.system is not None:
            raise ConfigError("--chat/--system render text through the chat template; --prompt-ids are already tokens")
        return args.prompt_ids
    prompt = args.prompt
    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise SpecterError('no prompt: pass one, e.g. specter generate "def add(a, b):", or pipe it on stdin')
        prompt = sys.stdin.read()
    if args.chat or args.system is not None:
        system = [] if args.system is None else [{"role": "system", "content": args.system}]
        return system + [{"role": "user", "content": prompt}]
    return prompt


def cmd_generate(args) -> int:
    prompt = _prompt(args)
    engine = _load(args)
    kw = dict(max_new_tokens=args.max_new_tokens, stop=args.stop, **sampling_kwargs(args))
    try:
        if args.json:
            out = engine.generate(prompt, **kw)
            print(json.dumps({"text": out.text, "token_ids": out.token_ids, "stats": out.stats}))
            return 0
        stats: dict = {}
        if engine.tokenizer is None:  # no text to show: the new token ids, as they are committed
            pieces = (" ".join(map(str, ids)) + " " for ids in engine.stream_ids(prompt, stats=stats, **kw))
        else:
            pieces = engine.stream(prompt, stats=stats, **kw)
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(summary_line(stats), file=sys.stderr)
        return 0
    finally:
        engine.close()


def cmd_chat(args) -> int:
    """One line from standard input is one user turn; the reply streams to standard output. `/reset`
    starts over, `/exit` (or end of input) ends. An error in one turn is reported and the chat goes on."""
    engine = _load(args)
    try:
        if not getattr(engine.tokenizer, "chat_template", None):
            engine.encode([{"role": "user", "content": ""}])  # raises the engine's own clear error
        start = [] if args.system is None else [{"role": "system", "content": args.system}]
        messages = list(start)
        kw = dict(max_new_tokens=args.max_new_tokens, stop=args.stop, **sampling_kwargs(args))
        interactive = sys.stdin.isatty()
        while True:
            if interactive:
                print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line or line.strip() == "/exit":
                return 0
            if line.strip() == "/reset":
                messages = list(start)
                continue
            turn = messages + [{"role": "user", "content": line.rstrip("\n")}]
            reply = []
            try:
                for piece in engine.stream(turn, **kw):
                    reply.append(piece)
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            except SpecterError as e:  # e.g. the conversation outgrew the context: say so, keep chatting
                print(f"specter: error: {e} (/reset starts over)", file=sys.stderr)
                continue
            sys.stdout.write("\n")
            sys.stdout.flush()
            messages = turn + [{"role": "assistant", "content": "".join(reply)}]
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
    except BrokenPipeError:  # the reader left (`specter generate ... | head -2`): stop quietly, like any filter
        try:  # and keep Python's final flush of stdout from failing again at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141  # 128 + SIGPIPE, what a shell reports for a filter stopped by a closed pipe


if __name__ == "__main__":
    sys.exit(main())
