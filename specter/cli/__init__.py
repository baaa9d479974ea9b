"""The `specter` command line: the parser and main(); one module per command family.

    options.py    flags shared by several commands, and the engine they load
    generate.py   generate, chat
    plan.py       plan
    bench.py      bench
    profile.py    profile (and --trace)
    serve.py      serve

User errors print one line on stderr and exit 2, never a traceback.
"""
from __future__ import annotations

import argparse
import difflib
import errno
import functools
import os
import sys
import textwrap
import warnings

from .. import __version__, pipeline
from ..errors import SpecterError, SpecterWarning
from ..policy import TABLE
from . import bench, generate, plan, profile, serve
from .generate import summary_line
from .options import engine_options

__all__ = ["build_parser", "main", "engine_options", "summary_line"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specter", description="Lossless speculative expert offloading for MoE LLMs",
                                 epilog=_policies(), formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--version", action="version", version=f"specter {__version__}")
    # no abbreviations (--max-new-token was taken as --max-new-tokens: a later flag would make it ambiguous)
    sub = ap.add_subparsers(dest="command", required=True,
                            parser_class=functools.partial(argparse.ArgumentParser, allow_abbrev=False))
    for command in (generate, plan, bench, profile, serve):  # the order `specter --help` lists them in
        command.add_parsers(sub)
    return ap


def _policies() -> str:
    """`specter --help`'s last lines: each policy and what it does (specter/policy.py's table)."""
    width = max(len(p.name) for p in TABLE) + 4
    lines = [textwrap.fill(p.summary + (" (bench only)" if p.bench_only else ""), 79,
                           initial_indent=f"  {p.name:<{width - 2}}", subsequent_indent=" " * width) for p in TABLE]
    return "policies (--policy, bench --policies):\n" + "\n".join(lines)


def _one_line(message, category, filename, lineno, file=None, line=None, _show=warnings.showwarning) -> None:
    """Specter's own warnings as the CLI prints its errors: one line ("specter: warning: ..."); others as Python
    shows them."""
    if not issubclass(category, SpecterWarning):
        return _show(message, category, filename, lineno, file, line)
    try:
        print(f"specter: warning: {pipeline.rank_prefixed(str(message))}", file=sys.stderr if file is None else file)
    except OSError:  # (as warnings.showwarning: a closed stderr is no reason to fail)
        pass


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """build_parser's arguments; a flag the command does not take is its command's usage error (argparse gives
    the top level's), with the nearest flag it does take."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
        flags = [f for a in command._actions for f in a.option_strings]
        near = [m for x in extra for m in difflib.get_close_matches(x.split("=")[0], flags, n=1)]
        command.error(f"unrecognized arguments: {' '.join(extra)}" + (f" (did you mean {', '.join(near)}?)"
                                                                       if near else ""))
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        if pipeline.launched() and args.command not in ("generate", "chat", "bench", "serve"):
            raise SpecterError(f"under torchrun only `generate`, `chat`, `bench` and `serve` run as a pipeline today, not "
                               f"`{args.command}`; "
                               "run it as one process")
        with warnings.catch_warnings():
            warnings.showwarning = _one_line
            return args.func(args)
    except SpecterError as e:
        print(f"specter: error: {pipeline.rank_prefixed(str(e))}", file=sys.stderr)
        if pipeline.launched():  # a failed rank leaves its process group as it is (a peer may be gone),
            try:                 # and tearing that down at interpreter exit can abort the process (SIGABRT,
                sys.stdout.flush()  # "terminate called without an active exception") instead of exiting 2
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            os._exit(2)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)  # the shell's prompt on a line of its own, not after half a reply
        return 130
    except BrokenPipeError:  # the reader left (`specter generate ... | head -2`): stop quietly, like any filter
        _stdout_to_devnull()
        return 141  # 128 + SIGPIPE, what a shell reports for a filter stopped by a closed pipe
    except OSError as e:
        if e.errno not in _FULL:
            raise
        print(f"specter: error: could not write {e.filename or 'the output'}: {e.strerror}", file=sys.stderr)
        _stdout_to_devnull()
        return 1


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk or quota: `specter generate > file` on one


def _stdout_to_devnull() -> None:
    """Keeps Python's final flush of stdout from failing again at exit, after the reader left or the disk filled."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
