#!/usr/bin/env bash
# Device call for speculative decoding inside the decode graphs and batch-invariant decode attention
# (session 11, 2026-11-30). Repo root on the GPU machine; carry .whl and .models (smollm2-6l.gguf).
#   1. decode attention: invariant_rows 8 / 16 / 0 (ATTN=0 skips);
#   2. GPU tests (K selects; default: attention kernels, the graph with draft rows, batched = alone, gemma);
#   3. bench/speculative.py on the 6-layer SmolLM2 cut (real weights: lookup, oracle and wrong drafts) and on a
#      random Llama-3-8B Q4_K_M (oracle and wrong drafts: what a step's drafts cost); CAPS="8,16" tries caps.
set -uo pipefail
source bench/device_env.sh
write_llama8b_q4km
if [ "${ATTN:-1}" = 1 ]; then
  ATTN_BATCHES=1,4,8,16,64 SWEEP_PREFILL=0 SWEEP_BUDGET_S=200 timeout 240 python3 bench/kernels_attention.py --sweep \
    2>&1 | grep -v Warning | tee "$OUT/attention.log" | grep -E "^decode variant|^copy"
fi
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -rs -p no:cacheprovider tests/test_attention_kernels.py \
  tests/test_gpu_engine.py tests/test_moe.py tests/test_gemma.py \
  -k "${K:-llama8b or bitwise or cuda_graph_replay or gemma_shapes or speculative or batched_equals or graph_and_eager or gemma and gpu}" 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -4
OUT=$OUT/cut timeout 150 python3 bench/speculative.py --device cuda --model .models/smollm2-6l.gguf --tokens 96 \
  --batches 1,4,8 --drafts lookup,oracle,wrong 2>&1 | grep -v Warning > "$OUT/spec-cut.log"
wait $writer; tail -1 "$OUT/write.log"
OUT=$OUT/l8 timeout "${BENCH_TIMEOUT:-200}" python3 bench/speculative.py --device cuda --model /tmp/l8.gguf --tokens 64 \
  --batches ${L8_BATCHES:-1,2,4,8} --drafts oracle,wrong ${CAPS:+--step-rows $CAPS} 2>&1 | grep -v Warning \
  > "$OUT/spec-l8.log"
tail -20 "$OUT/spec-l8.log"
