#!/usr/bin/env bash
# Decode attention with split groups (DecodeConfig.split_group, session 13, 2026-11-30). Repo root on the GPU
# machine; carry .whl, .models (smollm2-6l.gguf) and .ab_old (`git archive OLD src bench/decode.py
# bench/kernels_attention.py | tar -x -C .ab_old`).
#   1. GPU tests: decode attention at real shapes (batch invariance bit for bit, graphs, PDL), the engine on CUDA.
#   2. bench/kernels_attention.py --sweep: split_group 4 (default) / 1 (a partial per split, as before) / 8, and
#      invariant_rows 0 (each batch its own plan: the bound without batch invariance); then the default table.
#   3. Whole decode steps, random Llama-3-8B Q4_K_M, old tree then new, context 4096, B = 1, 4, 8, 16.
# PART=ab: only whole decode steps, old / new alternating, ROUNDS rounds (B = 1, 4, 8); then OpenAI's Predicted
#   Outputs on the same model (bench/speculative.py --drafts predicted,edited,oracle, B = 1 and 8).
set -uo pipefail
source bench/device_env.sh
write_llama8b_q4km
decode() {   # decode SIDE TAG BATCHES
  local src=src script=bench/decode.py
  [ "$1" = old ] && src=.ab_old/src script=.ab_old/bench/decode.py
  OUT=$OUT/decode-$2 PYTHONPATH=/tmp/site:$src timeout "${DECODE_TIMEOUT:-150}" python3 $script --model /tmp/l8.gguf \
    --contexts 4096 --batches "$3" --max-batch 16 --kv-cache-gb 40 2>&1 \
    | grep -v -E "Warning|warn_once|loading|capturing" > "$OUT/decode-$2.log"
  echo "== $2"; grep -E "\(graph |^copy" "$OUT/decode-$2.log" | head -12
}
if [ "${PART:-all}" = ab ]; then
  wait $writer
  for round in $(seq 1 "${ROUNDS:-2}"); do
    decode old old-$round 1,4,8
    decode new new-$round 1,4,8
  done
  OUT=$OUT/spec timeout 240 python3 bench/speculative.py --device cuda --model /tmp/l8.gguf --tokens 96 --batches 1,8 \
    --drafts predicted,edited,oracle 2>&1 | grep -v -E "Warning|warn_once" | tee "$OUT/speculative.log" | tail -16
  exit 0
fi
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -rs -p no:cacheprovider tests/test_attention_kernels.py \
  tests/test_gpu_engine.py -k "${K:-llama8b or bitwise or cuda_graph_replay or gemma_shapes or batched_equals or speculative or \
  graph_and_eager}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
ATTN_BATCHES=${ATTN_BATCHES:-1,4,8,16} SWEEP_PREFILL=0 SWEEP_BUDGET_S=${SWEEP_BUDGET_S:-150} OUT=$OUT \
  timeout 240 python3 bench/kernels_attention.py --sweep 2>&1 | grep -v Warning | tee "$OUT/attention.log" \
  | grep -E "^decode variant|^    us|^copy|  [0-9]+ +[0-9]+ " | head -40
wait $writer
decode old old 1,4,8,16
decode new new 1,4,8,16
