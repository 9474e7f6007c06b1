#!/usr/bin/env bash
# One run on a lent GPU machine (no network there): the carried wheels, then `run.py --check`, then the suite;
# both outputs land under $OUT (check.txt, suite.txt). Prepare the wheels here first, once, in the repo root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl llguidance   # the engine's grammar library: the GPU machine's image lacks it
# and run this with `.whl` carried: `bash benchmarks/gpu/device.sh` (about 3 + 8 minutes on one H200).
set -o pipefail
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-/tmp/gpu-suite}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
timeout 200 python3 benchmarks/gpu/run.py --check 2>&1 | tee "$out/check.txt"
timeout 500 python3 benchmarks/gpu/run.py 2>&1 | tee "$out/suite.txt"
