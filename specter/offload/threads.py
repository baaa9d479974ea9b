"""The offload threads, closed before the interpreter finalizes.

Links, the stager and the host lane each run a daemon thread that calls torch ops. A daemon thread
still inside one when Python finalizes is ended as it takes the GIL back, by a forced unwind that
aborts the process in C++ ("terminate called without an active exception", exit status 134): a
script that returned without `engine.close()` while a prefetch was in flight crashed. atexit
handlers run before that point, so every owner started here is closed then (its queued work
completes without sleeping out emulated time, and its thread is joined).
"""
from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import weakref

import torch

_OPEN: weakref.WeakSet = weakref.WeakSet()  # owners whose thread may still run; close() is idempotent


def close_at_exit(owner) -> None:
    """`owner.close()` (idempotent; it stops and joins a thread of its own) runs at exit, unless the owner
    was collected before."""
    _OPEN.add(owner)


def daemon(run, name: str, owner) -> threading.Thread:
    """Starts `run` on a daemon thread named `name`; `owner.close()` stops it, and runs at exit."""
    close_at_exit(owner)
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None  # the creator's

    def body() -> None:
        if device is not None:
            torch.cuda.set_device(device)
        run()

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    return thread


def cuda_device(device: torch.device):
    """A context in which `device` is the calling thread's current CUDA device (what Triton launches on
    and `torch.cuda.current_stream()` means); nothing to do for the CPU or a bare "cuda" (the current one)."""
    if device.type == "cuda" and device.index is not None:
        return torch.cuda.device(device)
    return contextlib.nullcontext()


@atexit.register
def _close_at_exit() -> None:
    for owner in sorted(list(_OPEN), key=lambda o: not getattr(o, "CLOSE_FIRST", False)):  # generations first
        try:
            owner.close()
        except Exception as e:  # noqa: BLE001 -- at exit: say so, and close the others
            print(f"specter: closing {type(owner).__name__} at exit failed: {e!r}", file=sys.stderr)
