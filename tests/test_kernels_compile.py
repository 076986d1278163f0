"""The Triton kernels and the Gluon GEMV compile for the H200 (sm_90) without a GPU: Triton's own ptxas runs
on the CPU. So do, for an A100 (sm_80), the Triton kernels and the GEMV: an fp8 KV cache's on its bytes, NVFP4's
scales by bit moves.

The interpreter that runs the kernel tests in CI is more lenient than the compiler (it lets a kernel read a
Python global, for one), so each variant the model can launch is also compiled for real here, registers
allocated and all. The test suite runs under TRITON_INTERPRET=1, which turns @jit into interpreted
functions, so the compiles run in a child process without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CHILD = Path(__file__).resolve().parent / "sm90_variants.py"


@pytest.fixture(scope="module")
def compiled() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(CHILD)], env=env, capture_output=True, text=True, timeout=600)
    if run.returncode != 0 and "backend" in run.stderr.lower():
        pytest.skip(f"triton cannot target CUDA here: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_every_kernel_variant_compiles_for_sm90(compiled):
    # the last 6: the GEMV's leaner loops (quant_gemv.GEMV_CLAMP_X, GEMV_FOLD_STEPS)
    assert len([name for name in compiled if not name.startswith("ampere ")]) == 77 + 35 + 20 + 5 + 19 + 8 + 2 + 6
    failed = {name: err for name, err in compiled.items() if err != "ok"}
    assert not failed, failed


def test_the_triton_kernels_and_the_gemv_compile_for_ampere(compiled):
    """An A100 (sm_80) runs every Triton kernel and the GEMV. It has no e4m3 in Triton or in cvt: the fp8 KV
    cache's variants run on the cache's bytes and NVFP4's GEMV widens its scales by bit moves there
    (kernels/fp8_cache.py)."""
    ampere = {name: err for name, err in compiled.items() if name.startswith("ampere ")}
    assert len(ampere) == 81 + 35 and sum(name.startswith("ampere gemv ") for name in ampere) == 35
    assert sum("fp8 cache" in name or "fp8=True" in name for name in ampere) >= 14
    assert all(err == "ok" for err in ampere.values()), {name: err for name, err in ampere.items() if err != "ok"}
