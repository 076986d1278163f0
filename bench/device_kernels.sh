#!/usr/bin/env bash
# One device call for the quantized-matmul kernels: probe, GPU tests, then the benchmark (+ sweep).
#   bench/device_kernels.sh [bench/kernels.py args...]      (run from the repo root on the GPU machine)
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
if ! timeout 120 python3 bench/gemv_probe.py 2>&1 | tee "$OUT/probe.log"; then
  [ -n "${FORCE:-}" ] || { echo "probe failed: skipping tests and benchmark"; exit 1; }
fi
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -x -p no:cacheprovider ${TESTS:-tests/test_quant_gemv.py} 2>&1 \
    | tail -40 | tee "$OUT/gpu_tests.log"
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout ${BENCH_TIMEOUT:-400} python3 bench/kernels.py "$@" 2>&1 | tee "$OUT/kernels.log"
fi
# Only a few files come back from the device: drop the crash-recovery copy once the full result exists.
if ls "$OUT"/kernels-*.json 2>/dev/null | grep -qv partial; then rm -f "$OUT/kernels-partial.json"; fi
