#!/usr/bin/env bash
# One rank against two (torchrun) on the bundled model, on-demand: each rank given the one rank's
# expert budget (--expert-memory 9MiB = residency 0.25 of one device), and two ranks sharing that
# residency. Prints TPOT, hit rate, bytes copied and summed stall per run; tok= is a hash of the tokens.
# Usage: bash bench/pipeline_ranks.sh   (figures: docs/RESULTS.md)
run() { # n policy budget...
  n=$1; shift
  if [ $n = 1 ]; then cmd="python -m specter"; else cmd="python -m torch.distributed.run --nproc-per-node $n -m specter"; fi
  $cmd generate "def add(a, b):" --greedy --max-new-tokens 64 --json "$@" 2>/dev/null | python -c "
import json,sys; d=json.load(sys.stdin); s=d['stats']; u=s['expert_hits']+s['expert_misses']
print('$n', '$*', 'tpot_ms=%.1f' % (1e3*s['tpot_s']), 'hit=%.2f' % (s['expert_hits']/u), 'h2dMB=%.0f' % (s['h2d_bytes']/1e6), 'stall_s=%.2f' % s['stall_s'], 'tok=%d' % hash(tuple(d['token_ids'])))"
}
for rep in 1 2 3; do
  run 1 --policy on-demand --expert-memory 9MiB
  run 2 --policy on-demand --expert-memory 9MiB
  run 2 --policy on-demand --residency 0.25
done
