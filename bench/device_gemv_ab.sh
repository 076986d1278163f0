#!/usr/bin/env bash
# A/B on whole decode steps, in one device call, runs alternating. Each side is either a GEMV config table
# (a .json, run with this tree's code) or a source tree (a directory holding src/ and bench/decode.py, e.g.
# from `git archive OLD src bench/decode.py | tar -x -C .ab_old`), run with its own code and table:
#   QUANT=q4_1 bench/device_gemv_ab.sh OLD NEW [ROUNDS]   (repo root on the GPU machine; writes $OUT/ab.log)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m cobatch.testing.gguf_writer random --shape llama3-8b --quant "${QUANT:-q8_0}" \
  --tokenizer-from .models/smollm2-6l.gguf -o /tmp/m.gguf 2>&1 | tail -1
for round in $(seq 1 "${3:-2}"); do
  for side in old new; do
    arg=$1; [ "$side" = new ] && arg=$2
    echo "== round $round $side ($arg)" | tee -a "$OUT/ab.log"
    if [ -d "$arg" ]; then   # a tree: its decode.py puts its own src first on the path
      cmd=(env PYTHONPATH=/tmp/site python3 "$arg/bench/decode.py")
    else
      cmd=(env COBATCH_QUANT_CONFIGS="$arg" python3 bench/decode.py)
    fi
    OUT=/tmp/ab-$side-$round timeout 200 "${cmd[@]}" --model /tmp/m.gguf --max-batch 8 2>&1 \
      | sed -n '/^copy /,$p' | tee -a "$OUT/ab.log"
    cp /tmp/ab-$side-$round/decode.json "$OUT/decode-$side-$round.json"
  done
done
