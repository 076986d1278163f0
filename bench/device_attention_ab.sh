#!/usr/bin/env bash
# Decode attention, old kernel against new, in one device call (session 11, 2026-11-30). Repo root on the GPU
# machine; carry .whl, .models and .ab_old (`git archive OLD src bench/decode.py bench/kernels_attention.py | tar -x -C .ab_old`).
#   the old tree's attention benchmark, the new tree's sweep (invariant_rows 8 / 16 / 0), the old one again
#   (to bracket the device's drift), GPU tests of the kernel, then whole decode steps old vs new
#   (bench/device_gemv_ab.sh, Q4_K).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 COBATCH_CUT_MODEL=${COBATCH_CUT_MODEL:-.models/smollm2-6l.gguf}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/old1" "$OUT/old2" "$OUT/new"
old_bench() {
  OUT=$OUT/$1 PYTHONPATH=/tmp/site:.ab_old/src timeout 120 python3 .ab_old/bench/kernels_attention.py 2>&1 \
    | grep -v Warning | tee "$OUT/attention-$1.log" | sed -n '/decode    B/,/prefill/p'
}
old_bench old1
OUT=$OUT/new ATTN_BATCHES=1,4,8,16,64 SWEEP_PREFILL=0 SWEEP_BUDGET_S=200 timeout 240 python3 bench/kernels_attention.py \
  --sweep 2>&1 | grep -v Warning | tee "$OUT/attention-new.log" | grep -E "^decode variant|^    us"
old_bench old2
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -rs -p no:cacheprovider tests/test_attention_kernels.py \
  tests/test_gemma.py tests/test_gpu_engine.py -k "${K:-llama8b or bitwise or cuda_graph_replay or gemma_shapes or \
  speculative or gemma and gpu}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
[ "${DECODE_AB:-1}" = 1 ] && QUANT=q4_k bash bench/device_gemv_ab.sh .ab_old . 1 > /dev/null 2>&1
tail -30 "$OUT/ab.log" 2>/dev/null | grep -E "^==|ctx .*graph"
