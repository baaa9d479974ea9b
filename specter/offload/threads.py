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
import sys
import threading
import weakref

_OPEN: weakref.WeakSet = weakref.WeakSet()  # owners whose thread may still run; close() is idempotent


def daemon(run, name: str, owner) -> threading.Thread:
    """Starts `run` on a daemon thread named `name`; `owner.close()` stops it, and runs at exit."""
    _OPEN.add(owner)
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


@atexit.register
def _close_at_exit() -> None:
    for owner in list(_OPEN):
        try:
            owner.close()
        except Exception as e:  # noqa: BLE001 -- at exit: say so, and close the others
            print(f"specter: closing {type(owner).__name__} at exit failed: {e!r}", file=sys.stderr)
