"""Test set-up: without CUDA, Triton kernels run in the interpreter on the CPU (tiny shapes)."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton is first imported by any kernel module.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")
requires_hopper = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                                     reason="needs a Hopper GPU (wgmma)")

# One intra-op thread: the CPU-path ops are small, and with two threads on a busy 2-core machine
# torch's thread pool spins and makes them 10-100x slower (measured: a KV gather 0.06 ms -> 15 ms).
torch.set_num_threads(int(os.environ.get("COBATCH_TEST_THREADS", "1")))


@pytest.fixture(scope="session", autouse=True)
def _gguf_py_reads_each_file_once():
    """transformers, the independent reference, opens GGUF files through gguf-py: it parses a file's directory
    (the vocabulary is most of it: 10-15 s for Qwen2.5-Coder) for the tokenizer, again for the config and again for
    the weights, and builds gguf-py's tensor-name map once per tensor (36 ms each). Both are pure functions of their
    arguments, so they are cached here, a file keyed by its path, size and modification time. The reader also
    parses from a plain ndarray view of its np.memmap: the same bytes, but each of its million small slices no
    longer builds a memmap object (Qwen2.5-Coder's transformers load: 63 -> 36 CPU-s). Nothing read changes: only
    how often and how fast it is read."""
    gguf = pytest.importorskip("gguf")
    import functools

    import numpy as np
    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    class PlainArrayReader(real_reader):
        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, mapped):       # GGUFReader.__init__ assigns its np.memmap here
            self._plain_data = mapped.view(np.ndarray) if isinstance(mapped, np.memmap) else mapped

    readers: dict = {}

    def reader(path, mode="r"):
        stat = os.stat(path)
        key = (os.fspath(path), mode, stat.st_size, stat.st_mtime_ns)
        if key not in readers:
            readers[key] = PlainArrayReader(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(real_name_map)
    yield
    gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map


# The files that take longest (CPU seconds, measured with --durations on 2026-12-02), run first. With `-n 2 --dist
# loadfile` the two workers take whole files in collection order, which is alphabetical: the server and
# speculative-decoding files came last and ran on one worker while the other sat idle.
SLOW_FILES_FIRST = ["test_server_tools.py", "test_cli.py", "test_server.py", "test_speculative.py",
                    "test_reference.py", "test_kv_cache_dtype.py", "test_engine.py", "test_overlap.py",
                    "test_server_disconnect.py", "test_server_llama_cpp.py", "test_kernels_compile.py",
                    "test_moe_routing.py", "test_server_lifecycle.py", "test_data_parallel.py", "test_ray_serve.py"]


@pytest.fixture(scope="module", autouse=True)
def _memory_back_after_each_file():
    """Give the heap a file's tests freed back to the OS: two workers share CI's 24 GB, and without this each grew
    to about 12 GB by the end of the run (glibc keeps freed chunks)."""
    yield
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:             # not glibc: nothing to trim
        pass


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES_FIRST)))   # stable: a file keeps its order
