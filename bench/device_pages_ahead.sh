#!/usr/bin/env bash
# Decode/prefill attention with the next tile's pages loaded a tile ahead (session 15, 2026-11-30), and the kernel
# benchmarks' new timing (bench/timing.py: replays queued behind a GPU sleep). Repo root on the GPU machine; carry
# .whl, .models and .ab_old (`git archive OLD src | tar -x -C .ab_old`).
#   1. GPU tests of the attention kernels (batch invariance bit for bit, graphs, PDL, real shapes).
#   2. ROUNDS rounds of: the old kernels (.ab_old/src) through this tree's benchmark (the same timing, both ways:
#      queued / idle stream), then this tree's sweep (ATTN_BATCHES; its DECODE_SWEEP and PREFILL_SWEEP) and its
#      default table.
set -uo pipefail
source bench/device_env.sh
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -rs -p no:cacheprovider tests/test_attention_kernels.py 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -3
for round in $(seq 1 "${ROUNDS:-2}"); do
  mkdir -p "$OUT/old-$round" "$OUT/new-$round"
  OUT=$OUT/old-$round PYTHONPATH=/tmp/site:.ab_old/src ATTN_BATCHES=${ATTN_BATCHES:-1,4,8,16,64} timeout 150 \
    python3 bench/kernels_attention.py 2>&1 | grep -v Warning > "$OUT/attention-old-$round.log"
  echo "== old, round $round"; sed -n '/decode  /,$p' "$OUT/attention-old-$round.log" | cut -c1-80
  OUT=$OUT/new-$round ATTN_BATCHES=${ATTN_BATCHES:-1,4,8,16,64} SWEEP_BUDGET_S=${SWEEP_BUDGET_S:-200} timeout 330 \
    python3 bench/kernels_attention.py --sweep 2>&1 | grep -v Warning > "$OUT/attention-new-$round.log"
  echo "== new, round $round"; grep -E "capacity|^decode variant|^    us|^prefill variant" "$OUT/attention-new-$round.log" \
    | cut -c1-400
done
