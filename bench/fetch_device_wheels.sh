#!/usr/bin/env bash
# The wheels bench/device_check.sh carries to the GPU machine, fetched here into .whl/ (git-ignored),
# for the machine's Python (3.12, x86-64). Run once in the repo root, where pip can reach an index:
#   bash bench/fetch_device_wheels.sh
# then pass carry [".whl"] to the device tool's run (see the header of bench/device_check.sh).
#
# What the GPU image lacks that the engine needs at run time: optimum-quanto (pure Python; the draft
# is packed with its quantizer). Its own needs (torch, numpy, safetensors, ninja, huggingface_hub)
# are in the image. The server's packages (fastapi, sse-starlette, uvicorn) and the test client's
# (openai) are not carried: fastapi and openai need pydantic-core and jiter, compiled wheels, and
# the server has no CUDA path; tests/test_server.py skips there.
set -euo pipefail
cd "$(dirname "$0")/.."
# name==version per line; bench/device_check.sh reads the same list and stops if one is missing
WHEELS=$(sed -n 's/^# wheel: //p' bench/device_check.sh)
[[ -n $WHEELS ]] || { echo "no '# wheel:' lines in bench/device_check.sh" >&2; exit 1; }
mkdir -p .whl
for spec in $WHEELS; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$spec"
done
ls -l .whl
