"""`specter generate` and `specter chat`: a continuation, or a conversation, streamed to the terminal."""
from __future__ import annotations

import json
import signal
import sys
import threading
from contextlib import contextmanager

from .. import pipeline
from ..errors import ConfigError, ContextLengthError, SpecterError
from .options import (DEFAULT_NEW_TOKENS, check_policy_flags, check_sampling, check_tokenizer, load_engine,
                      model_args, pipeline_args, sampling_args, sampling_kwargs, token_ids)


def add_parsers(sub) -> None:
    g = sub.add_parser("generate", help="generate a continuation, streamed to the terminal")
    g.add_argument("prompt", nargs="?", help="the prompt (default, or -: read standard input)")
    g.add_argument("--prompt-ids", type=token_ids, default=None, metavar="IDS",
                   help="the prompt as token ids, e.g. 1,2,3 (for checkpoints without a tokenizer, whose output is "
                        "then token ids too)")
    g.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the checkpoint's chat template")
    g.add_argument("--system", default=None, help="a system message before the prompt (implies --chat)")
    model_args(g)
    sampling_args(g)
    g.add_argument("--json", action="store_true", help='print one JSON object {"text", "token_ids", "stats"}')
    pipeline_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="an interactive chat through the checkpoint's chat template (--model: one whose "
                                    "tokenizer has one; the bundled model's has none)")
    c.add_argument("--system", default=None, help="a system message at the start of the conversation")
    model_args(c)
    sampling_args(c)
    pipeline_args(c)
    c.set_defaults(func=cmd_chat)


def summary_line(stats: dict) -> str:
    """One line after a streamed generation: speed, then what offloading and speculation did."""
    n, tpot = stats.get("new_tokens", 0), stats.get("tpot_s", 0.0)
    speed = f"TPOT {tpot * 1e3:.1f} ms ({1 / tpot if tpot else 0:.1f} tok/s)" if n > 1 else "TPOT n/a (one token)"
    parts = [f"{n} token{'s' * (n != 1)}", f"TTFT {stats.get('ttft_s', 0) * 1e3:.0f} ms", speed,
             f"policy {stats.get('policy')}"]
    uses = stats.get("expert_hits", 0) + stats.get("expert_misses", 0)
    if stats.get("expert_misses"):  # on the device: in a slot, or decoded there from the coded tier (no PCIe)
        tier = f" ({stats['tier_hits']} decoded from the coded tier)" if stats.get("tier_hits") else ""
        parts.append(f"expert hit rate {(stats['expert_hits'] + stats.get('tier_hits', 0)) / uses:.0%}{tier}, "
                     f"{stats.get('h2d_bytes', 0) / 1e6:.0f} MB copied"
                     + (f", {stats['host_bytes'] / 1e6:.0f} MB of experts computed on the host"
                        if stats.get("host_bytes") else ""))
    if stats.get("drafted_tokens"):
        parts.append(f"{stats['accepted_per_cycle']:.1f} drafted tokens accepted a cycle "
                     f"(alpha {stats['acceptance_rate']:.2f})")
    if stats.get("sampling"):
        parts.append(stats["sampling"] + (" (the model's generation_config.json)"
                                          if stats.get("sampling_from") == "model" else ""))
    if stats.get("seed") is not None:  # a sampled generation: --seed repeats it
        parts.append(f"seed {stats['seed']}")
    return "[" + ", ".join(parts) + "]"


def read_stdin(line: bool = False) -> str:
    """Standard input's text (all of it, or one line), as UTF-8: bytes that are not valid UTF-8 become
    lone surrogates, which the engine refuses in one line ("not valid Unicode"), whatever the locale's
    own decoding would have raised."""
    raw = getattr(sys.stdin, "buffer", None)
    if raw is None:  # a text stream (tests, embedding)
        return sys.stdin.readline() if line else sys.stdin.read()
    return (raw.readline() if line else raw.read()).decode("utf-8", errors="surrogateescape")


def _prompt(args):
    """The prompt from the arguments: text, --prompt-ids, or standard input; --chat/--system wrap it."""
    if args.prompt_ids is not None:
        if args.prompt is not None:
            raise ConfigError("give the prompt as text or as --prompt-ids, not both")
        if args.chat or args.system is not None:
            raise ConfigError("--chat/--system render text through the chat template; --prompt-ids are already tokens")
        return args.prompt_ids
    prompt = args.prompt
    if prompt is None or prompt == "-":  # ("-": standard input, as cat reads it, a terminal's too)
        if sys.stdin is None or (prompt is None and sys.stdin.isatty()):
            raise SpecterError('no prompt: pass one, e.g. specter generate "def add(a, b):", or pipe it on stdin')
        prompt = read_stdin()
        if args.chat or args.system is not None:  # a message, as a line of `specter chat` is one
            prompt = prompt.removesuffix("\n").removesuffix("\r")
            if not prompt.strip():
                raise SpecterError("no prompt: standard input was empty")
    if args.chat or args.system is not None:
        system = [] if args.system is None else [{"role": "system", "content": args.system}]
        return system + [{"role": "user", "content": prompt}]
    return prompt


def cmd_generate(args) -> int:
    check_sampling(args, sampling_kwargs(args))  # before a load (and under torchrun, on every rank)
    if args.chat or args.system is not None:
        if not pipeline.launched():  # (a pipeline checks its flags itself, in pipeline.run)
            check_policy_flags(args)
        check_tokenizer(args, "--chat/--system", chat="drop --chat/--system")
    if pipeline.launched():  # one rank of several (torchrun): rank 0 runs _generate, once
        return pipeline.run(args, lambda engine: _generate(args, _prompt(args), engine))
    if args.pipeline_backend is not None or args.pipeline_timeout is not None:
        raise ConfigError("--pipeline-backend and --pipeline-timeout apply under torchrun only "
                          "(torchrun --nproc-per-node N -m specter generate ...)")
    prompt = _prompt(args)
    return _generate(args, prompt, load_engine(args))


def _generate(args, prompt, engine) -> int:
    try:
        kw = dict(max_new_tokens=args.max_new_tokens, stop=args.stop, **sampling_kwargs(args))  # None: the engine's
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


CHAT_HELP = "one line a turn; /reset starts a new conversation, /exit (or end of input) ends, /help says this"
CHAT_COMMANDS = ("/reset", "/exit", "/help")


def cmd_chat(args) -> int:
    """One line from standard input is one user turn; the reply streams to standard output. `/reset`
    starts over, `/exit` (or end of input) ends. An error in one turn is reported and the chat goes on
    (a broken pipeline ends it). At a terminal, Ctrl-C stops the reply in progress (a second one
    ends the chat). Under torchrun rank 0 reads the terminal and prints; the other ranks follow it,
    as under `serve`."""
    check_sampling(args, sampling_kwargs(args))
    if not pipeline.launched():  # (a pipeline checks its flags itself, in pipeline.run)
        check_policy_flags(args)
    check_tokenizer(args, "`specter chat`", chat="use `specter generate` with a plain prompt")
    if pipeline.launched():
        return pipeline.run(args, lambda engine: _chat(args, engine), waits=True)
    if args.pipeline_backend is not None or args.pipeline_timeout is not None:
        raise ConfigError("--pipeline-backend and --pipeline-timeout apply under torchrun only "
                          "(torchrun --nproc-per-node N -m specter chat ...)")
    return _chat(args, load_engine(args))


def _chat(args, engine) -> int:
    try:
        start = [] if args.system is None else [{"role": "system", "content": args.system}]
        messages = list(start)
        kw = dict(stop=args.stop, **sampling_kwargs(args))
        interactive = sys.stdin.isatty()
        if interactive:
            print(CHAT_HELP, file=sys.stderr)
        while True:
            if interactive:
                print("> ", end="", file=sys.stderr, flush=True)
            line = read_stdin(line=True)
            command = line.strip().lower() if line.startswith("/") else ""  # (" /x": a message)
            if not line or command == "/exit":
                return 0
            if not line.strip():  # an empty line sends nothing
                continue
            if command == "/reset":
                messages = list(start)
                if interactive:
                    print("(a new conversation)", file=sys.stderr)
                continue
            if command == "/help":
                print(CHAT_HELP, file=sys.stderr)
                continue
            if command[1:].isalpha():  # a mistyped command is not sent as a message
                print(f"specter: unknown command {line.strip()} ({', '.join(CHAT_COMMANDS)}); to send a message that "
                      f"starts with /, put a space before it", file=sys.stderr)
                continue
            turn = messages + [{"role": "user", "content": line.rstrip("\r\n")}]
            reply, stats = [], {}
            try:
                with _stoppable(interactive and not pipeline.launched()) as cancel:
                    for piece in engine.stream(turn, max_new_tokens=args.max_new_tokens, stats=stats, cancel=cancel,
                                               **kw):
                        reply.append(piece)
                        sys.stdout.write(piece)
                        sys.stdout.flush()
            except ContextLengthError:  # the conversation outgrew the context: say so, keep chatting
                n, room = len(engine.encode(turn)), engine.context
                what = "the conversation with this message" if len(messages) > len(start) else "this message"
                more = f" and --max-new-tokens {args.max_new_tokens}" if args.max_new_tokens and n < room else ""
                print(f"specter: error: {what} ({n} tokens){more} leaves no room in the context of {room} tokens; "
                      + ("/reset starts over" if len(messages) > len(start) else "send a shorter one"), file=sys.stderr)
                continue
            except SpecterError as e:
                if pipeline.launched():
                    from ..pipeline.group import PipelineError

                    if isinstance(e, PipelineError) or engine.decoder.broken:
                        raise  # a rank is gone or stuck: no turn can run
                print(f"specter: error: {e} (/reset starts over)", file=sys.stderr)
                continue
            sys.stdout.write("\n")
            sys.stdout.flush()
            why = stats.get("finish_reason")
            if why == "cancelled":
                print("(stopped)", file=sys.stderr)
            elif why == "length":  # cut: by --max-new-tokens, the default, or the context's end
                limit = stats["generated_tokens"]
                print(f"(the reply stopped at {limit} tokens: "
                      + ("--max-new-tokens" if args.max_new_tokens is not None else
                         "the end of the context; /reset starts over" if limit < DEFAULT_NEW_TOKENS else
                         "--max-new-tokens raises it") + ")", file=sys.stderr)
            if reply:  # (a stopped reply as shown; one stopped before its first piece leaves no turn)
                messages = turn + [{"role": "assistant", "content": "".join(reply)}]
    finally:
        engine.close()


@contextmanager
def _stoppable(on: bool):
    """A threading.Event set by the first Ctrl-C while the block runs (`on`: at a terminal, one
    process), so the reply ends at its next cycle; a second Ctrl-C interrupts as usual. None when off."""
    if not on:
        yield None
        return
    cancel = threading.Event()

    def stop(signum, frame):
        if cancel.is_set():
            raise KeyboardInterrupt
        cancel.set()

    before = signal.signal(signal.SIGINT, stop)
    try:
        yield cancel
    finally:
        signal.signal(signal.SIGINT, before)
