#!/usr/bin/env bash
# A/B of two GEMV config tables on whole decode steps, in one device call, runs alternating:
#   bench/device_gemv_ab.sh OLD.json NEW.json [ROUNDS]   (repo root on the GPU machine; writes $OUT/ab.log)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m cobatch.gguf_writer random --shape llama3-8b --quant q8_0 --tokenizer-from .models/smollm2-6l.gguf \
  -o /tmp/m.gguf 2>&1 | tail -1
for round in $(seq 1 "${3:-2}"); do
  for side in old new; do
    table=$1; [ "$side" = new ] && table=$2
    echo "== round $round $side ($table)" | tee -a "$OUT/ab.log"
    OUT=/tmp/ab-$side-$round COBATCH_QUANT_CONFIGS=$table timeout 200 python3 bench/decode.py --model /tmp/m.gguf \
      --max-batch 8 2>&1 | sed -n '/^copy /,$p' | tee -a "$OUT/ab.log"
    cp /tmp/ab-$side-$round/decode.json "$OUT/decode-$side-$round.json"
  done
done
