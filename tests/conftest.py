"""Test set-up: without CUDA, Triton kernels run in the interpreter on the CPU (tiny shapes)."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton is first imported by any kernel module.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")

# One intra-op thread: the CPU-path ops are small, and with two threads on a busy 2-core machine
# torch's thread pool spins and makes them 10-100x slower (measured: a KV gather 0.06 ms -> 15 ms).
torch.set_num_threads(int(os.environ.get("COBATCH_TEST_THREADS", "1")))
