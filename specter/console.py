"""The `specter` console script (and `python -m specter`): the command line, with a Ctrl-C during its
imports (torch's take seconds, most of a short run) ending it as one during a run does: status 130,
no traceback. `import specter` itself imports no torch, so the interrupt lands here."""
from __future__ import annotations

import sys


def main() -> int:
    try:
        from .cli import main as run
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return run()
