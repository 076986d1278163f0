#!/usr/bin/env bash
# One device call for programmatic dependent launch: GPU tests of the kernels it touches (and of the engine
# against the CPU path), then bench/pdl_study.py and the decode-attention sweep.
#   bench/device_pdl.sh        (run from the repo root on the GPU machine; carry .whl and .models)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
COBATCH_CUT_MODEL=.models/smollm2-6l.gguf timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider \
  ${TESTS:-tests/test_attention_kernels.py tests/test_gpu_engine.py tests/test_quant_gemv.py tests/test_kernels_small.py} 2>&1 \
  | tail -15 | tee "$OUT/gpu_tests.log"
timeout ${PDL_TIMEOUT:-200} python3 bench/pdl_study.py --date "${DATE:-$(date +%F)}-pdl" 2>&1 | tail -25 | tee "$OUT/pdl.log"
SWEEP_BUDGET_S=${SWEEP_BUDGET_S:-50} timeout 100 python3 bench/kernels_attention.py --sweep 2>&1 | tail -30 | tee "$OUT/attn.log"
cp bench/results/pdl-*.json "$OUT/" 2>/dev/null
