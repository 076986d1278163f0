"""kernels/nvrtc.py: CUDA C++ compiled by NVRTC, once per machine (the cubin cache). CPU: NVRTC compiles without a
GPU (the test extras install it); launching needs one (tests/test_quant_gemm_cuda.py on the device)."""

from __future__ import annotations

import struct

import pytest

from cobatch.kernels import nvrtc

SOURCE = 'extern "C" __global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }\n'


pytestmark = pytest.mark.skipif(not nvrtc.available(), reason="NVRTC (nvidia-cuda-nvrtc) is not installed")


def test_a_compile_is_kept_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("COBATCH_CACHE", str(tmp_path))
    cubin, log = nvrtc.compile_cubin(SOURCE, "twice", "90a", ("--ptxas-options=-v",))
    assert cubin[:4] == b"\x7fELF"
    # the cubin and the compiler's log are kept side by side (ptxas's -v report is usually there; one run on the
    # device returned it empty, so only its round trip is checked)
    assert len(list((tmp_path / "nvrtc").glob("*.cubin"))) == 1
    assert [p.read_text() for p in (tmp_path / "nvrtc").glob("*.log")] == [log]

    def no_compiler(*args):
        raise AssertionError("compiled again")

    monkeypatch.setattr(nvrtc, "_compile", no_compiler)
    assert nvrtc.compile_cubin(SOURCE, "twice", "90a", ("--ptxas-options=-v",)) == (cubin, log)
    with pytest.raises(AssertionError, match="compiled again"):      # another option is another program
        nvrtc.compile_cubin(SOURCE, "twice", "90a")


def test_a_program_that_does_not_compile_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("COBATCH_CACHE", str(tmp_path))
    with pytest.raises(nvrtc.NvrtcError, match="does not compile"):
        nvrtc.compile_cubin(SOURCE.replace("2.0f", "undefined_name"), "broken", "90a")
    assert not list(tmp_path.glob("nvrtc/*.cubin"))      # nothing kept


def test_launch_attributes_hold_their_values():
    """The bytes cuLaunchKernelEx reads: a CUlaunchAttribute is an id, padding to 8 bytes, then its value."""
    raw = bytes(memoryview(nvrtc.launch_attributes(pdl=True)).cast("B"))
    assert struct.unpack_from("<I", raw, 0) == (6,)        # programmatic stream serialization
    assert struct.unpack_from("<I", raw, 8) == (1,)        # on
    assert nvrtc.launch_attributes(pdl=False) is None


def test_spills_reads_the_counts_whole():
    clean = "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"
    assert not nvrtc.spills(clean)
    assert nvrtc.spills("ptxas         .     0 bytes stack frame, 100 bytes spill stores, 100 bytes spill loads")
    assert nvrtc.spills("ptxas         .     8 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")
    with pytest.raises(ValueError, match="no spill counts"):
        nvrtc.spills("ptxas info    : Used 64 registers")
