#!/usr/bin/env bash
# One device call for the device-routed MoE experts (session 9, 2026-11-29): the GPU tests of the routed GEMV,
# the MoE models and the GEMV they share with dense models, then bench/moe_decode.py on a cut of the
# Qwen3-30B-A3B shape (Q4_K_M, random weights, LAYERS of 48 layers; MAX_BATCH up to 256).
#   COBATCH_CUT_MODEL=.models/smollm2-6l.gguf bench/device_moe.sh     (repo root on the GPU machine; carry .whl, .models)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m cobatch.testing.gguf_writer random --shape qwen3-30b-a3b --quant q4_k_m --layers "${LAYERS:-12}" \
  --tokenizer-from .models/smollm2-6l.gguf -o /tmp/moe.gguf 2>&1 | tail -1 &
# TESTS (pytest arguments) replaces the default selection
DEFAULT_TESTS=(tests/test_moe_routing.py tests/test_moe.py "tests/test_gemma.py::test_gemma2_config_and_logits_match_transformers"
  tests/test_quant_gemv.py -k "not gemv_dequantize and (routed or route or combine or slots or moe or gemma2 or odd_shapes or bitwise or engine or logits or layer)")
if [ -n "${TESTS:-}" ]; then read -r -a SELECTED <<< "$TESTS"; else SELECTED=("${DEFAULT_TESTS[@]}"); fi
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rs -p no:cacheprovider "${SELECTED[@]}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
wait
timeout ${BENCH_TIMEOUT:-240} python3 bench/moe_decode.py --model /tmp/moe.gguf --max-batch ${MAX_BATCH:-64} 2>&1 | grep -v Warning | tee "$OUT/moe_decode.log"
