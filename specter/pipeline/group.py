"""The process group a pipeline runs over, and how its failures surface.

`join` uses the group torch.distributed already has, or initialises one from torchrun's
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK). Backend: NCCL when the
ranks compute on CUDA devices, gloo otherwise (CPU, or machines without NCCL); `backend` overrides.
Every collective and every point-to-point receive is bounded by `timeout` (joining, comparing the
checkpoints and loading by at least STARTUP_TIMEOUT_S: ranks start and load at their own pace, and a
load slower than a short `timeout` is no failure): a rank that died closes its connections (gloo reports it at once), a rank that hangs is given up on after the timeout, and
either way `comm` turns the backend's error into a PipelineError naming this rank and the peer,
which the launcher prints before exiting non-zero, on every rank.
"""
from __future__ import annotations

import os
import pickle
import re
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import SpecterError

DEFAULT_TIMEOUT_S = 600.0  # a receive may wait this long for a slower rank (its load, a long prefill)
STARTUP_TIMEOUT_S = 600.0  # joining, comparing and loading wait at least this long: ranks start at their own pace
BACKENDS = ("gloo", "nccl")


class PipelineError(SpecterError):
    """A pipeline that cannot go on: a rank died or timed out, or the ranks disagree."""


@dataclass
class Group:
    rank: int
    world: int
    backend: str
    timeout_s: float
    device: torch.device        # where this rank computes
    owned: bool                 # this module initialised the group (and destroys it)
    startup: object = None      # a gloo group for the startup exchanges (they wait startup_s)
    startup_s: float = STARTUP_TIMEOUT_S

    @property
    def wire(self) -> torch.device:
        """Where tensors must be to cross: the compute device under NCCL, the CPU under gloo."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def end_startup(self) -> None:
        """Destroys the startup group once every rank has loaded: its threads and sockets go now, not
        with the process (`specter bench` opens a pipeline a policy)."""
        if self.startup is not None and dist.is_initialized():
            dist.destroy_process_group(self.startup)
        self.startup = None

    def close(self) -> None:
        """Leaves the group (destroys it if this module made it)."""
        self.end_startup()
        if self.owned and dist.is_initialized():
            dist.destroy_process_group()

    def close_on_error(self) -> None:
        """After a failure: the group is left as it is (a destroy could wait on a peer that is gone);
        the process exits next."""


def env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise PipelineError(f"${name} is not set: launch with torchrun (torchrun --nproc-per-node N -m specter "
                                "...) or initialise torch.distributed first")
        return default
    try:
        return int(value)
    except ValueError:
        raise PipelineError(f"${name}={value!r} is not an integer") from None


def rank_device(requested: str | None) -> torch.device:
    """This rank's compute device: "auto"/None -> cuda:LOCAL_RANK (modulo the devices) when CUDA is
    available, else the CPU; "cuda" -> cuda:LOCAL_RANK; anything else as given."""
    requested = requested or "auto"
    if requested in ("auto", "cuda"):
        if torch.cuda.is_available():
            return torch.device("cuda", env_int("LOCAL_RANK", 0) % torch.cuda.device_count())
        if requested == "cuda":
            raise PipelineError("--device cuda was asked for, but CUDA is not available on this rank")
        return torch.device("cpu")
    return torch.device(requested)


def choose_backend(device: torch.device, backend: str | None) -> str:
    if backend is None:
        return "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"
    if backend not in BACKENDS:
        raise PipelineError(f"--pipeline-backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "nccl" and device.type != "cuda":
        raise PipelineError("the nccl backend moves CUDA tensors; this rank computes on the CPU: use "
                            "--pipeline-backend gloo (or --device cuda)")
    if not (dist.is_nccl_available() if backend == "nccl" else dist.is_gloo_available()):
        raise PipelineError(f"this torch build has no {backend} backend")
    return backend


def join(device: str | torch.device | None = None, backend: str | None = None,
         timeout_s: float | None = None) -> Group:
    """This process's place in the pipeline's group (initialised here from torchrun's environment
    unless torch.distributed already is)."""
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
    if not timeout_s > 0:
        raise PipelineError(f"--pipeline-timeout must be > 0 seconds, got {timeout_s}")
    dev = device if isinstance(device, torch.device) else rank_device(device)
    startup_s = max(timeout_s, STARTUP_TIMEOUT_S)
    startup = timedelta(seconds=startup_s)
    if dist.is_initialized():  # e.g. `specter bench` loading its next policy
        have = dist.get_backend()
        if backend is not None and backend != have:
            raise PipelineError(f"torch.distributed is already initialised with {have}, not {backend}")
        return Group(dist.get_rank(), dist.get_world_size(), have, timeout_s, dev, owned=False,
                     startup=dist.new_group(backend="gloo", timeout=startup), startup_s=startup_s)
    chosen = choose_backend(dev, backend)
    rank, world = env_int("RANK"), env_int("WORLD_SIZE")
    env_int("MASTER_PORT")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    try:  # the rendezvous waits for a late rank as long as startup; every exchange after it, timeout_s
        store, rank, world = next(dist.rendezvous("env://", rank, world, timeout=startup))
        dist.init_process_group(chosen, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s), **({"device_id": dev} if chosen == "nccl" else {}))
        startup_group = dist.new_group(backend="gloo", timeout=startup)
    except Exception as e:  # noqa: BLE001 -- the rendezvous failed or timed out: say which rank and why
        raise PipelineError(f"rank {rank} of {world}: could not join the process group within {startup_s:g} s "
                            f"({type(e).__name__}: {first_line(e)})") from None
    return Group(rank, world, chosen, timeout_s, dev, owned=True, startup=startup_group, startup_s=startup_s)


def first_line(e: BaseException) -> str:
    """The error's first line, without the backend's source location ("[.../pair.cc:553] ") or gloo's advice
    after it ("This is typically caused by a remote worker crashing. ... GLHF!")."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip())
    return text.splitlines()[0].split(" This is typically caused by")[0] if text else type(e).__name__


@contextmanager
def comm(group: Group, what: str):
    """Runs one exchange; a backend failure becomes a PipelineError saying which rank saw what."""
    try:
        yield
    except PipelineError:
        raise
    except (RuntimeError, ValueError, OSError) as e:  # DistBackendError, gloo's connection errors
        text = first_line(e)
        hint = ("timed out" if "timeout" in text.lower() or "timed out" in text.lower()
                else "a peer rank closed its connection or failed")
        raise PipelineError(f"rank {group.rank} of {group.world}: {what} failed: {hint} ({text}); the pipeline "
                            f"is broken (timeouts: {group.timeout_s:g} s, {group.startup_s:g} s while starting)") from None


def send_object(obj, dst: int, device: torch.device, pg=None) -> None:
    """`obj`, pickled, to rank `dst` (its length first), on this thread (`all_gather_objects` says why)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64, device=device), dst, group=pg)
    dist.send(data, dst, group=pg)


def recv_object(src: int, device: torch.device, pg=None):
    """What rank `src`'s send_object sent."""
    n = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(n, src, group=pg)
    data = torch.empty(int(n), dtype=torch.uint8, device=device)
    dist.recv(data, src, group=pg)
    return pickle.loads(data.cpu().numpy().tobytes())


def all_gather_objects(group: Group, obj) -> list:
    """Every rank's `obj` on every rank, in rank order, over the startup group: rank 0 receives each
    rank's, then sends each the list. Point to point, not all_gather_object: gloo runs a collective on
    the process group's worker thread, which frees the collective's tensors after the caller returned,
    taking the GIL to do it; when the process exits first (a rank that fails right after, or rank 0
    after its last gather) the thread is ended inside C++ and the process aborts ("terminate called
    without an active exception", exit status 134; docs/RESULTS.md). A send or receive completes on the
    calling thread."""
    pg, cpu = group.startup, torch.device("cpu")
    if group.rank != 0:
        send_object(obj, 0, cpu, pg)
        return recv_object(0, cpu, pg)
    got = [obj] + [recv_object(r, cpu, pg) for r in range(1, group.world)]
    for r in range(1, group.world):
        send_object(got, r, cpu, pg)
    return got
