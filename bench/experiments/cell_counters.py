"""One governor-matrix cell's counters, per policy: what each policy's generations did, not how long
they took (hits, misses, bytes copied, host-lane experts, stall, K chosen, plain-step arms).

    python bench/experiments/cell_counters.py [--model uniform] [--residency 0.25] [--max-new-tokens 16]
        [--prompts 2] [--rounds 3] [--policies on-demand,next-layer,spec-lru,specter] [--env NAME=VALUE ...]

Every policy warms up on the first prompt (as bench/governor_matrix.py does), then generates each
prompt `rounds` times; the counters sum over those generations. Plain-step arms (speculative
decoders' K = 0 runs): steps run with and without next-layer guesses (`guess`), with the host lane
or copying every miss (`copy-all`), as the governor's PlainArms picked them. Wall times are shown
but are one draw on a shared machine; the counts are what to compare.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import governor_matrix as gm  # noqa: E402


def hook_arms(engine, arms: Counter) -> None:
    """Count the plain steps each K = 0 arm ran (the decoder's _observe_plain), with their seconds,
    misses and copies (what the manager counted since the last plain run or speculative cycle)."""
    dec = engine.decoder
    if not hasattr(dec, "_observe_plain"):
        return
    orig, cycle, mgr = dec._observe_plain, dec._cycle, dec.experts
    last = {}

    def mark():
        st = mgr.stats()
        last.update(misses=st["expert_misses"], copied=st["h2d_bytes"], host=st["host_experts"])

    def observe(steps, seconds, copied0, arm, lane=None, *rest):
        st = mgr.stats()
        names = ["plain"]
        if arm is not None:
            names.append("guess" if arm else "no-guess")
        if lane is not None:
            names.append("copy-all" if lane else "host-lane")
        for n in names:
            arms[n + " steps"] += steps
            arms[n + " ms"] += seconds * 1e3
            arms[n + " misses"] += st["expert_misses"] - last.get("misses", st["expert_misses"])
            arms[n + " copies"] += (st["h2d_bytes"] - last.get("copied", st["h2d_bytes"])) / mgr.expert_bytes
            arms[n + " hosted"] += st["host_experts"] - last.get("host", st["host_experts"])
        out = orig(steps, seconds, copied0, arm, lane, *rest)
        mark()
        return out

    def counted_cycle(*a, **kw):
        out = cycle(*a, **kw)
        mark()
        return out

    dec._observe_plain, dec._cycle = observe, counted_cycle
    run = dec.run

    def wrapped(*a, **kw):
        it = run(*a, **kw)
        first = next(it)  # prefill done
        mark()
        yield first
        i, m = 1, mgr.stats()["expert_misses"]
        for new in it:  # misses by decode step (a speculative cycle counts at its first token's index)
            arms[f"miss@{min(i, 8)}"] += mgr.stats()["expert_misses"] - m
            arms[f"n@{min(i, 8)}"] += 1
            i, m = i + len(new), mgr.stats()["expert_misses"]
            yield new

    dec.run = wrapped


def variant(engine, name: str) -> None:
    """A scratch variant of specter, named after ':' (several joined by '+'): lru (no planner rank in
    eviction), nokeep (no keep_rank), nohook (no observe_use), noguess (no next-layer arm in plain
    steps), nohost (no host lane in plain steps or verification), k0 / k5 (K fixed at 0 / 5),
    guess0 / guess1 and lane0 / lane1 (a plain-step arm fixed: lane1 copies every miss), noprank (a
    prompt's misses ranked for the host lane by the planner's old scores, not the prompt's own tokens)."""
    dec = engine.decoder
    mgr = dec.experts
    for v in filter(None, name.split("+")):
        if v == "lru":
            mgr.slots.set_planner(None)
        elif v == "nokeep":
            mgr.keep_rank = None
        elif v == "nohook":
            mgr.use_hook = None
        elif v == "noguess":
            dec.fallback = None
        elif v == "nohost":
            mgr.host_choice = None
        elif v == "noprefillhost":  # the host lane off during prefill only
            run = dec.run

            def no_host_prefill(*a, _run=run, **kw):
                choice, mgr.host_choice = mgr.host_choice, None
                it = _run(*a, **kw)
                try:
                    first = next(it)
                finally:
                    mgr.host_choice = choice
                yield first
                yield from it

            dec.run = no_host_prefill
        elif v == "noprank":  # a prompt's misses ranked by the planner's old scores, not its own tokens
            mgr.host_choice.rank_prompt = False
        elif v[0] == "k" and v[1:].isdigit():  # the governor fixed at K = n (k0: plain steps only)
            dec.governor.fixed = int(v[1:])
        elif v[:-1] in ("guess", "lane") and v[-1] in "01":  # a K = 0 arm fixed: guess1 / guess0, lane1 / lane0
            arms = dec.governor.plain_arms if v[:-1] == "guess" else dec.governor.lane_arms
            arms.pick = (lambda val: (lambda: val))(v[-1] == "1")
            arms.probing = False
        else:
            raise ValueError(v)


def hook_prefill(engine, snap: dict) -> None:
    """Snapshot the offload manager's counters right after prefill (the decoder's first yield), so
    that the counters below are the decode steps' alone."""
    dec = engine.decoder
    run, mgr = dec.run, dec.experts

    def wrapped(*a, **kw):
        it = run(*a, **kw)
        first = next(it)
        snap.clear()
        snap.update(mgr.stats())
        yield first
        yield from it

    dec.run = wrapped


def cell_parser(doc: str, model: str, residency: float, rounds: int) -> argparse.ArgumentParser:
    """The options every cell script takes (its engines' option is its own)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", default=model)
    ap.add_argument("--residency", type=float, default=residency)
    ap.add_argument("--link", default="A100-40GB-PCIe4")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=rounds)
    return ap


def cell_engines(args, names: list[str], tmp: str) -> tuple[list, dict]:
    """The cell's prompts and one engine per name POLICY[#n][:VARIANT] (#n: a second engine of the same
    policy), all sharing the weights; a generated model is built into `tmp`."""
    import specter

    model = None if args.model == "bundled" else Path(tmp) / args.model
    if model is not None:
        gm.build(args.model, model)
    engines, shared = {}, None
    for n in names:
        pol, _, var = n.partition(":")
        engines[n] = specter.load(model, policy=pol.split("#")[0], shared=shared, residency=args.residency,
                                  link=args.link)
        variant(engines[n], var)
        shared = engines[n].shared
    return gm.prompts_for(args.model, args.prompts), engines


def main() -> int:
    ap = cell_parser(__doc__, "uniform", 0.25, 3)
    ap.add_argument("--policies", default="on-demand,next-layer,spec-lru,specter")
    args = ap.parse_args()

    keys = ("expert_hits", "expert_misses", "h2d_bytes", "host_experts", "stall_s", "host_stall_s",
            "prefetch_issued", "prefetch_used", "prefetch_cancelled")
    with tempfile.TemporaryDirectory() as tmp:
        prompts, engines = cell_engines(args, args.policies.split(","), tmp)
        out, texts = {}, {}
        for p, e in engines.items():
            arms = Counter()
            hook_arms(e, arms)
            snap = {}
            hook_prefill(e, snap)
            e.generate(prompts[0], max_new_tokens=args.max_new_tokens)  # warm-up, as the matrix
            c, k, tpot, ttft = Counter(), Counter(), [], []
            for r in range(args.rounds):
                for i, prompt in enumerate(prompts):
                    g = e.generate(prompt, max_new_tokens=args.max_new_tokens)
                    texts.setdefault((r, i), {})[p] = g.token_ids if hasattr(g, "token_ids") else None
                    s = g.stats
                    for key in keys:
                        c[key] += (s.get(key) or 0) - (snap.get(key) or 0)
                    c["tokens"] += s["new_tokens"] - 1  # decode steps only: prefill's counts are subtracted
                    c["drafted"] += s.get("drafted_tokens") or 0
                    c["accepted"] += s.get("accepted_tokens") or 0
                    k.update(s.get("k_histogram") or {})
                    tpot.append(s["tpot_s"] * 1e3)
                    ttft.append(s["ttft_s"] * 1e3)
            out[p] = (c, k, arms, tpot, ttft)
            e.close()
    print(f"{args.model} residency {args.residency} x {args.max_new_tokens} tokens, {args.prompts} prompts x "
          f"{args.rounds} rounds (after a warm-up)")
    for p, (c, k, arms, tpot, ttft) in out.items():
        n = max(c["tokens"], 1)
        print(f"\n{p}: tpot ms median {sorted(tpot)[len(tpot) // 2]:.2f}, ttft ms median "
              f"{sorted(ttft)[len(ttft) // 2]:.1f} (one draw)")
        print(f"  per token: hits {c['expert_hits'] / n:.2f} misses {c['expert_misses'] / n:.2f} "
              f"MB copied {c['h2d_bytes'] / 1e6 / n:.3f} host experts {c['host_experts'] / n:.2f} "
              f"stall ms {c['stall_s'] * 1e3 / n:.3f} (host {c['host_stall_s'] * 1e3 / n:.3f})")
        print(f"  prefetch issued {c['prefetch_issued']} used {c['prefetch_used']} cancelled {c['prefetch_cancelled']}"
              f"  drafted {c['drafted']} accepted {c['accepted']}")
        if k:
            print(f"  K histogram {dict(sorted(k.items()))}")
        if arms["n@1"]:
            print("  misses by decode step (8: 8 and later): " + " ".join(
                f"{i}:{arms[f'miss@{i}'] / arms[f'n@{i}']:.2f}" for i in range(1, 9) if arms[f"n@{i}"]))
        for a in ("plain", "no-guess", "guess", "host-lane", "copy-all"):
            n = arms[a + " steps"]
            if n:
                print(f"  {a:<9} steps {n:4d}: ms/step {arms[a + ' ms'] / n:6.2f} misses/step {arms[a + ' misses'] / n:.2f} "
                      f"copies/step {arms[a + ' copies'] / n:.2f} hosted/step {arms[a + ' hosted'] / n:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
