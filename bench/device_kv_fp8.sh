#!/usr/bin/env bash
# Device calls for the fp8 KV cache (--kv-cache-dtype fp8, session 12, 2026-11-30). Repo root on the GPU machine;
# carry .whl and .models (smollm2-6l.gguf).
#   PART=tests:  the GPU tests of the fp8 reads and writes (attention kernels, rope / kv_write, the engine against
#                the CPU path) and the bf16 ones they sit beside; then decode attention, bf16 and fp8 caches, in one
#                bench/kernels_attention.py run (GB/s of the cache's bytes, ratio to a copy measured in the run).
#   PART=capacity: fp8 KV at 32k context with 16, 24 and 32 sessions (a bf16 cache of the same 72 GiB holds 16).
#   PART=pdl:    graph replay time with programmatic dependent launch off and on (COBATCH_PDL=0/1), bf16 and fp8 KV,
#                context 4096, B = 1 and 8 (an fp8 cache's graph was 0.2-0.3 ms slower than bf16's at B = 1).
#   PART=decode: whole decode steps of a random Llama-3-8B Q4_K_M, KV cache bf16 then fp8 (each its own load),
#                at contexts 4096 and 32768 (graphs captured for 32k), then bf16 at 4096 with graphs captured for 4k
#                (bench/decode.py).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 COBATCH_CUT_MODEL=${COBATCH_CUT_MODEL:-.models/smollm2-6l.gguf}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ "${PART:-tests}" = tests ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -rs -p no:cacheprovider tests/test_attention_kernels.py \
    tests/test_kernels_small.py tests/test_gpu_engine.py \
    -k "${K:-fp8 or llama8b or bitwise or cuda_graph_replay or batched_equals or graph_and_eager}" 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -4
  ATTN_KV_DTYPES=bf16,fp8 ATTN_BATCHES=${ATTN_BATCHES:-1,8,64} timeout 240 python3 bench/kernels_attention.py 2>&1 \
    | grep -v Warning | tee "$OUT/attention.log" | tail -24
elif [ "${PART}" = pdl ]; then
  python3 -m cobatch.testing.gguf_writer random --shape llama3-8b --quant q4_k_m \
    --tokenizer-from .models/smollm2-6l.gguf -o /tmp/l8.gguf > "$OUT/write.log" 2>&1
  for pdl in 0 1; do
    COBATCH_PDL=$pdl OUT=$OUT/pdl$pdl timeout 200 python3 bench/decode.py --model /tmp/l8.gguf --kv-cache-dtype auto,fp8 \
      --contexts 4096 --batches 1,8 --max-batch 8 --kv-cache-gb 40 2>&1 | grep -v -E "Warning|warn_once|loading|capturing" \
      > "$OUT/decode-pdl$pdl.log"
    echo "== COBATCH_PDL=$pdl"; grep -E "graph  " "$OUT/decode-pdl$pdl.log"
  done
elif [ "${PART}" = capacity ]; then
  python3 -m cobatch.testing.gguf_writer random --shape llama3-8b --quant q4_k_m \
    --tokenizer-from .models/smollm2-6l.gguf -o /tmp/l8.gguf > "$OUT/write.log" 2>&1
  timeout "${BENCH_TIMEOUT:-300}" python3 bench/decode.py --model /tmp/l8.gguf --kv-cache-dtype fp8 --contexts 32768 \
    --batches 16,24,32 --max-batch 32 --kv-cache-gb 72 2>&1 \
    | grep -v -E "Warning|warn_once|loading|capturing" | tee "$OUT/decode-capacity.log" | tail -30
else
  python3 -m cobatch.testing.gguf_writer random --shape llama3-8b --quant q4_k_m \
    --tokenizer-from .models/smollm2-6l.gguf -o /tmp/l8.gguf > "$OUT/write.log" 2>&1
  tail -1 "$OUT/write.log"
  timeout "${BENCH_TIMEOUT:-420}" python3 bench/decode.py --model /tmp/l8.gguf --kv-cache-dtype auto,fp8 \
    --contexts ${CONTEXTS:-4096,32768} --batches ${BATCHES:-1,4,8,16} --max-batch 16 --kv-cache-gb 72 2>&1 \
    | grep -v -E "Warning|warn_once|loading|capturing" | tee "$OUT/decode.log" | tail -40
  # the same steps with graphs captured for 4k only: what the 32k-capacity rows at 4k should match
  OUT=$OUT/cap4k timeout 200 python3 bench/decode.py --model /tmp/l8.gguf --contexts 4096 \
    --batches ${BATCHES:-1,4,8,16} --max-batch 16 --kv-cache-gb 72 2>&1 \
    | grep -v -E "Warning|warn_once|loading|capturing" | tee "$OUT/decode-cap4k.log" | tail -8
fi
