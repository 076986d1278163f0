#!/usr/bin/env bash
# One device call: the size ceiling (bench/size_ceiling.py; SKIP_SIZE=1 skips it), GPU tests named in TESTS, then the decode step (bench/decode.py, B <= 8, random Llama-3-8B q8_0) with programmatic
# dependent launch off and on, each in its own process (the graphs are captured with the setting).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -z "${SKIP_SIZE:-}" ]; then
  timeout 100 python3 bench/size_ceiling.py --date "${DATE:-$(date +%F)}" 2>&1 | tail -14 | tee "$OUT/size.log"
  cp bench/results/size-ceiling-*.json "$OUT/" 2>/dev/null
fi
if [ -n "${TESTS:-}" ]; then
  COBATCH_CUT_MODEL=.models/smollm2-6l.gguf timeout ${TEST_TIMEOUT:-220} python3 -m pytest -q -p no:cacheprovider $TESTS 2>&1 \
    | tail -15 | tee "$OUT/gpu_tests.log"
fi
python3 -m cobatch.testing.gguf_writer random --shape llama3-8b --quant q8_0 --tokenizer-from .models/smollm2-6l.gguf \
  -o /tmp/llama3-8b-q8_0.gguf 2>&1 | tail -1
for pdl in 0 1; do
  mkdir -p "$OUT/pdl$pdl"
  COBATCH_PDL=$pdl OUT="$OUT/pdl$pdl" timeout ${BENCH_TIMEOUT:-200} python3 bench/decode.py \
    --model /tmp/llama3-8b-q8_0.gguf --max-batch ${MAX_BATCH:-8} 2>&1 | tail -14 | tee "$OUT/decode-pdl$pdl.log"
done
