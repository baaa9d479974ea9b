"""Flags more than one command takes, their argparse types, and the engine they load."""
from __future__ import annotations

import argparse
import re
import os
from pathlib import Path

import specter

from ..engine import DEFAULT_NEW_TOKENS
from ..errors import ConfigError, TokenizerError
from ..policy import BENCH_POLICIES, DEFAULT as DEFAULT_POLICY, POLICIES, get as get_policy, names as policy_names

DTYPES = ("float32", "bfloat16", "float16")


def int_at_least(lo: int):
    """argparse type: an integer >= lo."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {v}")
        return v
    return parse


positive_int, nonnegative_int = int_at_least(1), int_at_least(0)


def output_file(path: str, flag: str) -> Path:
    """A file a command writes at its end, checked before the work: not a directory, its folder made
    (with any missing above it), the file openable for writing (and left as it was)."""
    out = Path(path)
    if out.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; give a file name")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError as e:
        raise ConfigError(f"{flag} {path}: {e.filename} is a file, not a folder") from None
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot make its folder ({e.strerror}: {e.filename})") from None
    existed = out.exists()
    try:  # what the command will do at its end, now: /proc, a read-only mount, permissions ...
        with open(out, "ab"):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot write it ({e.strerror})") from None
    if not existed:
        out.unlink()
    return out


def token_ids(text: str) -> list[int]:
    """argparse type: "1,2,3" or "1 2 3" -> [1, 2, 3]."""
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids such as 1,2,3, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def policy_help(what: str = "", bench: bool = False) -> str:
    """`--policy`'s help: the table's names (specter/policy.py), then `what`."""
    return " | ".join(BENCH_POLICIES if bench else POLICIES) + (f" ({what})" if what else "")


def dtype_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="compute dtype (default: float32 on CPU, the checkpoint's 16-bit dtype on CUDA)")


def model_args(p: argparse.ArgumentParser, policy: bool = True, residency: str = "") -> None:
    """The model, device, policy, budget and engine flags of generate, chat, serve and bench
    (`residency`: what --residency's help says of its default)."""
    p.add_argument("--model", default=None, help="local Hugging Face model directory (default: the bundled model)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (default: auto)")
    dtype_arg(p)
    if policy:
        p.add_argument("--policy", default=DEFAULT_POLICY, help=policy_help(f"default: {DEFAULT_POLICY}"))
    p.add_argument("--residency", type=float, default=None,
                   help="share of the routed experts kept on the device (one pool for all layers), in (0, 1] "
                        f"(offloading policies{residency})")
    p.add_argument("--expert-memory", default=None,
                   help="device bytes for the expert slot pool, e.g. 6GiB (offloading policies)")
    p.add_argument("--device-memory", default=None,
                   help="the whole device's bytes, e.g. 24GiB: the slot pool takes what the weights, KV cache and "
                        "draft leave (offloading policies; default on CUDA: 90%% of what is free; under torchrun "
                        "each rank's own device, see `specter plan --ranks`)")
    p.add_argument("--context", type=positive_int, default=None,
                   help="the most tokens a generation holds, prompt and output together, and what the KV cache "
                        "is planned for (default: the model's context; a shorter one leaves a device budget's "
                        "bytes to experts)")
    p.add_argument("--link", default=None, help="CPU only: link profile of the emulated PCIe link (see `specter profile`)")
    p.add_argument("--host-threads", type=nonnegative_int, default=None,
                   help=f"policies {' and '.join(policy_names('host_lane'))}: threads of the host lane that "
                        "computes experts not on the device (default: physical cores less one; specter on CUDA "
                        "uses the lane only when given; 0: specter without the lane, every miss copied, as on "
                        "CUDA by default)")
    p.add_argument("--k-max", type=nonnegative_int, default=None,
                   help="longest draft the governor may choose (default 32; 0 = never speculate: no draft is "
                        "made, its memory goes to slots, also under torchrun)")
    p.add_argument("--draft-cache", default=None,
                   help="directory of the INT4 draft cache, or 'off' (default: $SPECTER_DRAFT_CACHE, else "
                        "~/.cache/specter/drafts)")
    p.add_argument("--draft-bits", type=int, choices=(4, 3, 2), default=None,
                   help=f"policies {' and '.join(policy_names('drafts'))}: code width of the draft's experts "
                        "(default 4): fewer bits, a smaller draft, fewer drafted tokens accepted; the same output "
                        "tokens")
    p.add_argument("--compress-experts", action="store_true",
                   help="keep the host store's experts losslessly coded (bf16 checkpoints): copies move the coded "
                        "bytes and decode into the slot as they land; the same tokens")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decode steps' non-expert pieces with torch.compile (the draft's one-token "
                        "step and the verifier; a plain policy's one-token step) and replay the MoE calls "
                        "from CUDA graphs (default: on CUDA, with CUDA graphs; off on CPU, where the compile "
                        "at every load costs more than a short generation gains; docs/RESULTS.md)")


def pipeline_args(p: argparse.ArgumentParser) -> None:
    """The flags of a command that runs as a layer pipeline under torchrun (generate, chat, bench, serve)."""
    p.add_argument("--pipeline-backend", choices=("gloo", "nccl"), default=None,
                   help="under torchrun: the backend between ranks (default: nccl between GPUs, else gloo)")
    p.add_argument("--pipeline-timeout", type=float, default=None, metavar="SECONDS",
                   help="under torchrun: how long a rank waits for another before the pipeline fails, once "
                        "every rank has loaded (default 600; joining and loading wait at least 600)")


def sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"most tokens to generate (default {DEFAULT_NEW_TOKENS}, or what the context has room for)")
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
    p.add_argument("--stop", action="append", default=None, type=stop_string,
                   help="stop string: the text ends before it (repeatable; \\n, \\t, \\r and \\\\ are escapes, "
                        "so --stop '\\n' stops at a newline)")


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def stop_string(text: str) -> str:
    """--stop's value with \\n, \\t, \\r and \\\\ read as escapes, as a shell cannot type a newline in
    quotes; any other backslash is itself."""
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m[1], m[0]), text, flags=re.S)


def sampling_kwargs(args) -> dict:
    """generate()'s sampling keywords from sampling_args' flags; None = not given (the engine then
    applies the model's own settings if no flag was given at all)."""
    return dict(temperature=0.0 if args.greedy else args.temperature, top_p=args.top_p, top_k=args.top_k,
                min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, seed=args.seed)


def count(n: int, word: str) -> str:
    """ "1 prompt", "4 prompts"."""
    return f"{n} {word}{'s' * (n != 1)}"


def check_sampling(args, sampling: dict, least: int = 1) -> None:
    """`sampling` (sampling_kwargs, or bench's) and --max-new-tokens (at least `least`) checked before the
    model loads, an error naming the flag (`--top-p must be in (0, 1]`, not the API's `top_p`);
    SamplingParams' rules."""
    from ..sampling import SamplingParams

    n = getattr(args, "max_new_tokens", None)
    if n is not None and n < least:
        raise ConfigError(f"--max-new-tokens must be an integer >= {least}, got {n}"
                          + (": bench reports TPOT, the time a token after the first" if least == 2 else ""))
    given = {k: v for k, v in sampling.items() if v is not None}
    try:
        SamplingParams(**given)
    except ConfigError as e:
        flag = lambda m: "--" + m[1].replace("_", "-") if m[1] in given else m[1]  # noqa: E731
        raise ConfigError(re.sub(r"^(\w+)", flag, str(e)).replace("must be None or an", "must be an")) from None


def engine_options(args) -> dict:
    """specter.load options from model_args' flags that have no value of their own by default."""
    opts = {} if args.k_max is None else {"k_max": args.k_max}
    if args.compile is not None:
        opts["compile"] = args.compile
    if getattr(args, "dtype", None):
        opts["dtype"] = args.dtype
    if getattr(args, "draft_cache", None) is not None:
        opts["draft_cache"] = args.draft_cache
    if getattr(args, "compress_experts", False):
        opts["compress_experts"] = True
    if getattr(args, "draft_bits", None) is not None:
        opts["draft_bits"] = args.draft_bits
    if getattr(args, "host_threads", None) is not None:
        opts["host_threads"] = args.host_threads
    if getattr(args, "context", None) is not None:
        opts["context"] = args.context
    return opts


# Flags that only some policies read, and the Policy field that says which: given to any other
# policy they would be ignored, so they are refused.
FLAG_USERS = (("--k-max", "k_max", "drafts"), ("--compile", "compile", "compiles"),
              ("--draft-bits", "draft_bits", "drafts"),
              ("--host-threads", "host_threads", "host_lane"), ("--link", "link", "offloads"),
              ("--compress-experts", "compress_experts", "offloads"))


def policy_list(text: str) -> list[str]:
    """--policies' comma-separated names: each once, at least one (known names: checked by their users)."""
    policies = [p.strip() for p in text.split(",") if p.strip()]
    if not policies:
        raise ConfigError("--policies is empty")
    twice = [p for i, p in enumerate(policies) if p in policies[:i]]
    if twice:  # one row a policy
        raise ConfigError(f"policy {twice[0]!r} is listed twice; list each policy once (--repeat runs them again)")
    return policies


def refuse_unused_flags(args, policies: list[str], flags=FLAG_USERS) -> None:
    """A flag of `flags` that none of `policies` reads (one: generate's; several: bench's run) would be ignored:
    a ConfigError saying which policies use it."""
    pols = [get_policy(p) for p in policies]
    for flag, dest, field in flags:
        value = getattr(args, dest, None)
        if (value is not None and value is not False) and not any(getattr(pol, field) for pol in pols):
            users = "; ".join(f"{'/'.join(f for f, _, w in FLAG_USERS if w == fld)}: {', '.join(policy_names(fld))}"
                              for fld in dict.fromkeys(w for _, _, w in FLAG_USERS))
            who = f"policy {policies[0]!r} does not use" if len(policies) == 1 else \
                f"none of the policies {', '.join(policies)} uses"
            raise ConfigError(f"{who} {flag}, so it would be ignored; drop it or pick a policy that does ({users})")


def check_policy_flags(args, policy: str | None = None) -> None:
    """A bench-only policy, or a flag the policy would ignore, refused (before anything loads)."""
    policy = policy or args.policy
    if get_policy(policy).bench_only:
        raise ConfigError(f"policy {policy!r} is bench only (a limit to compare against, not a way to run): "
                          f"specter bench --policies on-demand,specter,{policy}")
    refuse_unused_flags(args, [policy])
    refuse_unused_draft_flags(args, policy)


def refuse_unused_draft_flags(args, policies: str | list[str]) -> None:
    """--draft-bits with --k-max 0, and --draft-cache (read for the draft, and for a coded store kept beside
    it) where neither is made (by the policy, or by any of bench's): refused, in one process and under
    torchrun alike."""
    policies = [policies] if isinstance(policies, str) else policies
    pols = [get_policy(p) for p in policies]
    if args.k_max == 0 and getattr(args, "draft_bits", None) is not None:
        raise ConfigError(f"--k-max 0 makes no draft, so --draft-bits {args.draft_bits} would be ignored; drop one")
    if getattr(args, "draft_cache", None) is not None and not getattr(args, "compress_experts", False) \
            and not any(pol.makes_draft(args.k_max) for pol in pols):
        why = "--k-max 0 makes no draft" if any(pol.drafts for pol in pols) else \
            f"policy {policies[0]!r} makes no draft" if len(pols) == 1 else \
            f"none of the policies {', '.join(policies)} makes a draft"
        raise ConfigError(f"{why} and --compress-experts is not given, so --draft-cache would be ignored; drop it")


def check_tokenizer(args, who: str, chat: str | None = None) -> None:
    """Before the load (refused after it, a big model would cost minutes, and its draft first): `who`
    needs the checkpoint's tokenizer, and with `chat` (what to do instead) its chat template too."""
    from ..loader import load_tokenizer

    path = Path(args.model) if args.model is not None else specter.default_model_path()
    if not (path / "config.json").is_file():
        return  # not a model directory: the load says what it is and what to pass
    tok = load_tokenizer(path)
    if tok is None:
        raise TokenizerError(f"{path} ships no tokenizer, which {who} needs; copy the model's tokenizer files next "
                             f"to its config.json")
    if chat is not None and not getattr(tok, "chat_template", None):
        raise TokenizerError(f"the tokenizer in {path} has no chat template, so {who} cannot render turns; {chat}, "
                             f"or add a chat_template to its tokenizer_config.json")


def load_engine(args, policy: str | None = None):
    """specter.load from model_args' flags, refusing a flag the policy would ignore."""
    policy = policy or args.policy
    check_policy_flags(args, policy)
    return specter.load(args.model, device=args.device, policy=policy, residency=args.residency,
                        expert_memory=args.expert_memory, device_memory=args.device_memory, link=args.link,
                        **engine_options(args))
