"""How many of a policy's hosted misses had no slot to copy into (issue 24: why a coded store, which only
cheapens copies, barely speeds specter up at 1/4 residency).

LaneChoice (offload/host_lane.py) copies at most the room a layer has (its quota less the experts the
call holds) and ranks the rest by cost; a miss beyond that room is hosted whatever a copy costs. This
wraps LaneChoice and counts, over one `specter bench` run per store, the misses it was offered, those it
hosted, and those beyond the room.

    SPECTER_EXPERT_THROUGHPUT=1e10 python bench/experiments/slot_bound.py [--expert-memory 9MiB] [bench args]

One JSON line a store (raw, then coded): calls, missing, hosted, no_room, and the run's TPOT.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys

from specter.cli import main as cli
from specter.offload import host_lane


def counted_run(args: list[str]) -> dict:
    counts = dict(calls=0, missing=0, hosted=0, no_room=0)
    real = host_lane.LaneChoice.__call__

    def choose(self, layer, missing, routed):
        room = self.room(layer, missing, set(routed))  # before the call: it may start copies
        hosted = real(self, layer, missing, routed)
        counts["calls"] += 1
        counts["missing"] += len(missing)
        counts["hosted"] += len(hosted)
        counts["no_room"] += len(missing) - room
        return hosted

    host_lane.LaneChoice.__call__ = choose
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            cli(["bench", "--json"] + args)
    finally:
        host_lane.LaneChoice.__call__ = real
    (policy, stats), = json.loads(out.getvalue())["policies"].items()
    return dict(policy=policy, **counts, tpot_ms=round(stats["tpot_s"] * 1e3, 2), host_experts=stats["host_experts"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False, epilog="Every other argument goes to `specter bench`.")
    # --help answered here: bench's own would print into counted_run's redirect and be lost
    _, argv = ap.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    args = ["--device", "cpu", "--policies", "specter"] + (argv or ["--expert-memory", "9MiB"])
    for store, extra in (("raw", []), ("coded", ["--compress-experts"])):
        print(json.dumps(dict(store=store, **counted_run(args + extra))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
