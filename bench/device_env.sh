# The prologue of bench/device.sh, run from the repo root on the GPU machine (carry .whl and .models; see
# docs/development.md): the carried wheels on the path, $OUT made, and helpers for the suites.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 COBATCH_CUT_MODEL=${COBATCH_CUT_MODEL:-.models/smollm2-6l.gguf}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TOKENIZER=${TOKENIZER:-.models/smollm2-6l.gguf}

# random_model SHAPE QUANT [LAYERS]: the path of a random-weight model of that shape, written once per machine
# by `cobatch make-model` (this tree's writer, whichever tree is benchmarked).
random_model() {
  local shape=$1 quant=$2 layers=${3:-} path
  path=/tmp/$shape-$quant${layers:+-${layers}l}.gguf
  if [ ! -f "$path" ]; then
    python3 -m cobatch.cli make-model random --shape "$shape" --quant "$quant" ${layers:+--layers "$layers"} \
      --tokenizer-from "$TOKENIZER" -o "$path.tmp" > "$OUT/make-model-$shape-$quant.log" 2>&1 && mv "$path.tmp" "$path"
    # write the file back to disk now, not under the benchmark that loads it: the host-timed prefill of a run
    # started right after 13 GB of fresh files took 3x its usual time in all three samples
    sync "$path" 2>/dev/null || sync
  fi
  echo "$path"
}

# random_models SHAPE QUANT...: random_model for each quant, the missing files written side by side (the writer is
# one process a file, mostly single-threaded), then their paths one a line in the quants' order.
random_models() {
  local shape=$1 q; shift
  for q in "$@"; do random_model "$shape" "$q" > /dev/null & done
  wait
  for q in "$@"; do random_model "$shape" "$q"; done
}

# quiet: drop the lines of warnings and progress that every benchmark prints.
quiet() { grep -v -E "Warning|warn_once|^loading|^capturing"; }

# left SECONDS: min(SECONDS, what is left of BUDGET_S since the start), at least 1 (timeout 0 means no limit).
DEADLINE=$((SECONDS + ${BUDGET_S:-3600}))
left() {
  local t=$((DEADLINE - SECONDS)); [ "$t" -gt "$1" ] && t=$1; [ "$t" -lt 1 ] && t=1; echo "$t"
}
