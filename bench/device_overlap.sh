#!/usr/bin/env bash
# Overlapped decode steps (engine.py, session 14, 2026-11-30). Repo root on the GPU machine; carry .whl and
# .models (smollm2-6l.gguf). PARTS (default tests,decode) picks the pieces:
#   tests   GPU tests: the engine on CUDA (tests/test_gpu_engine.py: graphs, speculation, constraints, overlap on
#           and off), the decode graphs' staged inputs, the MoE and Gemma models on CUDA.
#   decode  Whole decode steps, random Llama-3-8B Q4_K_M: bench/decode.py times every point overlapped (the
#           default) and not, in the same load, ROUNDS times.
#   serve   The serving benchmark (bench/serve.py: HTTP clients against `cobatch serve`, and the engine alone)
#           on the same model, with and without --no-async-scheduling.
set -uo pipefail
source bench/device_env.sh
write_llama8b_q4km
PARTS=${PARTS:-tests,decode}
if [[ $PARTS == *tests* ]]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_engine.py \
    tests/test_cuda_graph_inputs.py ${MORE_TESTS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
fi
wait $writer
if [[ $PARTS == *decode* ]]; then
  for round in $(seq 1 "${ROUNDS:-2}"); do
    OUT=$OUT/decode-$round timeout "${DECODE_TIMEOUT:-200}" python3 bench/decode.py --model /tmp/l8.gguf \
      --contexts "${CONTEXTS:-512,4096}" --batches "${BATCHES:-1,2,4,8,16,32,64}" --max-batch 64 --kv-cache-gb 40 \
      2>&1 | grep -v -E "Warning|warn_once|loading|capturing" > "$OUT/decode-$round.log"
    echo "== round $round"; grep -E "not overlapped |^copy" "$OUT/decode-$round.log" | tail -16
  done
fi
if [[ $PARTS == *serve* ]]; then
  for side in overlap plain; do
    extra=(); [ $side = plain ] && extra=(--no-async-scheduling)
    OUT=/tmp/serve-$side timeout "${SERVE_TIMEOUT:-200}" python3 bench/serve.py --model /tmp/l8.gguf --device cuda \
      --parallel 64 --kv-cache-gb 40 --levels "${LEVELS:-1,8,32,64}" --rounds 1 --prompt-tokens 128 \
      --output-tokens 256 --engine-baseline --load-timeout 120 --stall-streams 0 "${extra[@]}" \
      > "$OUT/serve-$side.log" 2>&1
    cp /tmp/serve-$side/serve.json "$OUT/serve-$side.json" 2>/dev/null
    echo "== serve $side"; sed -n '/^server vs engine/,/^JSON/p' "$OUT/serve-$side.log" | head -24
  done
fi
