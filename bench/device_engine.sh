#!/usr/bin/env bash
# One device call: GPU engine tests against the CPU path, then the decode benchmark.
#   bench/device_engine.sh [q8_0,q4_k] [--hf-peer]     (run from the repo root on the GPU machine)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
QUANTS=${1:-q8_0}; shift || true
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  COBATCH_CUT_MODEL=.models/smollm2-6l.gguf timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -rA -p no:cacheprovider ${TESTS:-tests/test_gpu_engine.py} 2>&1 | grep -v "^PASSED" | tee "$OUT/gpu_tests.log"
fi
models=()
for q in ${QUANTS//,/ }; do
  python3 -m cobatch.testing.gguf_writer random --shape llama3-8b --quant "$q" --tokenizer-from .models/smollm2-6l.gguf -o "/tmp/llama3-8b-$q.gguf" 2>&1 | tail -1
  models+=(--model "/tmp/llama3-8b-$q.gguf")
done
timeout ${BENCH_TIMEOUT:-400} python3 bench/decode.py "${models[@]}" "$@" 2>&1 | tee "$OUT/decode.log"
