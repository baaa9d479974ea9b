"""What the governor is told each cycle, what K it picks and what each K realises, on one rank or
under torchrun (rank 0's decoder), recorded by patching at run time (nothing in specter/ changes).

    python bench/pipeline_governor.py record OUT -- bench --policies specter --expert-memory 9MiB --device cpu --json
    python -m torch.distributed.run --nproc-per-node 2 bench/pipeline_governor.py record OUT -- bench ...
    python bench/pipeline_governor.py report OUT [OUT2 ...] [--seq]
    FIXED_K=10 python ... record ...  # every cycle's K fixed
    SET=specter.pipeline.optimistic:OptimisticCycles.fresh_share=1 python ... record ...  # A/B a class attribute

record writes OUT/governor.jsonl (rank 0 only): each decision (next_k: K, its argmax, probe, arm, and the
cost model cycle(K) = K d + v0 + v1 (K + 1) + s(K) with E^-[tokens | K] for every K it weighs), each
observation (observe_cycle's K, accepted, draft_s, verify_s, stall_s, plain steps) and each speculative
cycle as it ran (the K asked and the K run, which a kept pre-draft's length caps; pre-drafted or fresh;
kept; wall seconds; tokens; the later stages' step seconds). report summarises every generation after
the first (the bench's warm-up): plain steps by why they ran, K asked against K run, and per K run its
cycles, wall, tokens, ms a token and what the governor was told; then the governor's last cost model
against what each K realised. --seq prints each generation's decisions in a line: K[<asked][*probe]:tokens
then p (pre-drafted) or f (fresh); P<steps> a run of plain steps (its ms a step).
"""
from __future__ import annotations

import importlib
import json
import os
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def record(out: Path, argv: list[str]) -> int:
    from specter.cli import main
    from specter.pipeline import optimistic
    from specter.speculative import decoder as sdec, governor

    rank = int(os.environ.get("RANK", "0"))
    out.mkdir(parents=True, exist_ok=True)
    f = open(out / "governor.jsonl", "w") if rank == 0 else None

    def log(**kw):
        if f is not None:
            f.write(json.dumps(kw) + "\n")

    gov = governor.Governor
    if os.environ.get("FIXED_K"):  # every cycle's K fixed (the governor's choices aside)
        init, fixed = gov.__init__, int(os.environ["FIXED_K"])
        gov.__init__ = lambda self, k_max, **kw: init(self, k_max, **dict(kw, fixed=fixed))
    next_k, observe = gov.next_k, gov.observe_cycle
    for spec in filter(None, os.environ.get("SET", "").split(",")):  # module:Class.attr=value
        where, value = spec.split("=")
        mod, attr = where.split(":")
        cls, name = attr.rsplit(".", 1)
        owner = getattr(importlib.import_module(mod), cls)
        setattr(owner, name, type(getattr(owner, name))(float(value)))

    def model(g) -> list | None:  # [K, E^-[tokens | K], cycle(K) s] as _argmax_k weighs them
        if g.draft_s is None or g.v0 is None or not g.stall:
            return None
        lo, hi = min(g.stall), max(g.stall)
        a, tokens, run, rows = g.bounds(g.z), 1.0, 1.0, []
        for k in range(1, min(g.k_max, 2 * hi) + 1):
            run *= a[k]
            tokens += run
            rows.append([k, tokens, k * g.draft_s + g.v0 + g.v1 * (k + 1) + g.stall_estimate(min(max(k, lo), hi))])
        return rows

    def logged_next(self, remaining):
        k = next_k(self, remaining)
        log(ev="next", k=k, best=self.k, probe=self.probe, arm=self.arm, steps=self.steps, remaining=remaining,
            d=self.draft_s, v0=self.v0, v1=self.v1, model=model(self))
        return k

    def logged_observe(self, k, accepted, draft_s, verify_s, stall_s, verified=None, copied=None, steps=1):
        log(ev="obs", k=k, m=accepted, draft_s=draft_s, verify_s=verify_s, stall_s=stall_s, steps=steps)
        return observe(self, k, accepted, draft_s, verify_s, stall_s, verified, copied, steps)
    gov.next_k, gov.observe_cycle = logged_next, logged_observe

    cycle = optimistic.OptimisticCycles._optimistic_cycle

    def logged_cycle(self, t, n, k, cache, params):
        pre, later, t0 = self.pre is not None, self.experts.remote[4], time.perf_counter()
        new = cycle(self, t, n, k, cache, params)
        log(ev="cycle", asked=k, k=self.k, pre=pre, kept=self.pre is not None, wall=time.perf_counter() - t0,
            tokens=len(new), later=self.experts.remote[4] - later)
        return new
    optimistic.OptimisticCycles._optimistic_cycle = logged_cycle
    one = sdec.SpeculativeDecoder._cycle

    def logged_one(self, t, n, k, cache, params, gen, hist):  # one process's cycles
        t0 = time.perf_counter()
        new = one(self, t, n, k, cache, params, gen, hist)
        if type(self) is sdec.SpeculativeDecoder:
            log(ev="cycle", asked=k, k=k, pre=False, kept=False, wall=time.perf_counter() - t0, tokens=len(new),
                later=0.0)
        return new
    sdec.SpeculativeDecoder._cycle = logged_one
    run = sdec.SpeculativeDecoder.run

    def logged_run(self, *a, **k):
        log(ev="generation")
        yield from run(self, *a, **k)
    sdec.SpeculativeDecoder.run = logged_run
    try:
        return main(argv)
    finally:
        if f is not None:
            f.close()


def generations(path: Path) -> list[list[dict]]:
    gens: list[list[dict]] = []
    for line in open(path / "governor.jsonl"):
        r = json.loads(line)
        if r["ev"] == "generation":
            gens.append([])
        elif gens:
            gens[-1].append(r)
    return gens


def sequence(gen: list[dict]) -> str:
    out, nxt = [], {}
    for r in gen:
        if r["ev"] == "next":
            nxt = r
        elif r["ev"] == "obs" and r["k"] == 0:
            out.append(f"P{r['steps']}{'*' if nxt.get('probe') else ''}({r['verify_s'] * 1e3:.0f})")
        elif r["ev"] == "cycle":
            asked = f"<{r['asked']}" if r["asked"] != r["k"] else ""
            out.append(f"{r['k']}{asked}{'*' if nxt.get('probe') else ''}:{r['tokens']}{'p' if r['pre'] else 'f'}")
    return " ".join(out)


def report(paths: list[Path], seq: bool) -> None:
    for path in paths:
        gens = generations(path)
        measured = [r for g in gens[1:] for r in g]  # the first generation is the bench's warm-up
        plain, asked, capped, by_k = Counter(), [], Counter(), defaultdict(list)
        nxt, obs = {}, None
        for r in measured:
            if r["ev"] == "next":
                nxt = r
            elif r["ev"] == "obs" and r["k"] == 0:  # a run of plain steps, and why the last decision ran it
                why = ("forced (1 token left)" if nxt["remaining"] == 1 else "probe" if nxt["probe"]
                       else f"arm {nxt['arm'] or 'measured'}")
                plain[why] += r["steps"]
            elif r["ev"] == "obs":
                obs = r
            elif r["ev"] == "cycle":
                asked.append(r["asked"])
                capped[r["pre"]] += r["k"] < r["asked"]
                by_k[r["k"]].append((r, obs))
        cycles = [c for v in by_k.values() for c in v]
        tokens = sum(r["tokens"] for r, _ in cycles)
        print(f"{path}: {len(cycles)} speculative cycles, {tokens} tokens; plain steps {dict(plain)}")
        if cycles:
            print(f"  mean K asked {statistics.mean(asked):.1f}, run {statistics.mean(r['k'] for r, _ in cycles):.1f}; "
                  f"K run < K asked in {capped[True]} pre-drafted cycles (a kept pre-draft's length) and "
                  f"{capped[False]} fresh ones (fresh_share)")
        print("  | K run | cycles | pre-drafted | kept | wall ms | tokens | ms a token | told: draft / verify / stall ms "
              "| later stages ms |")
        for k in sorted(by_k):
            c = by_k[k]
            mean = lambda f: statistics.mean(f(r, o) for r, o in c)  # noqa: E731
            print(f"  | {k} | {len(c)} | {mean(lambda r, o: r['pre']):.2f} | {mean(lambda r, o: r['kept']):.2f} | "
                  f"{mean(lambda r, o: r['wall']) * 1e3:.1f} | {mean(lambda r, o: r['tokens']):.2f} | "
                  f"{sum(r['wall'] for r, _ in c) / sum(r['tokens'] for r, _ in c) * 1e3:.2f} | "
                  f"{mean(lambda r, o: o['draft_s']) * 1e3:.1f} / {mean(lambda r, o: o['verify_s']) * 1e3:.1f} / "
                  f"{mean(lambda r, o: o['stall_s']) * 1e3:.1f} | {mean(lambda r, o: r['later']) * 1e3:.1f} |")
        last = next((r for r in reversed(measured) if r["ev"] == "next" and r["model"]), None)
        if last is not None:
            print(f"  the governor's last cost model: d {last['d'] * 1e3:.2f} ms, v0 {last['v0'] * 1e3:.2f} ms, "
                  f"v1 {last['v1'] * 1e3:.2f} ms; K: cycle(K) ms, E^-[tokens], ms a token "
                  f"(the argmax marked *; realised ms a token where K ran >= 3 times)")
            best = min(last["model"], key=lambda x: x[2] / x[1])[0]
            cells = []
            for k, tok, c in last["model"]:
                real = by_k.get(k, [])
                seen = (f", ran {sum(r['wall'] for r, _ in real) / sum(r['tokens'] for r, _ in real) * 1e3:.2f}"
                        if len(real) >= 3 else "")
                cells.append(f"{k}{'*' if k == best else ''}: {c * 1e3:.1f}, {tok:.2f}, {c / tok * 1e3:.2f}{seen}")
            for i in range(0, len(cells), 4):
                print("    " + " | ".join(cells[i:i + 4]))
        if seq:
            for i, g in enumerate(gens):
                print(f"  generation {i}: {sequence(g)}")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "record":
        rest = sys.argv[3:]
        sys.exit(record(Path(sys.argv[2]), rest[1:] if rest[:1] == ["--"] else rest))
    if len(sys.argv) >= 3 and sys.argv[1] == "report":
        args = [a for a in sys.argv[2:] if a != "--seq"]
        report([Path(a) for a in args], "--seq" in sys.argv)
    else:
        sys.exit(__doc__)
