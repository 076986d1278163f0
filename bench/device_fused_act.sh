#!/usr/bin/env bash
# Device calls for the act*mul epilogue of the gate|up GEMV (session 10, 2026-11-30). Repo root on the GPU
# machine; carry .whl, .models and .ab_old (the tree before: `git archive OLD src bench/decode.py
# bench/moe_decode.py | tar -x -C .ab_old`).
#   bench/device_fused_act.sh tests     GPU tests of the GEMV, the MoE path and the models against the CPU path
#   bench/device_fused_act.sh moe       MoE decode, old tree then new (Qwen3-30B-A3B shape, LAYERS of 48 layers)
# The dense A/B is bench/device_gemv_ab.sh (QUANT=q4_k bench/device_gemv_ab.sh .ab_old . 2).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 COBATCH_CUT_MODEL=${COBATCH_CUT_MODEL:-.models/smollm2-6l.gguf}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
case "$1" in
tests)
  timeout ${TEST_TIMEOUT:-480} python3 -m pytest -q -rs -p no:cacheprovider \
    tests/test_quant_gemv.py tests/test_moe_routing.py tests/test_moe.py tests/test_gpu_engine.py \
    tests/test_gemma.py tests/test_phi3.py "tests/test_quant_matmul.py::test_interleaved_gate_up_with_act_equals_act_of_the_plain_matmuls" \
    tests/test_kernels_small.py -k "${K:-not gemv_dequantize}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
moe)
  python3 -m cobatch.testing.gguf_writer random --shape qwen3-30b-a3b --quant q4_k_m --layers "${LAYERS:-12}" \
    --tokenizer-from .models/smollm2-6l.gguf -o /tmp/moe.gguf 2>&1 | tail -1
  for side in old new; do
    dir=.; [ "$side" = old ] && dir=.ab_old
    echo "== $side ($dir)" | tee -a "$OUT/moe_ab.log"
    OUT=/tmp/moe-$side timeout ${BENCH_TIMEOUT:-240} env PYTHONPATH=/tmp/site python3 "$dir/bench/moe_decode.py" \
      --model /tmp/moe.gguf --max-batch "${MAX_BATCH:-256}" 2>&1 | grep -v Warning | tee -a "$OUT/moe_ab.log"
    cp /tmp/moe-$side/moe_decode.json "$OUT/moe-decode-$side.json"
  done ;;
esac
