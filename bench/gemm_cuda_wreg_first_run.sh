#!/usr/bin/env bash
# the WREG variant's first GPU run: its tests, then weighed against the plans (and the ring variant's best)
cd "$(dirname "$0")"
source bench/device_env.sh
timeout 60 python3 -m pytest -q -x -p no:cacheprovider -n 8 tests/test_quant_gemm_cuda.py 2>&1 | tail -2
timeout 300 python3 bench/gemm_cuda.py --probe 2>&1 | grep -v Warning | tail -45
