#!/usr/bin/env bash
# One device call: the serving benchmark against the engine alone (same configuration, decode steps only),
# on a random-weight Llama-3-8B q8_0, without and with --dense-large-batch.
#   bench/device_serve.sh        (run from the repo root on the GPU machine; carry .whl and .models)
# About 4-5 minutes on an H200. Each piece has its own timeout, and all end by BUDGET_S (default 400 s)
# after the start; bench/serve.py rewrites its JSON after every stage, so a piece cut short still leaves
# what it measured.
# Leaves in $OUT: gpu.txt, serve-q8_0.{json,log}, serve-q8_0-dense.{json,log} (the log ends with the server's).
set -uo pipefail
DEADLINE=$((SECONDS + ${BUDGET_S:-400}))
left() {    # min(arg, seconds left), at least 1 (timeout 0 would mean no limit)
  local t=$((DEADLINE - SECONDS)); [ "$t" -gt "$1" ] && t=$1; [ "$t" -lt 1 ] && t=1; echo "$t"
}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
MODEL=${MODEL:-/tmp/l3.gguf}
[ -f "$MODEL" ] || timeout "$(left 150)" python3 -m cobatch.testing.gguf_writer random --shape llama3-8b --quant q8_0 \
  --tokenizer-from .models/smollm2-6l.gguf -o "$MODEL" 2>&1 | tail -1
# 256 output tokens, 2 rounds: each round's steady window (all N streams decoding) spans ~250 steps.
COMMON=(--model "$MODEL" --device cuda --parallel 64 --kv-cache-gb 40 --levels 1,8,32,64 --rounds 2
        --prompt-tokens 128 --output-tokens 256 --engine-baseline --load-timeout 120)

serve() {   # NAME TIMEOUT_S EXTRA_ARGS...
  local name=$1 limit=$2 dir=/tmp/serve-$1; shift 2
  rm -rf "$dir"; mkdir -p "$dir"
  OUT="$dir" timeout "$(left "$limit")" python3 bench/serve.py "${COMMON[@]}" "$@" 2>&1 | tee "$OUT/serve-$name.log"
  [ -f "$dir/serve.json" ] && cp "$dir/serve.json" "$OUT/serve-$name.json"
  [ -f "$dir/serve_server.log" ] && { echo "--- server log (tail)"; tail -c 3000 "$dir/serve_server.log"; } >> "$OUT/serve-$name.log"
}

serve q8_0 180 --stall-streams 0
serve q8_0-dense 400 --dense-large-batch          # with the stall test: 8 streams beside a 4096-token prompt

for name in q8_0 q8_0-dense; do
  echo "== $name"
  sed -n '/^stall:/p;/^server vs engine/,/^JSON/p' "$OUT/serve-$name.log"
done
