#!/usr/bin/env bash
# The GPU check, prepared to fit one device lease (15 minutes of device time in all; this takes
# at most 10 after the machine starts). It runs the whole test suite where CUDA is present (the
# CudaLink tests stop being skipped), the captured draft step and verifier (bench/graph_check.py: no host sync
# under set_sync_debug_mode("error"), TPOT with and without CUDA graphs) and `specter bench` over
# the real PCIe link, whose CUDA paths (CudaLink, the packed INT4 draft, the pinned host store,
# stall_s from CUDA events) never run on the CPU CI, and bench/pinned_check.py: exact-size pinning
# of the host store (no power-of-two rounding) and its fallback.
#
# The device image has torch, transformers, accelerate, safetensors, tokenizers, triton, pytest
# and matplotlib, but not optimum-quanto, which travels as a wheel. Here, once, in the repo root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl optimum-quanto==0.2.7
# then call the device tool's run with carry [".whl"], timeout_s 540 and the command
#   bash bench/device_check.sh
# Logs land in $OUT (pytest.log, bench-*.txt); the tail of each is printed.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/specter-device-check}
mkdir -p "$OUT"
REPO=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
# pinned host store: the caching host allocator's rounding vs the exact in-place arena, and the fallback
(cd /tmp && timeout 60 python3 "$REPO/bench/pinned_check.py" > "$OUT/pinned.txt" 2>&1)
echo "pinned check exit $?"; cat "$OUT/pinned.txt"
# from outside the checkout, so `import specter` is the installed package (compiled/ and
# triton_ops/ are mapped into it at install). CHECKS picks parts; each has its own timeout. All
# five may pass 600 s together: split them over two commands, e.g. CHECKS="kernels pytest" then
# CHECKS="graphs async bench".
CHECKS=${CHECKS:-"pytest graphs async bench kernels"}
if [[ $CHECKS == *pytest* ]]; then
  (cd /tmp && timeout 200 python3 -m pytest -q -x -p no:cacheprovider "$REPO/tests" > "$OUT/pytest.log" 2>&1)
  echo "pytest exit $?"; tail -n 15 "$OUT/pytest.log"
fi
# the captured draft step and piecewise verifier: zero syncs under set_sync_debug_mode("error")
# (draft steps; the verifier's pieces at every width), TPOT eager / compiled / CUDA graphs with the
# eager verifier / CUDA graphs for both, tokens against resident bf16 decoding (tie-aware)
if [[ $CHECKS == *graphs* ]]; then
  (cd /tmp && timeout 240 python3 "$REPO/bench/graph_check.py" --residency 0.5 > "$OUT/graphs.txt" 2>&1)
  echo "graph check exit $?"; tail -n 14 "$OUT/graphs.txt"
fi
# the asyncio driver (the CUDA default) against the blocking one, same engines otherwise: TPOT side by
# side, greedy tokens identical (bench/async_vs_sync.py; compiled steps, CUDA graphs)
if [[ $CHECKS == *async* ]]; then
  (cd /tmp && timeout 200 python3 "$REPO/bench/async_vs_sync.py" --device cuda --policies specter \
     --workloads default --prompts 2 --rounds 1 --max-new-tokens 32 > "$OUT/async.txt" 2>&1)
  echo "async check exit $?"; tail -n 4 "$OUT/async.txt"
fi
if [[ $CHECKS == *bench* ]]; then
  for r in 0.25 1.0; do
    (cd /tmp && timeout 100 python3 -m specter.cli bench --device cuda --residency $r --repeat 2 \
       > "$OUT/bench-$r.txt" 2>&1)
    echo "bench residency $r exit $?"; head -n 9 "$OUT/bench-$r.txt"; tail -n 7 "$OUT/bench-$r.txt"
  done
fi
# fused_moe's kernels (bench/test_kernels.py): GB/s and share of HBM bandwidth for bf16 and INT4
# experts of Mixtral-8x7B, Qwen3-30B-A3B and DeepSeek-V2-Lite at T = 1, 8, 33, beside the
# per-expert loop and quanto's INT4 matmul (goal: >= 70% of HBM at T = 1). The compiled-kernel
# tests (tests/test_triton_ops.py -k cuda) run in the pytest check above.
if [[ $CHECKS == *kernels* ]]; then
  (cd /tmp && timeout 240 python3 -m pytest -q -s -p no:cacheprovider "$REPO/bench/test_kernels.py" \
     > "$OUT/kernels.txt" 2>&1)
  echo "kernels exit $?"; grep -A 40 "^model " "$OUT/kernels.txt" || tail -n 30 "$OUT/kernels.txt"
fi
