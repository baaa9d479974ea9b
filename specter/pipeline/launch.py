"""`torchrun --nproc-per-node N -m specter generate ...`: one rank's whole run.

Every rank joins the group, computes the same stages, checks that every rank loaded the same
checkpoint with the same options (a mismatch is an error on every rank), and loads its stage. Rank
0 then builds an Engine whose decoder is the pipeline and hands it to the command's body (which
prints, once); the other ranks serve their stage until rank 0 is done. An error on any rank ends
every rank with a PipelineError (exit status 2 from the CLI), never a hang: rank 0 tells the others
when it fails, and a rank that dies or stalls is detected by the others' connections or timeouts.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from ..errors import ConfigError, SpecterError
from ..policy import get as get_policy
from .group import Group, PipelineError, join
from .stages import agree, fingerprint, make_stages

PIPELINED_POLICIES = ("resident", "on-demand", "next-layer", "host", "spec-lru", "specter")
UNSUPPORTED = ("k_max", "compile")
# --draft-cache is read by rank 0 alone, as one process reads it (load_stage); the other ranks hold no draft


def check_options(policy: str, options: dict) -> None:
    pol = get_policy(policy)
    if policy not in PIPELINED_POLICIES:
        raise ConfigError(f"policy {policy!r} is not pipelined; under torchrun use --policy "
                          f"{' or '.join(PIPELINED_POLICIES)}")
    extra = sorted(k for k in options if k in UNSUPPORTED and not (k == "k_max" and pol.drafts))
    if extra:
        flags = ", ".join("--" + k.replace("_", "-") for k in extra)
        why = {"k_max": f"policy {policy!r} drafts nothing (--k-max is read by spec-lru and specter)",
               "compile": "the compiled draft and verify steps run one process's whole model, and a pipeline's "
                          "stages run eagerly (not pipelined yet; run one process to compile)"}
        raise ConfigError(f"{flags} {'does' if len(extra) == 1 else 'do'} not apply to a pipeline of {policy!r}: "
                          + "; ".join(why.get(k, "not pipelined yet") for k in extra) + "; drop it")


def refuse_ignored(args, policies: list[str]) -> None:
    """A flag none of `policies` reads (--compress-experts for resident, ...) refused as one process refuses it
    (cli.options.refuse_unused_flags); --k-max and --compile: check_options, with a pipeline's own reasons."""
    from ..cli.options import FLAG_USERS, refuse_unused_flags  # (the CLI imports this package)

    refuse_unused_flags(args, policies, [f for f in FLAG_USERS if f[1] not in UNSUPPORTED])


def open_pipeline(model=None, *, device=None, policy: str = "on-demand", residency=None, expert_memory=None,
                  device_memory=None, link=None, dtype=None, backend: str | None = None, timeout_s: float | None = None,
                  threads: int | None = None, k_max: int | None = None, draft_cache=None,
                  host_threads: int | None = None, draft_bits: int = 4, compress_experts: bool = False,
                  context: int | None = None):
    """(group, rank 0's Engine or None, this rank's stage): joins the group (torchrun's environment, or
    the one torch.distributed already has) and loads this rank's stage. Every rank calls it with the
    same arguments; a byte budget (`expert_memory`, `device_memory`) is each rank's own (load_stage).
    Rank 0 generates with the Engine, then calls engine.decoder.finish(); the others call
    decoder.serve_stage(stage, group), which returns when rank 0 finishes. `threads` (CPU): torch
    threads per rank (default: the cores less one, shared among this machine's ranks). `k_max`: the
    longest draft (drafting policies; default 32). `draft_cache`: rank 0's INT4 draft cache, as one
    process's (None: $SPECTER_DRAFT_CACHE or the user cache; "off": none); the other ranks never use it.
    `host_threads` (policies host and specter): each rank's host lane's threads, as one process's.
    `draft_bits` (drafting policies): the width of rank 0's draft experts (4, 3 or 2), as one process's.
    `compress_experts`: each rank holds its own layers' experts losslessly coded, as one process's store.
    `context`: the most tokens a generation holds, and what each rank's KV cache is planned for, as one
    process's (None: the model's)."""
    from ..engine import Engine
    from ..generation_defaults import read_generation_defaults
    from .. import default_model_path
    from ..loader import open_checkpoint
    from ..offload.plan import check_context, compute_dtype

    from .decoder import PipelineDecoder
    from .group import all_gather_objects, comm
    from .speculative import PipelineSpeculativeDecoder
    from .load import load_stage

    pol = get_policy(policy)
    if k_max is None:
        k_max = 32
    if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 0:
        raise ConfigError(f"k_max must be an integer >= 0 (0 = no speculation), got {k_max!r}")
    group = join(device, backend, timeout_s)
    try:
        path = Path(model) if model is not None else default_model_path()
        ckpt = open_checkpoint(path)
        context = check_context(context, ckpt.spec)
        stages = make_stages(ckpt.spec, group.world, ckpt.dtype.itemsize, pol.makes_draft(k_max), draft_bits)
        options = dict(policy=policy, residency=residency, expert_memory=expert_memory,
                       device_memory=device_memory, link=link,
                       dtype=str(compute_dtype(group.device, ckpt.dtype, dtype)), world=group.world,
                       backend=group.backend, device_type=group.device.type,
                       k_max=k_max if pol.drafts else None, host_threads=host_threads, draft_bits=draft_bits,
                       compress_experts=compress_experts, context=context, timeout_s=group.timeout_s)
        agree(group, {"fingerprint": fingerprint(ckpt, {}), "options": options,  # (the options: named apart)
                      "layers": [[s.first, s.last] for s in stages]}, names=AGREED_NAMES, derived=("layers",))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", group.world))
        if threads is None and group.device.type == "cpu":
            threads = max(1, ((os.cpu_count() or 2) - 1) // max(local, 1))
        stage = load_stage(path, stages[group.rank], group.device, policy=policy, residency=residency,
                           expert_memory=expert_memory, device_memory=device_memory, link=link, dtype=dtype,
                           threads=threads, k_max=k_max, draft_cache=draft_cache, host_threads=host_threads,
                           draft_bits=draft_bits, compress_experts=compress_experts, context=context)
        # every rank loaded (so no rank's first step waits on a load), and whether any ever copies (the
        # decoder's K = 0 steps guess only then)
        with comm(group, "waiting for every rank to load its layers"):
            resident = all_gather_objects(group, stage.all_resident)
        group.end_startup()
    except BaseException:
        group.close_on_error()
        raise
    if group.rank != 0:
        return group, None, stage
    if pol.drafts:
        decoder = PipelineSpeculativeDecoder(stage, group, stages, planner=pol.prefetch == "planner", k_max=k_max,
                                             all_resident=all(resident))
    else:
        decoder = PipelineDecoder(stage, group, stages)
    engine = Engine(stage.model, [], stage.tokenizer, path=path, device=group.device, dtype=stage.dtype,
                    policy=policy, decoder=decoder, generation_defaults=read_generation_defaults(path),
                    plan=stage.plan, context=context)
    return group, engine, stage


# what agree() names when ranks differ: the flags a user gave (or the checkpoint), not the keys compared
AGREED_NAMES = {"fingerprint": "the checkpoint", "layers": "the layer split (SPECTER_PIPELINE_LAYERS)",
                "options world": "the number of ranks", "options backend": "--pipeline-backend",
                "options device_type": "--device", "options timeout_s": "--pipeline-timeout",
                **{f"options {k}": f"--{k.replace('_', '-')}" for k in (
                    "policy", "residency", "expert_memory", "device_memory", "link", "dtype", "k_max",
                    "host_threads", "draft_bits", "compress_experts", "context")}}


def run(args, body, serving: bool = False, waits: bool = False) -> int:
    """The CLI's pipelined command: rank 0 runs body(engine) (which closes the engine); the others serve.
    A failure on any rank raises a PipelineError (or the user's error on rank 0) on every rank.
    `serving`: body waits for requests (`specter serve`): rank 0 keeps the other ranks' waits alive
    meanwhile (decoder.keep_alive), and a pipeline that broke while it served ends it with that error;
    the other ranks leave a signal to rank 0's server. `waits`: body waits for its user (`specter
    chat`), with the waits kept alive as a server's; a signal ends each rank as usual."""
    from contextlib import nullcontext

    from .decoder import after_interrupt, keep_alive, serve_stage

    from ..cli.options import refuse_unused_draft_flags

    opts = {k: v for k, v in vars(args).items() if k in UNSUPPORTED and v is not None and v is not False}  # (0 kept)
    check_options(args.policy, opts)
    refuse_ignored(args, [args.policy])
    refuse_unused_draft_flags(args, args.policy)  # as one process refuses them
    with ranked(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))):
        group, engine, stage = open_pipeline(args.model, device=args.device, policy=args.policy,
                                             residency=args.residency, expert_memory=args.expert_memory,
                                             device_memory=args.device_memory,
                                             link=args.link, dtype=args.dtype, backend=args.pipeline_backend,
                                             timeout_s=args.pipeline_timeout, k_max=args.k_max,
                                             draft_cache=getattr(args, "draft_cache", None),
                                             host_threads=getattr(args, "host_threads", None),
                                             draft_bits=getattr(args, "draft_bits", None) or 4,
                                             compress_experts=bool(getattr(args, "compress_experts", False)),
                                             context=getattr(args, "context", None))
    ok = False
    try:
        if engine is None:
            if serving:  # a signal to the whole group (Ctrl-C, torchrun's SIGTERM) drains rank 0's server,
                import signal  # which then stops this rank: not stopped here under a running generation

                for sig in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(sig, signal.SIG_IGN)
            serve_stage(stage, group)
            ok = True
            return 0
        try:
            with keep_alive(engine.decoder) if serving or waits else nullcontext():
                code = body(engine)
        except BaseException as e:
            interrupted = isinstance(e, KeyboardInterrupt)
            with after_interrupt(interrupted):
                engine.decoder.finish(abort=True, interrupted=interrupted)  # the other ranks stop with an error too
            raise
        engine.decoder.finish()
        if engine.decoder.broken:  # a server answered 503 since; its exit says why
            raise PipelineError(engine.decoder.broken)
        ok = True
        return code
    except SpecterError:
        with ranked(group.rank, group.world):
            raise
    finally:
        group.close() if ok else group.close_on_error()


@contextmanager
def ranked(rank: int, world: int):
    """A user error on a rank other than 0 is a PipelineError (rank 0's, and a broken pipeline's, as they
    are); the CLI prints every rank's error and warning with its rank (pipeline.rank_prefixed)."""
    try:
        yield
    except SpecterError as e:
        if isinstance(e, PipelineError) or rank == 0:
            raise
        raise PipelineError(str(e)) from None
