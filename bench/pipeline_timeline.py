"""Where a pipelined run's time goes, per rank: a timeline of every rank's main thread (draft steps,
pre-draft steps, its stage's target steps, blocked receives and sends, planning), its link (copies
in flight), its host lane (experts computed on the host) and the stalls inside its stage, recorded
by patching those methods at run time (nothing in specter/ changes), then summarised.

    # record (one process, or each rank under torchrun); the rest of the line is `specter`'s
    python bench/pipeline_timeline.py record OUT -- bench --policies specter --expert-memory 9MiB --device cpu --json
    python -m torch.distributed.run --nproc-per-node 2 bench/pipeline_timeline.py record OUT -- bench ...
    python bench/pipeline_timeline.py report OUT [OUT2 ...]
    TIMELINE_SET=specter.pipeline.optimistic:OptimisticCycles.exposed_draft=0 python ... record ...  # A/B a class attribute
    FIXED_K=6 python ... record ...  # every cycle's K fixed

Only the generations' windows count (rank 0's BEGIN to END under torchrun, its decoder's run in one
process; the bench's warm-up generation included). `report` prints, per token, each rank's time by
activity (exclusive: a stall inside a stage step counts as stall, not step), the time its main
thread was in none of them (Python between them, acceptance), how busy its link and host lane
were, and (torchrun) what rank 0 was doing while each later rank waited for its next message.
With two ranks it also splits rank 0's draft steps by whether a later rank computed beside them (the
two cores' contention on the rank that drafts).
Clocks: time.perf_counter, CLOCK_MONOTONIC on Linux, so the ranks' timelines line up.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EVENTS: list = []  # (lane, name, t0, t1)
WINDOWS: list = []  # (t0, t1) of each generation
_local = threading.local()


def _span(lane: str, name: str, fn):
    """fn's call recorded as `name` on `lane` (main: the thread's stack; an inner span's time is its own)."""
    def wrapped(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            EVENTS.append((lane, name(a) if callable(name) else name, t0, time.perf_counter()))
    return wrapped


def record(out: Path, argv: list[str]) -> int:
    import specter.pipeline.decoder as pdec
    import specter.pipeline.speculative as pspec
    import specter.pipeline.stage as pstage
    from specter.offload import host_lane, link
    from specter.speculative import decoder as sdec, draft

    rank = int(os.environ.get("RANK", "0"))
    pre = {"on": False}

    def draft_name(_a):
        return "pre-draft" if pre["on"] else "draft"

    forward = _span("main", "stage", pstage.StageModel.forward)

    def stage_forward(self, x, *a, **k):  # also its width (T) on a lane of its own
        t0 = time.perf_counter()
        try:
            return forward(self, x, *a, **k)
        finally:
            EVENTS.append(("T", str(x.shape[0]), t0, time.perf_counter()))
    pstage.StageModel.forward = stage_forward
    for spec in filter(None, os.environ.get("TIMELINE_SET", "").split(",")):  # A/B: module:Class.attr=value
        where, value = spec.split("=")
        mod, attr = where.split(":")
        cls, name = attr.rsplit(".", 1)
        import importlib
        setattr(getattr(importlib.import_module(mod), cls), name, type(getattr(getattr(importlib.import_module(mod), cls), name))(float(value)))
    pstage.StageModel.draft_forward = _span("main", draft_name, pstage.StageModel.draft_forward)
    orig_pre = pspec.PipelineSpeculativeDecoder._pre_draft

    def pre_draft(self, *a, **k):
        pre["on"] = True
        try:
            return orig_pre(self, *a, **k)
        finally:
            pre["on"] = False
    pspec.PipelineSpeculativeDecoder._pre_draft = pre_draft
    orig_do = pdec.Wire._do

    def do(self, what, fn):
        t0 = time.perf_counter()
        try:
            return orig_do(self, what, fn)
        finally:
            t1 = time.perf_counter()
            kind = ("recv-next" if what.startswith("waiting for") else "recv" if what.startswith("receiving")
                    else "gather" if what.startswith("gathering") else "send")
            if kind == "send" and "isend" in getattr(getattr(fn, "__code__", None), "co_names", ()):
                kind = "isend"
            EVENTS.append(("main", kind, t0, t1))
            if rank == 0 and kind == "send" and "'begin'" in what:
                WINDOWS.append([t1, None])
            if rank == 0 and kind == "gather":
                WINDOWS[-1][1] = t0
    pdec.Wire._do = do
    draft.PrefetchPlanner.plan = _span("main", "plan", draft.PrefetchPlanner.plan)
    draft.PrefetchPlanner.begin_cycle = _span("mark", "begin cycle", draft.PrefetchPlanner.begin_cycle)
    # one process: its decoder's draft steps and verification
    orig_draft = sdec.SpeculativeDecoder._draft
    sdec.SpeculativeDecoder._draft = _span("main", "draft", orig_draft)
    # a cycle less its draft (and the stalls inside) is its verification, as "stage"
    sdec.SpeculativeDecoder._cycle = _span("main", "stage", sdec.SpeculativeDecoder._cycle)
    orig_run = sdec.SpeculativeDecoder.run
    orig_plain = sdec.plain_steps

    def plain(*a, **k):  # K = 0 steps: target steps
        it = orig_plain(*a, **k)
        while True:
            t0 = time.perf_counter()
            try:
                v = next(it)
            except StopIteration:
                return
            EVENTS.append(("main", "stage", t0, time.perf_counter()))
            yield v
    sdec.plain_steps = plain

    def run(self, *a, **k):
        if type(self) is not sdec.SpeculativeDecoder:
            yield from orig_run(self, *a, **k)
            return
        w = [time.perf_counter(), None]
        WINDOWS.append(w)
        try:
            yield from orig_run(self, *a, **k)
        finally:
            w[1] = time.perf_counter()
    sdec.SpeculativeDecoder.run = run
    orig_wait = link.Transfer.wait

    def wait(self):
        t0 = time.perf_counter()
        s = orig_wait(self)
        if s > 0:
            EVENTS.append(("main", "host-stall" if isinstance(self, host_lane.HostJob) else "stall", t0,
                           time.perf_counter()))
        return s
    link.Transfer.wait = wait
    orig_complete = link.Link._complete

    def complete(self, t, busy_s, error=None):
        EVENTS.append(("link", "copy", t.t_started or t.t_enqueued, time.perf_counter()))
        return orig_complete(self, t, busy_s, error)
    link.Link._complete = complete
    host_lane.HostLane._compute = _span("host", "host compute", host_lane.HostLane._compute)

    if os.environ.get("FIXED_K"):  # every cycle's K fixed (the governor's choices aside)
        from specter.speculative import governor
        init, fixed = governor.Governor.__init__, int(os.environ["FIXED_K"])
        governor.Governor.__init__ = lambda self, k_max, **kw: init(self, k_max, **dict(kw, fixed=fixed))
    from specter.cli import main
    try:
        return main(argv)
    finally:
        out.mkdir(parents=True, exist_ok=True)
        w = [x for x in WINDOWS if x[1] is not None]
        json.dump(dict(rank=rank, windows=w, events=EVENTS), open(out / f"rank{rank}.json", "w"))


MAIN = ("pre-draft", "draft", "stage", "stall", "host-stall", "plan", "recv-next", "recv", "send", "isend", "gather")


def _exclusive(events):
    """Main-thread events -> {name: seconds} exclusive of the events nested inside each."""
    ev = sorted(((t0, -t1, n) for lane, n, t0, t1 in events if lane == "main"))
    out, stack = defaultdict(float), []  # stack of [t1, name, child_s]
    pieces = []  # (t0, t1, name) exclusive pieces, for overlaps

    def pop_until(t):
        while stack and stack[-1][0] <= t:
            end, name, start, cursor = stack.pop()
            pieces.append((cursor, end, name))
            if stack:
                stack[-1][3] = end
    for t0, neg1, name in ev:
        t1 = -neg1
        pop_until(t0)
        if stack:
            pieces.append((stack[-1][3], t0, stack[-1][1]))
        stack.append([t1, name, t0, t0])
    pop_until(float("inf"))
    for a, b, n in pieces:
        out[n] += max(0.0, b - a)
    return out, pieces


def _clip(a, b, windows):
    return sum(max(0.0, min(b, w1) - max(a, w0)) for w0, w1 in windows)


def report(dirs: list[str]) -> None:
    for d in dirs:
        ranks = [json.load(open(p)) for p in sorted(Path(d).glob("rank*.json"))]
        windows = ranks[0]["windows"][1:]  # less the bench's warm-up generation
        wall = sum(b - a for a, b in windows)
        bench = Path(d) / "bench.json"  # the bench's --json output, if saved there: its tokens
        tokens = sum(p["new_tokens"] for p in json.load(open(bench))["policies"].values()) if bench.exists() else None
        print(f"{d}: {len(ranks)} rank(s), {len(windows)} generations, {wall * 1e3:.0f} ms in them"
              + (f", {tokens} tokens" if tokens else ""))
        per = (lambda s: f"{s / tokens * 1e3:.2f}") if tokens else (lambda s: f"{s * 1e3:.0f}")
        unit = "ms a token" if tokens else "ms in all"
        pieces_of = {}
        for r in ranks:
            ex, pieces = _exclusive([e for e in r["events"]])
            pieces = [(a, b, n) for a, b, n in pieces if _clip(a, b, windows) > 0]
            pieces_of[r["rank"]] = pieces
            got = {n: sum(_clip(a, b, windows) for a, b, m in pieces if m == n) for n in MAIN}
            busy = sum(got.values())
            link_s = sum(_clip(a, b, windows) for lane, n, a, b in r["events"] if lane == "link")
            host_s = sum(_clip(a, b, windows) for lane, n, a, b in r["events"] if lane == "host")
            cols = ", ".join(f"{n} {per(v)}" for n, v in got.items() if v > 0)
            print(f"  rank {r['rank']} ({unit}): {cols}, in none of these {per(wall - busy)}; "
                  f"link busy {per(link_s)} ({link_s / wall:.0%}), host lane computing {per(host_s)}")
        for r in ranks:  # each verification's stall by its lead: since its planner's cycle began
            begins = sorted(a for lane, n, a, b in r["events"] if lane == "mark")
            stalls = [(a, b) for a, b, n in pieces_of[r["rank"]] if n in ("stall", "host-stall")]
            buckets = defaultdict(lambda: [0, 0.0])
            for lane, n, a, b in r["events"]:  # verifications only (T > 1; prefill and K = 0 steps aside)
                if lane != "T" or int(n) < 2 or int(n) > 33 or not _clip(a, b, windows) or not begins:
                    continue
                before = [x for x in begins if x <= a]
                lead = (a - before[-1]) * 1e3 if before else None
                key = "no cycle" if lead is None else "< 3 ms" if lead < 3 else "3-10 ms" if lead < 10 else ">= 10 ms"
                buckets[key][0] += 1
                buckets[key][1] += sum(max(0.0, min(b, y) - max(a, x)) for x, y in stalls)
            if begins:
                print(f"  rank {r['rank']} target steps by lead since its planner's cycle began: " + ", ".join(
                    f"{k}: {v[0]} steps, stall {v[1] / max(1, v[0]) * 1e3:.1f} ms each" for k, v in sorted(buckets.items())))
        if len(ranks) > 1:  # what rank 0 did while each later rank waited for its next message
            zero = pieces_of[0]
            for r in ranks[1:]:
                by = defaultdict(float)
                for a, b, n in pieces_of[r["rank"]]:
                    if n != "recv-next":
                        continue
                    covered = 0.0
                    for c, e, m in zero:
                        o = _clip(max(a, c), min(b, e), windows) if min(b, e) > max(a, c) else 0.0
                        if o:
                            by[m] += o
                            covered += o
                    by["(rank 0 between)"] += max(0.0, _clip(a, b, windows) - covered)
                cols = ", ".join(f"{n} {per(v)}" for n, v in sorted(by.items(), key=lambda x: -x[1]) if v > 1e-4)
                print(f"  rank {r['rank']} waiting for its next message, by rank 0's activity ({unit}): {cols}")
            # the two cores' contention on rank 0's draft steps: each step by how much of it a later rank
            # computed through (its stage less the stalls, or planning), against the steps none did
            busy = sorted((a, b) for r in ranks[1:] for a, b, n in pieces_of[r["rank"]] if n in ("stage", "plan"))
            by = {"alone": [], "beside": []}
            for lane, n, a, b in ranks[0]["events"]:
                if lane != "main" or n not in ("draft", "pre-draft") or not _clip(a, b, windows):
                    continue
                o = sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy if x < b and y > a) / max(b - a, 1e-9)
                if o < 0.1 or o > 0.9:
                    by["alone" if o < 0.1 else "beside"].append(b - a)
            mine = sorted((a, b) for a, b, n in pieces_of[0] if n in ("draft", "pre-draft", "stage", "plan"))
            both, j = 0.0, 0  # time rank 0 and a later rank both computed (two intervals lists, sorted)
            for a, b in mine:
                while j < len(busy) and busy[j][1] <= a:
                    j += 1
                i = j
                while i < len(busy) and busy[i][0] < b:
                    both += _clip(max(a, busy[i][0]), min(b, busy[i][1]), windows)
                    i += 1
            print(f"  rank 0 computing while a later rank computed too: {per(both)} {unit}")
            if by["alone"] and by["beside"]:
                m = {k: sum(v) / len(v) for k, v in by.items()}
                excess = (m["beside"] - m["alone"]) * len(by["beside"])
                print(f"  rank 0's draft steps: {len(by['alone'])} while no later rank computed, {m['alone'] * 1e3:.2f} ms "
                      f"each; {len(by['beside'])} while one computed throughout, {m['beside'] * 1e3:.2f} ms each "
                      f"({excess / tokens * 1e3 if tokens else excess * 1e3:.2f} {unit} more; the rest in between)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", metavar="{record,report}", required=True)
    rec = sub.add_parser("record", help="run `specter ARGS...` (after --), writing OUT/rankN.json")
    rec.add_argument("out", metavar="OUT")
    sub.add_parser("report", help="summarise recorded OUT folders").add_argument("dirs", nargs="+", metavar="OUT")
    argv = sys.argv[1:]
    i = argv.index("--") if "--" in argv else len(argv)  # split by hand: specter's own options follow --
    args = ap.parse_args(argv[:i])
    if args.cmd == "record":
        if i == len(argv):
            ap.error("record: give specter's command after --, e.g. record OUT -- bench --json")
        sys.exit(record(Path(args.out), argv[i + 1:]))
    report(args.dirs)
