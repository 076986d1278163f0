#!/usr/bin/env bash
# One device call: Nsight Compute stall profiles of chosen GEMV launches (each the committed plan's config for
# that n_tok), then the GPU tests. Run from the repo root on the GPU machine:
#   bench/device_profile.sh "q4_1 gate_up 1" "q4_1 lm_head 16" ...
# Each case profiles one launch (the first timed one, after gemv_configs.py's two check launches) and writes
# the text report to $OUT/ncu.txt. TESTS="" skips the tests.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats
  --section WarpStateStats --section SchedulerStats --section SourceCounters"
for case in "$@"; do
  read -r fmt shape tok <<<"$case"
  cfg=$(python3 -c "
import sys; sys.path.insert(0, 'bench'); import kernels
from cobatch.kernels import quant_matmul as qm
r, c = kernels.SHAPES['$shape']; p = qm.plan_for('$fmt', r, c, c, gemv=True).narrow.for_tokens($tok)
print(f'{p.W},{p.RT},{p.split_k},{p.U},{p.D}')")
  echo "=== $fmt $shape n_tok=$tok config $cfg" | tee -a "$OUT/ncu.txt"
  timeout ${CASE_TIMEOUT:-120} ncu --clock-control none -k regex:_gemv_kernel --launch-skip 2 --launch-count 1 \
    $SECTIONS python3 bench/gemv_configs.py --formats "$fmt" --shapes "$shape" --toks "$tok" --configs "$cfg" \
    2>&1 | grep -v "^  $fmt\|^==PROF==" >>"$OUT/ncu.txt"
done
[ -f .models/smollm2-6l.gguf ] && export COBATCH_CUT_MODEL=.models/smollm2-6l.gguf   # test_gpu_engine
if [ -n "${TESTS-tests}" ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_quant_gemv.py \
    tests/test_quant_matmul.py tests/test_gpu_engine.py tests/test_attention_kernels.py tests/test_kernels_small.py} \
    2>&1 | tail -30 | tee "$OUT/gpu_tests.log"
fi
