#!/usr/bin/env bash
# Overlapped decode steps (engine.py, session 14, 2026-11-30). Repo root on the GPU machine; carry .whl and
# .models (smollm2-6l.gguf).
#   1. GPU tests: the engine on CUDA (tests/test_gpu_engine.py: graphs, speculation, constraints, overlap on
#      and off) and the decode graphs' staged inputs.
#   2. Whole decode steps, random Llama-3-8B Q4_K_M: bench/decode.py times every point overlapped (the
#      default) and not, in the same load, ROUNDS times.
set -uo pipefail
source bench/device_env.sh
write_llama8b_q4km
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_engine.py \
  tests/test_cuda_graph_inputs.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
wait $writer
for round in $(seq 1 "${ROUNDS:-2}"); do
  OUT=$OUT/decode-$round timeout "${DECODE_TIMEOUT:-200}" python3 bench/decode.py --model /tmp/l8.gguf \
    --contexts "${CONTEXTS:-512,4096}" --batches "${BATCHES:-1,2,4,8,16,32,64}" --max-batch 64 --kv-cache-gb 40 \
    2>&1 | grep -v -E "Warning|warn_once|loading|capturing" > "$OUT/decode-$round.log"
  echo "== round $round"; grep -E "not overlapped |^copy" "$OUT/decode-$round.log" | tail -16
done
