#!/usr/bin/env bash
# The GPU check, on a bare GPU machine, in two commands that each end within 5 minutes (a device
# lease is 15 minutes in all, the machine's start included). Each writes its results as JSON into
# $OUT (summary.json: the machine's facts and every step's outcome; plus each step's own files) and
# prints a short summary.
#
#   CHECKS=suite  the targeted CUDA suite: tests/test_cuda.py (fused MoE kernels against the fp32
#                 reference at bf16 and bit-exact batch invariance, one lossless run per policy on
#                 a tiny checkpoint, astream against generate, captured graphs sync-free, the
#                 pinned host store) with the CUDA tests of the other files (-k cuda; the
#                 lossless decode kernel bit for bit among them)
#                 -> suite.xml (JUnit), suite.log
#   CHECKS=bench  the kernels' GB/s and share of HBM bandwidth (bench/test_kernels.py, with the
#                 lossless decode of one expert into a slot; quanto's own
#                 INT4 path left out: it builds CUDA extensions first) -> kernels.json; then
#                 `specter bench --json` on the bundled model over the real PCIe link, at 1/4
#                 residency, resident, on-demand and specter (one compile) -> bench.json
#   compressed  issue 24's figure: `specter bench --compare-compressed` (raw and coded stores side by
#                 side, bytes a token and TPOT) at 1/4 residency over the real link -> compressed.json;
#                 then specter raw against coded with K fixed at 4 (bench/coded_specter.py: the
#                 governor's arm choice out of the comparison, counts per cycle) -> compressed_k4.json
#   compressedwide  compressed at a realistic expert size: the bundled model with every expert
#                 widened 16x (bench/wide_experts.py: 4.7 MB an expert, the same function and routing;
#                 not the bundled model), on-demand, spec-lru and specter, raw against coded, 1/4
#                 residency over the real link -> compressed_wide.json
#   codedtier   the compressed device tier on CUDA (opt-in there, SPECTER_CODED_TIER=1): on the wide16
#                 model (as compressedwide builds it), on-demand and specter raw against coded with the
#                 tier, 1/4 residency -> coded_tier_wide.json; compare with compressed_wide.json (coded
#                 without the tier, the CUDA default) from the same run
#   codedcopy   a raw and a coded expert copy through CudaLink, per model's expert shape: the
#                 issuing thread's microseconds and the link's (bench/experiments/coded_copy_cost.py);
#                 coded as the engine copies (one launch an expert), per tensor, and in place from
#                 the locked arena (SPECTER_CODED_IN_PLACE's experiment) beside it, and a coded tier's
#                 hit (the pair kernel from bytes kept on the device: tier_hit_over_raw) and a layer
#                 call's 8 hits in one launch (the batch kernel: tier_batch_over_raw, per expert); then
#                 codedcopy_jit, the same with every decode launch through Triton's JIT (before launch.py)
#   hostlane    the host lane beside the GPU over the real link, on a real host: `specter bench` at 1/4
#                 residency, on-demand, host (every miss computed on the host) and specter with its lane
#                 (--host-threads 8: opt-in on CUDA) -> bench_hostlane.json; specter without it is tpot's
#   also: kernels (bench's first half alone), tpot (its second half alone), tpot0 (tpot with the MoE
#   calls eager, SPECTER_MOE_GRAPHS=0: the baseline of triton_ops/graphed.py), hostprof (a generation
#   under cProfile per policy: where a token's host time goes, bench/host_profile.py), firstrun
#   (bench/experiments/first_run_cost.py), moehost (bench/experiments/moe_host_cost.py), decodetune
#   (bench/experiments/decode_tune.py: the lossless decode kernel's BLOCK x NUM_WARPS variants), graphs
#   (bench/graph_check.py), async (bench/async_vs_sync.py) -> NAME.log; any mix, one time budget:
#   each step's limit is cut to what is left of BUDGET_S (default 285 s).
#
# What the GPU image lacks travels as wheels in .whl/ (git-ignored), listed on the '# wheel:' lines
# below; bench/fetch_device_wheels.sh downloads them. The server's and the OpenAI client's packages
# are not carried: tests/test_server.py skips with the reason.
# wheel: optimum-quanto==0.2.7
#
# A session with a GPU, once here in the repo root:   bash bench/fetch_device_wheels.sh
# then ONE call of the device tool's run with everything (the machine started in ~30 s on
# 2026-12-04 and goes back 30 s after a call, so a second call rarely finds it warm; at 17:42 suite,
# codedcopy, tpot, compressed, firstrun and moehost took 360 s; at 18:03 suite 157 s, moehost 7 s,
# codedcopy 12 s, tpot0 38 s). $OUT brings back 8 files at most, so the results travel as one
# tarball beside summary.json (issue 24's figures right after the suite, the host-cost ones last):
#   run(command='D=/tmp/dc; OUT=$D CHECKS="suite codedcopy decodetune compressedwide codedtier tpot hostlane tpot0 moehost hostprof" BUDGET_S=540 bash
#       bench/device_check.sh; cp $D/summary.json "$OUT"/; tar czf "$OUT/all.tgz" -C $D .',
#       carry=[".whl"], timeout_s=600)
# then give_back.
#
# DRY_RUN=1 (no GPU needed; tests/test_device_check.py runs it): checks and installs the carried
# wheels into a scratch folder, prints the install and step commands instead of running them, and
# checks each step's command (dry_step: pytest collects its tests, the CLI parses its flags, a
# script's --help names every flag it is given); a failed check fails it.
set -uo pipefail
export PYTHONUNBUFFERED=1
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/specter-device-check}
CHECKS=${CHECKS:-suite}
BUDGET_S=${BUDGET_S:-285}
DRY_RUN=${DRY_RUN:-0}
WHEELS_DIR=${WHEELS_DIR:-$REPO/.whl}
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
SITE=${SITE:-/tmp/site}
[[ $DRY_RUN == 1 ]] && SITE=$SCRATCH/site
SUITE=(tests/test_triton_ops.py tests/test_lossless.py tests/test_link.py tests/test_profiling.py tests/test_slots.py tests/test_spec_lossless.py tests/test_spec_acceptance.py tests/test_spec_cycles.py tests/test_spec_planner.py
       tests/test_coalesce.py tests/test_compressed.py tests/test_coded_tier.py tests/test_graphed.py tests/test_cuda.py)  # in this order: the quick ones first, the captured graphs (compiles) last
mkdir -p "$OUT"
STEPS=$SCRATCH/steps.tsv
: > "$STEPS"

finish() {  # summary.json from whatever the steps left, and the short summary
  "$PY" "$REPO/bench/device_summary.py" summary "$OUT" "$SCRATCH/facts.json" "$STEPS"
}

stop() {  # stop CODE STEP MESSAGE...: a clear message, the step recorded in summary.json, exit CODE
  local code=$1 name=$2
  shift 2
  echo "device check: STOPPED: $*" >&2
  printf '%s	%s	%s	%s
' "$name" "$code" 0 0 >> "$STEPS"
  finish > /dev/null
  exit "$code"
}

# step NAME LIMIT CMD...: run CMD from /tmp (so `import specter` is the installed package) with
# LIMIT cut to the time left; stdout and stderr to $OUT/NAME.log (stdout to $OUT/NAME.json when
# JSON=1). SIGINT at the limit lets pytest write its report; KILL 10 s later.
step() {
  local name=$1 cap=$2 left t0 rc
  shift 2
  left=$((BUDGET_S - SECONDS - 15))
  ((cap > left)) && cap=$left
  if ((cap < 20)); then
    echo "$name: skipped, ${left} s left of the ${BUDGET_S} s budget"
    printf '%s\t%s\t%s\t%s\n' "$name" 125 0 0 >> "$STEPS"
    return
  fi
  echo "== $name (limit ${cap} s): $*"
  t0=$SECONDS
  if [[ ${JSON:-0} == 1 ]]; then
    (cd /tmp && timeout -s INT -k 10 "$cap" "$@" > "$OUT/$name.json" 2> "$OUT/$name.log")
  else
    (cd /tmp && timeout -s INT -k 10 "$cap" "$@" > "$OUT/$name.log" 2>&1)
  fi
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" $((SECONDS - t0)) "$cap" >> "$STEPS"
}

# ---------------------------------------------------------------- the machine, and what it lacks
"$PY" "$REPO/bench/device_summary.py" facts > "$SCRATCH/facts.json" 2> "$SCRATCH/facts.err" \
  || { echo '{}' > "$SCRATCH/facts.json"; tail -n 5 "$SCRATCH/facts.err"; }
cat "$SCRATCH/facts.json"
wheels=() missing=()
for spec in $(sed -n 's/^# wheel: //p' "$REPO/bench/device_check.sh"); do
  name=$(echo "${spec%%==*}" | tr 'A-Z-' 'a-z_') version=${spec#*==}
  found=$(ls "$WHEELS_DIR/$name-$version"-*.whl 2>/dev/null | head -n 1)
  if [[ -n $found ]]; then wheels+=("$found"); else missing+=("$spec"); fi
done
((${#missing[@]})) && stop 3 wheels "carried wheel(s) missing from $WHEELS_DIR: ${missing[*]}." \
  "Here, in the repo root: bash bench/fetch_device_wheels.sh; then run with carry [\".whl\"]."
install_specter=("$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir
                 --upgrade --target "$SITE" "$REPO")
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
  "${wheels[@]}" > "$OUT/install.log" 2>&1 || { tail -n 30 "$OUT/install.log"; stop 4 install "the wheels did not install"; }
if [[ $DRY_RUN == 1 ]]; then
  echo "dry run: wheels installed into $SITE: $(ls "$SITE" | tr '\n' ' ')"
  echo "dry run: would run: ${install_specter[*]}"
else
  "${install_specter[@]}" >> "$OUT/install.log" 2>&1 \
    || { tail -n 30 "$OUT/install.log"; stop 4 install "specter did not install"; }
  rm -f "$OUT/install.log"  # $OUT brings back 8 files at most: keep the install's log for a failure
fi
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}

# ----------------------------------------------------------------------------------- the steps
suite_cmd=("$PY" -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT/suite.xml" -k cuda "${SUITE[@]/#/$REPO/}")
bench_json=()
"$PY" -c "import pytest_benchmark" 2> /dev/null && bench_json=(--benchmark-json="$OUT/kernels.json")
kernels_cmd=("$PY" -m pytest -q -s -p no:cacheprovider --junitxml="$OUT/kernels.xml" -k "not quanto" "${bench_json[@]}"
             "$REPO/bench/test_kernels.py")

# dry_step NAME LIMIT CMD...: what `step` would run, checked as far as it can be without a GPU: pytest
# collects its tests, `specter.cli` parses its flags, a script's --help names every flag the step gives it
dry_step() {
  local name=$1 r=0 a flag help
  shift 2
  local cmd=("$@")
  while [[ ${cmd[0]} == env || ${cmd[0]} == *=* ]]; do cmd=("${cmd[@]:1}"); done  # (env VAR=1 python ...)
  echo "dry run: $name would run: $*"
  if [[ ${cmd[1]} == -m && ${cmd[2]} == pytest ]]; then
    (cd /tmp && "${cmd[@]}" --collect-only) > "$OUT/collect-$name.log" 2>&1 || r=$?
    tail -n 3 "$OUT/collect-$name.log"
  elif [[ ${cmd[1]} == -m && ${cmd[2]} == specter.cli ]]; then
    local parse='import sys; from specter.cli import build_parser; build_parser().parse_args(sys.argv[1:])'
    (cd /tmp && "${cmd[0]}" -c "$parse" "${cmd[@]:3}") || r=$?
  else
    help=$(cd /tmp && "${cmd[0]}" "${cmd[1]}" --help 2>&1) || { r=$?; echo "$help" | tail -n 3; }
    for a in "${cmd[@]:2}"; do
      flag=${a%%=*}
      if [[ $flag == --* ]] && ! grep -qE -- "(^|[^-[:alnum:]])$flag([^-[:alnum:]]|$)" <<< "$help"; then
        echo "dry run: $name: $flag is not in ${cmd[1]##*/}'s --help"
        r=1
      fi
    done
  fi
  if ((r != 0)); then
    echo "dry run: $name FAILED (exit $r)"
    DRY_RC=1
  fi
}
if [[ $DRY_RUN == 1 ]]; then
  DRY_RC=0
  step() { dry_step "$@"; }
fi

for part in $CHECKS; do
  case $part in
    suite) step suite 300 "${suite_cmd[@]}" ;;  # 157 s at 18:03 before the plain policies compiled
    bench | tpot)
      [[ $part == bench ]] && step kernels 110 "${kernels_cmd[@]}"
      JSON=1 step bench 200 "$PY" -m specter.cli bench --device cuda --residency 0.25 \
        --policies resident,on-demand,specter --json ;;
    tpot0)  # tpot with every MoE call eager (SPECTER_MOE_GRAPHS=0): tpot's baseline for triton_ops/graphed.py
      JSON=1 step bench_eager_moe 200 env SPECTER_MOE_GRAPHS=0 "$PY" -m specter.cli bench --device cuda \
        --residency 0.25 --policies resident,on-demand,specter --json ;;
    hostlane)
      JSON=1 step bench_hostlane 200 "$PY" -m specter.cli bench --device cuda --residency 0.25 \
        --policies on-demand,host,specter --host-threads 8 --json ;;
    kernels) step kernels 110 "${kernels_cmd[@]}" ;;  # bench's first half alone
    firstrun) step firstrun 90 "$PY" "$REPO/bench/experiments/first_run_cost.py" ;;
    moehost)  # then every launch through Triton's JIT, as before triton_ops/launch.py: its A/B on the GPU
      step moehost 60 "$PY" "$REPO/bench/experiments/moe_host_cost.py"
      step moehost_jit 60 "$PY" "$REPO/bench/experiments/moe_host_cost.py" --launches jit ;;
    hostprof) step hostprof 90 "$PY" "$REPO/bench/host_profile.py" --device cuda ;;
    decodetune) step decodetune 90 "$PY" "$REPO/bench/experiments/decode_tune.py" ;;
    codedcopy)  # the same A/B as moehost's
      step codedcopy 60 "$PY" "$REPO/bench/experiments/coded_copy_cost.py"
      step codedcopy_jit 60 "$PY" "$REPO/bench/experiments/coded_copy_cost.py" --launches jit ;;
    graphs) step graphs 200 "$PY" "$REPO/bench/graph_check.py" --residency 0.5 --repeat 1 ;;
    async) step async 200 "$PY" "$REPO/bench/async_vs_sync.py" --device cuda --policies specter \
             --workloads default --prompts 2 --rounds 1 --max-new-tokens 32 ;;
    compressed)
      JSON=1 step compressed 180 "$PY" -m specter.cli bench --device cuda --residency 0.25 \
        --policies on-demand,spec-lru,specter --compare-compressed --json
      JSON=1 step compressed_k4 90 "$PY" "$REPO/bench/coded_specter.py" --device cuda --residency 0.25 \
        --policy specter --k 4 --json ;;
    compressedwide)
      step widen 60 "$PY" "$REPO/bench/wide_experts.py" "$SCRATCH/wide16" --factor 16
      JSON=1 step compressed_wide 200 "$PY" -m specter.cli bench --device cuda --model "$SCRATCH/wide16" \
        --residency 0.25 --policies on-demand,spec-lru,specter --compare-compressed --json ;;
    codedtier)
      [[ -d $SCRATCH/wide16 ]] || step widen 60 "$PY" "$REPO/bench/wide_experts.py" "$SCRATCH/wide16" --factor 16
      JSON=1 step coded_tier_wide 200 env SPECTER_CODED_TIER=1 "$PY" -m specter.cli bench --device cuda \
        --model "$SCRATCH/wide16" --residency 0.25 --policies on-demand,specter --compare-compressed --json ;;
    *) echo "unknown check '$part' (suite, bench, kernels, tpot, tpot0, hostlane, hostprof, firstrun, moehost, codedcopy, decodetune, codedtier, graphs, async, compressed, compressedwide)" ;;
  esac
done
[[ $DRY_RUN == 1 ]] && exit "$DRY_RC"
finish
