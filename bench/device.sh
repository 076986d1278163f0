#!/usr/bin/env bash
# One entry point for the GPU machine: bench/device.sh SUITE [ARGS]. Run from the repo root there, carrying
# .whl (the pure-Python wheels the image lacks), .models (smollm2-6l.gguf) and, for `ab` against an old tree,
# that tree (`git archive OLD src bench | tar -x -C .ab_old`). docs/development.md has the workflow.
# Everything lands in $OUT (default /tmp/out).
#
#   tests [PYTEST ARGS]      the GPU tests against the CPU path (default: every test file with CUDA tests but the CUDA
#                            C++ GEMM's, which its suite runs: gemm-cuda)
#   kernels [ARGS]           GEMV probe, the GEMV tests, then bench/kernels.py ARGS (e.g. --sweep)
#   gemm [ARGS]              the quantized GEMM's tests, then bench/gemm.py ARGS (every config at 16-256 tokens;
#                            writes the chosen configs merged into quant_configs.json, to $OUT and bench/results)
#   gemm-cuda [ARGS]         the CUDA C++ GEMM's tests, then bench/gemm_cuda.py ARGS (its candidates against the plans;
#                            --probe: where its time goes), to $OUT and bench/results
#   attention [ARGS]         bench/kernels_attention.py ARGS (ATTN_BATCHES, ATTN_KV_DTYPES, SWEEP_* in the env)
#   decode [ARGS]            bench/decode.py ARGS on random Llama-3-8B files, one per QUANT (default q4_k_m;
#                            e.g. QUANT=q8_0,q4_k_m); ARGS such as --contexts, --batches, --kv-cache-dtype auto,fp8
#   serve [ARGS]             bench/serve.py: streaming HTTP clients against `cobatch serve`, and the engine alone
#   moe [ARGS]               bench/moe_decode.py on MOE_SHAPE (default qwen3-30b-a3b; deepseek-v2-lite for DeepSeek's)
#                            cut to LAYERS (default 12; 48 and 27 in full)
#   moe-experts [ARGS]       bench/moe_experts.py: one MoE layer's experts each way (expert by expert, routed slices,
#                            the routed GEMM's configs) on MOE_SHAPE cut to LAYERS (default 2: one MoE layer)
#   speculative [ARGS]       bench/speculative.py ARGS on MODEL (default the random Llama-3-8B Q4_K_M)
#   hf [ARGS]                bench/hf_load.py: a random Llama-3-8B bf16 checkpoint folder quantized on load (q8_0)
#                            against the random Llama-3-8B q8_0 GGUF: load time and decode steps
#   parallel [ARGS]          bench/parallel.py on 2 GPUs (nvidia-h200-x2): the decode step at TP 1 and 2 (ARGS), then
#                            serving at DP 1 and 2; MODEL (default the random Llama-3-8B)
#   prefill [ARGS]           the prefill graphs' GPU tests, then bench/prefill_host.py ARGS (default --tokens
#                            128,512 --graphs --beside 0,8,64 --cut: each step eager and replayed, one process) on
#                            MODEL (default the random Llama-3-8B q8_0 cut to LAYERS, default 8), to $OUT
#   size                     bench/size_ceiling.py: what one kernel moving N bytes reaches
#   sampler [ARGS]           the sampler's GPU tests (the top-p and top-k kernels' too), then bench/sampler.py ARGS: the
#                            token-pick and filter kernels alone, then whole sampler calls (greedy and sampled), each
#                            way (e.g. --params "T=0.7 top_p=0.9,llama.cpp's"; --warps 4,16: the filters' warps)
#   penalties [ARGS]         the overlapped steps' GPU tests, then bench/penalties_ahead.py ARGS (default --batches
#                            1,64) on MODEL (default the random Llama-3-8B q8_0): steps with none, one or all sessions
#                            penalized, planned ahead on the device or waiting for the host
#   gemv-configs ARGS        bench/gemv_configs.py ARGS: time given GEMV tile configs
#   profile "FMT SHAPE N"... Nsight Compute stall profiles of the committed GEMV plan's launches ("gemm FMT SHAPE N":
#                            the quantized GEMM's, bench/gemm_once.py; "gemm-source FMT SHAPE N": its stall
#                            samples per SASS instruction, bench/ncu_source.py)
#   model-plans [ARGS]       bench/model_gemv_plans.py on MODEL (default a random file of SHAPE or MOE_SHAPE, e.g.
#                            qwen2.5-7b; qwen3-30b-a3b; in QUANT, cut to LAYERS: default full depth): GEMV plans for its
#                            own shapes (ARGS: --budget-s), then
#                            bench/plan_ab.py on it, the package's table against the one written (BATCHES, default
#                            1,8,16,64), to $OUT
#   plan-ab TABLES [ARGS]    bench/plan_ab.py on MODEL (default a random file of SHAPE, default llama3-8b, in QUANT,
#                            cut to LAYERS): whole decode steps under each plan table (comma-separated
#                            quant_configs.json paths, `.` the package's), the model loaded once, the tables
#                            alternating (ARGS: --batches, --rounds, --context; --ring-depths, --gemm-from,
#                            --without-gemv, --switch and --knockout add generated variants: bench/plan_ab.py)
#   phases [ARGS]            bench/step_phases.py on MODEL (default a random file of SHAPE, default llama3-8b, in QUANT,
#                            cut to LAYERS): one graph replay's kernels by phase (each matrix, attention, norms),
#                            GB/s and idle time, and a middle layer's kernels in order (ARGS: --batches, --context)
#   ab OLD NEW [ROUNDS]      a benchmark (BENCH: decode, the default; attention, moe, serve, speculative) run with
#                            OLD then NEW, alternating, ROUNDS times (default 2). A side is a tree (a directory
#                            holding src/ and bench/), a GEMV config table (.json, this tree's code), an environment
#                            setting (COBATCH_PDL=0), a flag of the benchmark (--no-async-scheduling), or `.`
#                            (this tree as it is). ARGS after ROUNDS go to the benchmark.
#
# Environment: MODEL (a GGUF instead of the random Llama-3-8B), QUANT, LAYERS, MOE_SHAPE, SHAPE, TIMEOUT (seconds per
# benchmark run, default 400), TEST_TIMEOUT (default 480), BUDGET_S (all runs end by then, default 3600).
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^$/p' "$0" | sed -n '/^#/s/^# \{0,1\}//p'; }
SUITES=" tests kernels gemm gemm-cuda attention decode serve moe moe-experts speculative hf parallel size "
SUITES+="sampler penalties prefill "
SUITES+="gemv-configs profile model-plans plan-ab phases ab "
SUITE=${1:-}
if [ -z "$SUITE" ] || [ "$SUITE" = help ] || [ "$SUITE" = -h ]; then usage; exit 2; fi
if [[ $SUITES != *" $SUITE "* ]]; then echo "bench/device.sh: unknown suite '$SUITE'" >&2; usage >&2; exit 2; fi
shift

source bench/device_env.sh
TIMEOUT=${TIMEOUT:-400}
QUANT=${QUANT:-q4_k_m}
GPU_TEST_FILES=(tests/test_quant_gemv.py tests/test_quant_gemm.py tests/test_quant_matmul.py tests/test_kernels_small.py
  tests/test_attention_kernels.py tests/test_moe_routing.py tests/test_moe.py tests/test_gpu_engine.py
  tests/test_cuda_graph_inputs.py tests/test_gemma.py tests/test_phi3.py tests/test_sampler.py tests/test_mla_attention.py
  tests/test_mla_decode_cuda.py tests/test_deepseek.py tests/test_hf_checkpoints.py tests/test_lora.py
  tests/test_fp8_cache.py tests/test_greedy.py tests/test_mla_value.py
  tests/test_top_p.py tests/test_top_k.py tests/test_mla_latent.py tests/test_lora_kernels.py)

llama8b() { echo "${MODEL:-$(random_model llama3-8b "${QUANT%%,*}")}"; }

# run_tests [PYTEST ARGS]: each test's result is logged as it ends (-v), so a run cut by its timeout still names its
# failures; the console gets those, the tracebacks' last lines and the summary. Without arguments: every GPU test
# file on 8 workers (about 4 minutes on an H100).
run_tests() {
  local args=("$@"); [ ${#args[@]} -eq 0 ] && args=(-n 8 --dist load "${GPU_TEST_FILES[@]}")
  timeout "$(left "${TEST_TIMEOUT:-480}")" python3 -m pytest -v --tb=short -rs -p no:cacheprovider "${args[@]}" \
    > "$OUT/gpu_tests.log" 2>&1
  echo "pytest exit status $?"
  grep -E "^(FAILED|ERROR)|^E |passed|failed" "$OUT/gpu_tests.log" | grep -v "PASSED" | tail -25
}

# bench_cmd BENCH TREE: the command line that runs benchmark BENCH with the code of TREE (a directory).
bench_cmd() {
  local script
  case $1 in
    decode) script=decode.py ;; attention) script=kernels_attention.py ;; moe) script=moe_decode.py ;;
    serve) script=serve.py ;; speculative) script=speculative.py ;;
    *) echo "bench/device.sh: unknown BENCH '$1'" >&2; return 2 ;;
  esac
  echo "env PYTHONPATH=/tmp/site:$2/src python3 $2/bench/$script"
}

# bench_model_args BENCH: the model arguments each benchmark takes.
bench_model_args() {
  case $1 in
    decode) echo "--model $(llama8b) --max-batch ${MAX_BATCH:-64} --kv-cache-gb 40" ;;
    moe) echo "--model ${MODEL:-$(random_model "${MOE_SHAPE:-qwen3-30b-a3b}" q4_k_m "${LAYERS:-12}")} --max-batch ${MAX_BATCH:-256}" ;;
    serve) echo "--model $(llama8b) --device cuda --parallel 64 --kv-cache-gb 40 --levels ${LEVELS:-1,8,32,64}
                 --rounds 1 --prompt-tokens 128 --output-tokens 256 --engine-baseline --load-timeout 120
                 --stall-streams 0" ;;
    speculative) echo "--device cuda --model $(llama8b) --tokens 96 --batches 1,8 --drafts predicted,edited,oracle" ;;
    attention) echo "" ;;
  esac
}

case $SUITE in
tests)
  run_tests "$@" ;;
kernels)
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
  if ! timeout 120 python3 bench/gemv_probe.py 2>&1 | tee "$OUT/probe.log"; then
    [ -n "${FORCE:-}" ] || { echo "probe failed: skipping tests and benchmark"; exit 1; }
  fi
  [ -z "${SKIP_TESTS:-}" ] && run_tests -x tests/test_quant_gemv.py
  timeout "$(left "$TIMEOUT")" python3 bench/kernels.py "$@" 2>&1 | tee "$OUT/kernels.log"
  # Only a few files come back from the device: drop the crash-recovery copy once the full result exists.
  if ls "$OUT"/kernels-*.json 2>/dev/null | grep -qv partial; then rm -f "$OUT/kernels-partial.json"; fi ;;
gemm)
  [ -z "${SKIP_TESTS:-}" ] && run_tests -n 8 --dist load tests/test_quant_gemm.py
  timeout "$(left "$TIMEOUT")" python3 bench/gemm.py "$@" 2>&1 | tee "$OUT/gemm.log" | grep -v "^  "
  cp bench/results/gemm.json bench/results/gemm.md bench/results/quant_configs.json "$OUT/" ;;
gemm-cuda)
  [ -z "${SKIP_TESTS:-}" ] && run_tests -n 8 --dist load tests/test_quant_gemm_cuda.py
  timeout "$(left "$TIMEOUT")" python3 bench/gemm_cuda.py "$@" 2>&1 | grep -v Warning | tee "$OUT/gemm_cuda.log" | tail -45 ;;
attention)
  timeout "$(left "$TIMEOUT")" python3 bench/kernels_attention.py "$@" 2>&1 | quiet | tee "$OUT/attention.log" ;;
decode)
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
  models=()
  if [ -n "${MODEL:-}" ]; then models=(--model "$MODEL")
  else while read -r path; do models+=(--model "$path"); done < <(random_models llama3-8b ${QUANT//,/ }); fi
  timeout "$(left "$TIMEOUT")" python3 bench/decode.py "${models[@]}" --kv-cache-gb 40 "$@" 2>&1 | quiet \
    | tee "$OUT/decode.log" ;;
serve)
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
  # 256 output tokens, 2 rounds: each round's steady window (all N streams decoding) spans ~250 steps.
  # bench/serve.py rewrites its JSON after every stage, so a run cut short still leaves what it measured.
  OUT=$OUT/serve timeout "$(left "$TIMEOUT")" python3 bench/serve.py --model "$(llama8b)" --device cuda \
    --parallel 64 --kv-cache-gb 40 --levels "${LEVELS:-1,8,32,64}" --rounds 2 --prompt-tokens 128 \
    --output-tokens 256 --engine-baseline --load-timeout 120 "$@" 2>&1 | tee "$OUT/serve.log"
  [ -f "$OUT/serve/serve_server.log" ] && { echo "--- server log (tail)"; tail -c 3000 "$OUT/serve/serve_server.log"; } \
    >> "$OUT/serve.log"
  sed -n '/^stall:/p;/^server vs engine/,/^JSON/p' "$OUT/serve.log" ;;
moe)
  run_tests tests/test_moe_routing.py tests/test_moe.py tests/test_quant_gemv.py \
    -k "not gemv_dequantize and (routed or route or combine or slots or moe or bitwise or engine or logits or layer)"
  timeout "$(left "$TIMEOUT")" python3 bench/moe_decode.py $(bench_model_args moe) "$@" 2>&1 | quiet \
    | tee "$OUT/moe_decode.log" ;;
moe-experts)
  timeout "$(left "$TIMEOUT")" python3 bench/moe_experts.py \
    --model "${MODEL:-$(random_model "${MOE_SHAPE:-deepseek-v2-lite}" q4_k_m "${LAYERS:-2}")}" "$@" 2>&1 | quiet \
    | tee "$OUT/moe_experts.log" ;;
hf)
  timeout "$(left "$TIMEOUT")" python3 bench/hf_load.py --folder /tmp/llama3-8b-hf --gguf "$(random_model llama3-8b q8_0)" \
    "$@" 2>&1 | quiet | tee "$OUT/hf_load.log" ;;
speculative)
  timeout "$(left "$TIMEOUT")" python3 bench/speculative.py --device cuda --model "$(llama8b)" "$@" 2>&1 | quiet \
    | tee "$OUT/speculative.log" ;;
parallel)
  timeout "$(left "$TIMEOUT")" python3 bench/parallel.py step --model "$(llama8b)" "$@" 2>&1 | quiet \
    | tee "$OUT/parallel-step.log"
  timeout "$(left "$TIMEOUT")" python3 bench/parallel.py serve --model "$(llama8b)" 2>&1 | quiet \
    | tee "$OUT/parallel-serve.log" ;;
sampler)
  run_tests tests/test_sampler.py tests/test_top_p.py tests/test_top_k.py tests/test_greedy.py
  timeout "$(left "$TIMEOUT")" python3 bench/sampler.py "$@" 2>&1 | quiet | tee "$OUT/sampler.log" | tail -78 ;;
penalties)
  run_tests tests/test_gpu_engine.py -k "penalties or overlapped"
  [ $# -eq 0 ] && set -- --batches 1,64
  timeout "$(left "$TIMEOUT")" python3 bench/penalties_ahead.py --model "${MODEL:-$(random_model llama3-8b q8_0)}" \
    --context 512 --kv-cache-gb 16 "$@" 2>&1 | quiet | tee "$OUT/penalties_ahead.log" | tail -16 ;;
prefill)
  [ -z "${SKIP_TESTS:-}" ] && run_tests tests/test_gpu_engine.py tests/test_cuda_graph_inputs.py tests/test_moe.py \
    tests/test_deepseek.py tests/test_mla_attention.py tests/test_attention_kernels.py \
    -k "prefill_graph or replay_graphs or stage or work_list"
  model=${MODEL:-$(random_model llama3-8b q8_0 "${LAYERS:-8}")}
  [ $# -eq 0 ] && set -- --tokens 128,512 --graphs --beside 0,8,64 --cut
  timeout "$(left "$TIMEOUT")" python3 bench/prefill_host.py --model "$model" "$@" 2>&1 | quiet \
    > "$OUT/prefill_host.log"
  tail -16 "$OUT/prefill_host.log" ;;
size)
  timeout "$(left 100)" python3 bench/size_ceiling.py --date "${DATE:-$(date +%F)}" 2>&1 | tail -14 | tee "$OUT/size.log"
  cp bench/results/size-ceiling*.json "$OUT/" 2>/dev/null ;;
gemv-configs)
  timeout "$(left "$TIMEOUT")" python3 bench/gemv_configs.py "$@" 2>&1 | quiet | tee "$OUT/gemv_configs.log" ;;
profile)
  sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats
    --section WarpStateStats --section SchedulerStats --section SourceCounters"
  for case in "$@"; do     # each case profiles the first timed launch, after gemv_configs.py's two check launches
    if [[ $case == gemm-source\ * ]]; then   # "gemm-source FMT SHAPE N": its stall samples per SASS instruction
      read -r _ fmt shape tok <<<"$case"
      name=gemm-source-$fmt-$shape-$tok
      echo "=== $name" | tee -a "$OUT/ncu_source.txt"
      timeout "$(left 240)" ncu --clock-control none -k regex:_gemm --launch-skip 1 --launch-count 1 \
        --section SourceCounters --section WarpStateStats -f -o "/tmp/$name" python3 bench/gemm_once.py "$fmt" \
        "$shape" "$tok" 2 > "/tmp/$name.log" 2>&1
      ncu -i "/tmp/$name.ncu-rep" --page source --csv --print-source sass > "/tmp/$name.csv" 2>&1
      python3 bench/ncu_source.py "/tmp/$name.csv" 60 >> "$OUT/ncu_source.txt" 2>&1 ||
        tail -n 5 "/tmp/$name.log" "/tmp/$name.csv" >> "$OUT/ncu_source.txt"
      continue
    fi
    if [[ $case == gemm\ * ]]; then   # "gemm FMT SHAPE N": the committed plan's GEMM launch (bench/gemm_once.py)
      read -r _ fmt shape tok <<<"$case"
      echo "=== gemm $fmt $shape n_tok=$tok" | tee -a "$OUT/ncu.txt"
      timeout "$(left 180)" ncu --clock-control none -k regex:_gemm --launch-skip 1 --launch-count 1 \
        $sections python3 bench/gemm_once.py "$fmt" "$shape" "$tok" 2 2>&1 | grep -v "^==PROF==" >> "$OUT/ncu.txt"
      continue
    fi
    read -r fmt shape tok <<<"$case"
    cfg=$(python3 -c "
import sys; sys.path.insert(0, 'bench'); import kernels
from cobatch.kernels import matmul_plans
r, c = kernels.SHAPES['$shape']; p = matmul_plans.plan_for('$fmt', r, c, c, gemv=True).narrow.for_tokens($tok)
print(f'{p.W},{p.RT},{p.split_k},{p.U},{p.D}')")
    echo "=== $fmt $shape n_tok=$tok config $cfg" | tee -a "$OUT/ncu.txt"
    timeout "$(left 120)" ncu --clock-control none -k regex:_gemv_kernel --launch-skip 2 --launch-count 1 \
      $sections python3 bench/gemv_configs.py --formats "$fmt" --shapes "$shape" --toks "$tok" --configs "$cfg" \
      2>&1 | grep -v "^  $fmt\|^==PROF==" >> "$OUT/ncu.txt"
  done ;;
model-plans)
  model=${MODEL:-$(random_model "${SHAPE:-${MOE_SHAPE:-qwen3-30b-a3b}}" "${QUANT%%,*}" ${LAYERS:-})}
  timeout "$(left "$TIMEOUT")" python3 bench/model_gemv_plans.py --model "$model" "$@" 2>&1 | quiet \
    | tee "$OUT/model_gemv_plans.log"
  cp "$OUT/quant_configs.json" /tmp/model_plans.json
  timeout "$(left "$TIMEOUT")" python3 bench/plan_ab.py --model "$model" --tables .,/tmp/model_plans.json \
    --batches "${BATCHES:-1,8,16,64}" --rounds 2 --kv-cache-gb 8 --out "$OUT/plan_ab_model_plans.json" 2>&1 | quiet \
    | tee "$OUT/plan_ab_model_plans.log" ;;
plan-ab)
  [ $# -ge 1 ] || { echo "bench/device.sh plan-ab TABLES [ARGS]" >&2; exit 2; }
  tables=$1; shift
  model=${MODEL:-$(random_model "${SHAPE:-llama3-8b}" "${QUANT%%,*}" ${LAYERS:-})}
  timeout "$(left "$TIMEOUT")" python3 bench/plan_ab.py --model "$model" --tables "$tables" "$@" 2>&1 | quiet \
    | tee "$OUT/plan_ab.log" ;;
phases)
  model=${MODEL:-$(random_model "${SHAPE:-llama3-8b}" "${QUANT%%,*}" ${LAYERS:-})}
  timeout "$(left "$TIMEOUT")" python3 bench/step_phases.py --model "$model" "$@" 2>&1 | quiet \
    | tee "$OUT/step_phases.log" ;;
ab)
  [ $# -ge 2 ] || { echo "bench/device.sh ab OLD NEW [ROUNDS] [ARGS]" >&2; exit 2; }
  old=$1 new=$2; shift 2
  rounds=2; if [[ ${1:-} =~ ^[0-9]+$ ]]; then rounds=$1; shift; fi
  bench=${BENCH:-decode}
  read -r -a model_args <<< "$(bench_model_args "$bench")"
  for round in $(seq 1 "$rounds"); do
    for side in old new; do
      arg=$old; [ $side = new ] && arg=$new
      env_set=(); flags=(); tree=.
      if [ -d "$arg" ]; then tree=$arg                                     # a tree, with its own code and tables
      elif [[ $arg == *.json ]]; then env_set=(COBATCH_QUANT_CONFIGS="$arg")  # a GEMV config table
      elif [[ $arg == *=* ]]; then env_set=("$arg")                        # an environment setting
      elif [[ $arg == -* ]]; then read -r -a flags <<< "$arg"              # the benchmark's flags
      fi
      read -r -a cmd <<< "$(bench_cmd "$bench" "$tree")"
      dir=$OUT/$bench-$side-$round; mkdir -p "$dir"
      echo "== round $round $side ($arg)" | tee -a "$OUT/ab.log"
      OUT=$dir timeout "$(left "$TIMEOUT")" env "${env_set[@]}" "${cmd[@]}" "${model_args[@]}" "${flags[@]}" "$@" \
        2>&1 | quiet | tee "$dir/run.log" >> "$OUT/ab.log"
      tail -20 "$dir/run.log"
    done
  done ;;
esac
