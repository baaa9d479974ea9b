#!/usr/bin/env bash
# One rank against two (torchrun, gloo on the CPU) on the bundled model, every pipelined policy, the
# emulated link: `specter bench` in one process, then under `torchrun --nproc-per-node 2`, each rank
# given the one rank's per-device expert budget (--expert-memory 9MiB = residency 0.25 of one
# device; resident takes no budget), ROUNDS rounds alternated. Then the contention probe: the one
# rank's bench again beside a busy process (one core taken, as a second rank's would be). Last, the
# hand-off probe: two gloo processes pass a [256] fp32 vector back and forth, each computing 0.7 ms
# before it sends (about a stage's step on this model), and with no compute (the bare round trip).
# Every process is given one calibration of the emulated link (SPECTER_EXPERT_THROUGHPUT, measured once
# here unless set), so the link and host lane emulated are the same in every run.
# Prints one table: TPOT per policy and round, the median speedup of two ranks, hit rates, round
# trips a token (each crosses every boundary and back), per token of the last round: draft, verify
# and stall time (stall summed over the ranks), greedy tokens equal within each run; then, per
# token of the last two-rank round, each rank's target steps, time blocked on the wire, stall and
# host-lane stall, and rank 0's draft; then the probe.
# With specter among the policies, each round also runs it on two ranks with SPECTER_PIPELINE_OPTIMISTIC=0
# (rank 0 drafts only between verifications) and reports how many of rank 0's pre-drafts were kept,
# the cycles begun on a kept pre-draft and the fresh ones (tokens, ms a token), and rank 0's draft
# step beside the later ranks' verification (a pre-draft) and while they wait (a fresh draft),
# against one process's: the two cores' contention on the rank that drafts.
# BUDGET (default "--expert-memory 9MiB"): each rank's budget, the one rank's too; "--device-memory 33MiB" gives
# each rank one rank's whole device (32.9 MiB: specter's 16 slots of 9 MiB beside its weights, draft and KV
# cache), the pool taking what that rank's stage leaves (`specter plan --ranks 2 --device-memory 33MiB`).
# Usage: ROUNDS=3 bash bench/pipeline_ranks.sh [extra bench flags]   (figures: docs/RESULTS.md)
set -euo pipefail
ROUNDS=${ROUNDS:-3}
POLICIES=${POLICIES:-resident,on-demand,next-layer,host,spec-lru,specter}
OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"
read -r -a budget <<< "${BUDGET:---expert-memory 9MiB}"
args=(bench --policies "$POLICIES" "${budget[@]}" --device cpu --json "$@")
if [ -z "${SPECTER_EXPERT_THROUGHPUT:-}" ]; then  # as a stage measures it (one thread), once
  SPECTER_EXPERT_THROUGHPUT=$(python - <<'PY'
import torch
from specter import default_model_path
from specter.loader import open_checkpoint
from specter.offload.calibrate import measure_expert_throughput
from specter.offload.plan import compute_dtype, make_plan
torch.set_num_threads(1)
ck, dev = open_checkpoint(default_model_path()), torch.device("cpu")
dt = compute_dtype(dev, ck.dtype, None)
plan = make_plan(ck.spec, ck.numel(), dt, expert_memory="9MiB", draft=False, device=dev, store_dtype=ck.dtype)
print(measure_expert_throughput(ck.spec.hidden, ck.spec.expert_inter, dt, storage=getattr(torch, plan.pool_dtype)))
PY
)
fi
export SPECTER_EXPERT_THROUGHPUT
echo "emulated link calibrated once: expert throughput $SPECTER_EXPERT_THROUGHPUT B/s; $(date -u +%H:%M:%S) UTC, load: $(cut -d' ' -f1-3 /proc/loadavg)"
seqargs=(bench --policies specter "${budget[@]}" --device cpu --json "$@")
for rep in $(seq "$ROUNDS"); do
  python -m specter "${args[@]}" > "$OUT/one-$rep.json"
  python -m torch.distributed.run --nproc-per-node 2 -m specter "${args[@]}" > "$OUT/two-$rep.json"
  case ",$POLICIES," in *,specter,*)  # rank 0 drafting only between verifications, as before optimistic drafting
    SPECTER_PIPELINE_OPTIMISTIC=0 python -m torch.distributed.run --nproc-per-node 2 -m specter "${seqargs[@]}" \
      > "$OUT/seq-$rep.json";;
  esac
done
python -c "while True: pass" & burner=$!
trap 'kill $burner 2>/dev/null || true' EXIT
python -m specter "${args[@]}" > "$OUT/one-busy.json"
kill $burner
cat > "$OUT/handoff.py" <<'PY'
import time, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
r, x, a = dist.get_rank(), torch.zeros(256), torch.randn(512, 512)
def work(s):
    t = time.perf_counter()
    while time.perf_counter() - t < s:
        a @ a[:, :8]
for s in (0.0, 0.0007):
    for it in range(2):  # the first pass warms up
        t = time.perf_counter()
        for _ in range(300):
            if r == 0:
                work(s); dist.send(x, 1); dist.recv(x, 1)
            else:
                dist.recv(x, 0); work(s); dist.send(x, 0)
        if r == 0 and it:
            ms = (time.perf_counter() - t) / 300 * 1e3
            print(f"hand-off probe: compute {2 * s * 1e3:.1f} ms a round trip, measured {ms:.2f} ms: "
                  f"{ms - 2 * s * 1e3:.2f} ms for its two hand-offs")
dist.destroy_process_group()
PY
python -m torch.distributed.run --nproc-per-node 2 "$OUT/handoff.py" 2>/dev/null > "$OUT/handoff.txt"
python - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
load = lambda name: json.load(open(f"{out}/{name}.json"))["policies"]
one = [load(f"one-{r}") for r in range(1, rounds + 1)]
two = [load(f"two-{r}") for r in range(1, rounds + 1)]
busy = load("one-busy")
ms = lambda r: r["tpot_s"] * 1e3
hit = lambda r: r.get("expert_hits", 0) / max(1, r.get("expert_hits", 0) + r.get("expert_misses", 0))
def mean_k(r):
    h = {int(k): v for k, v in (r.get("k_histogram") or {}).items() if int(k)}
    return sum(k * v for k, v in h.items()) / max(1, sum(h.values()))
per = lambda r: " / ".join(f"{r.get(k, 0) / r['new_tokens'] * 1e3:.1f}" for k in ("draft_s", "verify_s", "stall_s"))
print(f"results in {out}")
print("| policy | 1 rank TPOT ms (rounds) | 2 ranks TPOT ms (rounds) | speedup (median of rounds) | hit rate 1 / 2 "
      "| round trips a token (2 ranks) | draft / verify / stall ms a token, 1 rank; 2 ranks (last round) "
      "| 1 rank beside a busy process, ms |")
print("|---|---|---|---|---|---|---|---|")
import os
seq = [load(f"seq-{r}") for r in range(1, rounds + 1)] if os.path.exists(f"{out}/seq-1.json") else []
rows = [(p, p, two) for p in one[0]] + ([("specter", "specter, no pre-draft", seq)] if seq else [])
for p, name, runs in rows:
    a, b = [ms(r[p]) for r in one], [ms(r[p]) for r in runs]
    trips = runs[0][p]["round_trips"] / runs[0][p]["new_tokens"]
    print(f"| {name} | {', '.join(f'{x:.1f}' for x in a)} | {', '.join(f'{x:.1f}' for x in b)} | "
          f"{statistics.median(x / y for x, y in zip(a, b)):.2f}x | {hit(one[0][p]):.2f} / {hit(runs[0][p]):.2f} | "
          f"{trips:.2f} | {per(one[-1][p])}; {per(runs[-1][p])} | {ms(busy[p]):.1f} |")
for p in one[0]:
    o = [r[p].get("optimistic") for r in two if r[p].get("optimistic")]
    if o:
        print(f"{p}, two ranks: pre-drafts kept / made {sum(x['kept'] for x in o)} / {sum(x['pre_drafted'] for x in o)}, "
              f"stopped when the result showed the guess failed {sum(x.get('stopped', 0) for x in o)}, kept ones whose "
              f"rank-0 step ran before the acceptance {sum(x.get('early_steps', 0) for x in o)}, "
              f"pre-drafted tokens verified {sum(x['used_tokens'] for x in o)} of {sum(r[p]['new_tokens'] for r in two)} "
              f"tokens, mean K of speculative cycles 1 / 2 ranks "
              f"{statistics.mean(mean_k(r[p]) for r in one):.1f} / {statistics.mean(mean_k(r[p]) for r in two):.1f}")
        cyc = lambda kind: (sum(x[kind + "_cycles"] for x in o), sum(x[kind + "_tokens"] for x in o),
                            sum(x[kind + "_s"] for x in o))
        dec = sum(r[p]["decode_s"] for r in two)
        print(f"{p}, two ranks, cycles by how they began (count, tokens, ms a token, share of decoding): " + "; ".join(
            f"{name} {c} cycles, {t} tokens, {s / max(1, t) * 1e3:.2f} ms, {s / dec:.0%}"
            for name, (c, t, s) in (("on a kept pre-draft", cyc("kept")), ("fresh", cyc("fresh")))))
        st = lambda runs, s, n: sum(r[p]["optimistic"][s] if n else r[p][s] for r in runs) / max(1, sum(
            r[p]["optimistic"][n] if n else r[p]["drafted_tokens"] for r in runs)) * 1e3
        tok = sum(r[p]["new_tokens"] for r in two)
        print(f"{p}: rank 0's draft step, ms: two ranks, beside the later ranks' verification (pre-draft) "
              f"{st(two, 'pre_draft_s', 'pre_steps'):.2f} ({sum(x['pre_steps'] for x in o) / tok:.2f} a token), while "
              f"they waited {st(two, 'draft_s', 'steps'):.2f} ({sum(x['steps'] for x in o) / tok:.2f} a token); "
              f"one process {st(one, 'draft_s', None):.2f} (its planning included; "
              f"{sum(r[p]['drafted_tokens'] for r in one) / sum(r[p]['new_tokens'] for r in one):.2f} a token)")
same = all(r[p].get("lossless_vs_" + next(iter(r))) is not False for r in one + two + [busy] for p in r)
print("\nper token, last two-rank round, ms: rank 0's draft; then each rank's target steps (its stage's "
      "share of prefill, verifications and plain steps), blocked on the wire (receives, sends), stall, host-lane stall")
print("| policy | rank 0 draft | " + " | ".join(f"rank {i}: step / wire / stall / host" for i in range(2)) + " |")
print("|---|---|---|---|")
for p, r in list(two[-1].items()) + ([("specter, no pre-draft", seq[-1]["specter"])] if seq else []):
    n = r["new_tokens"]
    each = " | ".join(" / ".join(f"{q.get(k, 0) / n * 1e3:.1f}" for k in ("step_s", "wire_s", "stall_s", "host_stall_s"))
                      for q in r["per_rank"])
    print(f"| {p} | {r.get('draft_s', 0) / n * 1e3:.1f} | {each} |")
print("greedy tokens equal to the first policy's within every run:", same)
print(open(f"{out}/handoff.txt").read().strip())
PY
echo "done $(date -u +%H:%M:%S) UTC, load: $(cut -d' ' -f1-3 /proc/loadavg)"
