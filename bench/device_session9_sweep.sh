#!/usr/bin/env bash
# Session 9 (2026-11-29), one device call: the MoE engine test with steps under the GEMV crossover, then the
# U = 2 / R = 128 search left by session 8 on q4_K qkv / o and q4_K / q6_K down (bench/gemv_configs.py).
# (The down run stopped at W8 U4, which does not divide 224 chunks; it was re-run without it in a second call.)
#   COBATCH_CUT_MODEL=.models/smollm2-6l.gguf bench/device_session9_sweep.sh   (repo root on the GPU machine; carry .whl, .models)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -p no:cacheprovider "tests/test_moe.py::test_gpu_engine_batched_equals_alone" 2>&1 | tail -4 | tee $OUT/gpu_tests_engine.log
timeout 120 python3 bench/gemv_configs.py --formats q4_k --shapes qkv,o --toks 1,8,16 --configs '4,4,4,2,0,128;4,2,4,2,0,128;4,4,4,1,0,0;4,2,4,4,0,128' --out $OUT/gemv_configs_qkv_o.json 2>&1 | grep -v Warn | tail -22
timeout 90 python3 bench/gemv_configs.py --formats q4_k,q6_k --shapes down --toks 1,8,16 --configs '8,2,2,1,0,128;8,4,2,2,0,128;8,2,2,4,0,128' --out $OUT/gemv_configs_down.json 2>&1 | grep -v Warn | tail -16
