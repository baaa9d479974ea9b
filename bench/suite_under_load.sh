#!/usr/bin/env bash
# The test suite's verdict must not depend on machine load (issue 23): run README's test command
# ROUNDS times in a row while BURNERS CPU-bound processes run beside it, and print each round's result.
#
#     bash bench/suite_under_load.sh [ROUNDS=3] [BURNERS=2] [pytest args...]
#
# Exit status: 0 when every round passed, else 1. Run from the repository root in its virtualenv.
set -uo pipefail
rounds=${1:-3}
burners=${2:-2}
shift $(( $# > 2 ? 2 : $# ))

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; }
trap cleanup EXIT
for _ in $(seq "$burners"); do
    python -c "while True: pass" &
    pids+=($!)
done

failed=0
for r in $(seq "$rounds"); do
    start=$(date +%s)
    if python -m pytest -q -p no:cacheprovider "$@" >"/tmp/suite_under_load.$r.log" 2>&1; then
        verdict=passed
    else
        verdict=FAILED
        failed=1
    fi
    echo "round $r/$rounds with $burners burners: $verdict in $(( $(date +%s) - start )) s:" \
         "$(tail -n 1 "/tmp/suite_under_load.$r.log")"
done
exit $failed
