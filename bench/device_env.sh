# Sourced by the bench/device_*.sh scripts (repo root on the GPU machine; carry .whl and .models): the carried
# wheels on the path, $OUT made, and write_llama8b_q4km starting a random Llama-3-8B Q4_K_M at /tmp/l8.gguf in the
# background (its pid in $writer; `wait $writer` before using it).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 COBATCH_CUT_MODEL=${COBATCH_CUT_MODEL:-.models/smollm2-6l.gguf}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
write_llama8b_q4km() {
  python3 -m cobatch.testing.gguf_writer random --shape llama3-8b --quant q4_k_m \
    --tokenizer-from .models/smollm2-6l.gguf -o /tmp/l8.gguf > "$OUT/write.log" 2>&1 &
  writer=$!
}
