#!/usr/bin/env bash
# One device call for the model families and attention variants added on the CPU in session 8 (2026-11-29):
# the GPU tests of phi3, gemma2/3, MoE and the attention window / soft cap at real shapes, then the attention
# benchmark (the decode kernel gained a window and a cap argument: its numbers should not move).
#   COBATCH_CUT_MODEL=.models/smollm2-6l.gguf bench/device_models.sh     (repo root on the GPU machine; carry .whl, .models)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rs -p no:cacheprovider tests/test_phi3.py tests/test_gemma.py \
  tests/test_moe.py tests/test_attention_kernels.py tests/test_kernels_small.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
timeout ${BENCH_TIMEOUT:-200} python3 bench/kernels_attention.py 2>&1 | grep -v Warning | tee "$OUT/attention.log"
