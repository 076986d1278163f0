"""CUDA C++ kernels compiled at run time by NVRTC and launched on torch's current stream, through ctypes.

For the kernels Gluon cannot express (an mbarrier arrive per warp, cp.async.bulk without a tensor map, wgmma with
no CTA barrier of the compiler's own around it). No compiler is installed: NVRTC ships with torch's CUDA wheels
(nvidia-cuda-nvrtc), and the driver loads the cubin. Nothing here runs on a machine without CUDA; importing this
module does not load any library.

A `Kernel` launches like cuLaunchKernelEx: grid, block, dynamic shared memory, the argument values as ctypes
scalars, and optionally as a programmatic dependent (PDL) of the kernel before it on the stream. Launches are
captured by CUDA graphs like any other on the stream.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import os
import re
import sys

import torch

from cobatch.model_files import cache_dir


class NvrtcError(RuntimeError):
    pass


def _first_library(names: list[str], patterns: list[str]) -> ctypes.CDLL:
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    for pattern in patterns:
        for path in sorted(p for p in glob.glob(pattern) if ".alt." not in p):
            try:
                # NVRTC dlopens its builtins by name: load the copy beside it first, where the loader looks not
                for builtins in glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*")):
                    if ".alt." not in builtins:
                        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                return ctypes.CDLL(path)
            except OSError:
                continue
    raise NvrtcError(f"none of {names} could be loaded (searched {patterns})")


@functools.cache
def _nvrtc() -> ctypes.CDLL:
    major = (torch.version.cuda or "13").split(".")[0]
    # the nvidia-cuda-nvrtc wheel (torch's CUDA wheels depend on it): site-packages/nvidia/cu13/lib or
    # nvidia/cuda_nvrtc/lib, which the loader does not search
    patterns = [f"{p}/nvidia/*/lib/libnvrtc.so*" for p in sys.path if p]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    patterns.append(f"{home}/lib64/libnvrtc.so*")
    lib = _first_library([f"libnvrtc.so.{major}", "libnvrtc.so"], patterns)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def available() -> bool:
    """Can NVRTC be loaded here? (torch's CUDA wheels bring it; on a CPU machine, the test extras)"""
    try:
        _nvrtc()
        return True
    except (NvrtcError, OSError):
        return False


@functools.cache
def _cuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    return lib


def _check_cu(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _cuda().cuGetErrorName(result, ctypes.byref(name))
        raise NvrtcError(f"{what}: CUDA driver error {result} ({(name.value or b'?').decode()})")


def _version() -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def compile_cubin(source: str, name: str, arch: str, options: tuple[str, ...] = ()) -> tuple[bytes, str]:
    """NVRTC: CUDA C++ source -> (cubin for sm_`arch`, e.g. "90a", the compiler's log). Raises NvrtcError
    with the log when it does not compile. Compiled once per machine: the cubin and its log are kept under the
    cache folder (COBATCH_CACHE, else ~/.cache/cobatch), keyed by the source, options and NVRTC's version."""
    key = hashlib.sha256(repr((source, name, arch, options, _version())).encode()).hexdigest()[:32]
    folder = cache_dir() / "nvrtc"
    cubin_path, log_path = folder / f"{key}.cubin", folder / f"{key}.log"
    if cubin_path.is_file() and log_path.is_file():
        return cubin_path.read_bytes(), log_path.read_text()
    cubin, log = _compile(source, name, arch, options)
    try:      # another process may write the same files: each is replaced whole
        folder.mkdir(parents=True, exist_ok=True)
        for path, data in ((log_path, log.encode()), (cubin_path, cubin)):
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
    except OSError:
        pass      # a read-only cache: compile again next time
    return cubin, log


def spills(log: str) -> bool:
    """Does a log of `--ptxas-options=-v` report spill stores or a stack frame (its numbers read whole: "10 bytes spill
    stores" is a spill)?"""
    counts = re.findall(r"(\d+) bytes (?:spill stores|stack frame)", log)
    if not counts:
        raise ValueError("not a log of --ptxas-options=-v: no spill counts in it")
    return any(int(n) for n in counts)


def _compile(source: str, name: str, arch: str, options: tuple[str, ...]) -> tuple[bytes, str]:
    lib = _nvrtc()
    prog = ctypes.c_void_p()

    def check(result: int, what: str) -> None:
        if result != 0:
            raise NvrtcError(f"{what}: {lib.nvrtcGetErrorString(result).decode()}")

    check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None),
          "nvrtcCreateProgram")
    opts = [f"--gpu-architecture=sm_{arch}", "-std=c++17", "-diag-suppress=177", *options]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    result = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log_buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log_buf)
    log = log_buf.value.decode(errors="replace")
    if result != 0:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        raise NvrtcError(f"{name} does not compile:\n{log}")
    check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
    cubin = ctypes.create_string_buffer(size.value)
    check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return cubin.raw, log


# cuLaunchKernelEx's structs (cuda.h): a launch attribute is an id, padding to 8 bytes and a 64-byte value union.
class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


@functools.cache
def launch_attributes(pdl: bool):
    """cuLaunchKernelEx's attribute array (None where there is none): with pdl, programmatic stream serialization.
    Built once (the driver only reads it). The value is written in place through its address: reading a c_char
    array field of a Structure gives a copy, so writing into that would set nothing."""
    if not pdl:
        return None
    array = (_LaunchAttribute * 1)()
    array[0].id = _ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
    ctypes.memmove(ctypes.addressof(array[0]) + _LaunchAttribute.value.offset, (ctypes.c_uint * 1)(1), 4)
    return array


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_FUNC_ATTR_MAX_DYNAMIC_SHARED = 8
_FUNC_ATTR_NUM_REGS = 4
_FUNC_ATTR_LOCAL_SIZE = 3


def _ensure_context() -> None:
    """Make the current device's primary context (torch's) current on this thread: torch creates it lazily, at
    its first allocation or launch there, and a module cannot load without it."""
    torch.cuda.init()
    cu = _cuda()
    ctx = ctypes.c_void_p()
    _check_cu(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        dev = ctypes.c_int()
        _check_cu(cu.cuDeviceGet(ctypes.byref(dev), torch.cuda.current_device()), "cuDeviceGet")
        _check_cu(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        _check_cu(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


class Kernel:
    """One __global__ function of a loaded cubin, on the current device."""

    def __init__(self, cubin: bytes, name: str, smem_bytes: int):
        cu = _cuda()
        _ensure_context()
        self.module, self.func = ctypes.c_void_p(), ctypes.c_void_p()
        _check_cu(cu.cuModuleLoadData(ctypes.byref(self.module), cubin), "cuModuleLoadData")
        _check_cu(cu.cuModuleGetFunction(ctypes.byref(self.func), self.module, name.encode()), "cuModuleGetFunction")
        if smem_bytes > 48 * 1024:
            _check_cu(cu.cuFuncSetAttribute(self.func, _FUNC_ATTR_MAX_DYNAMIC_SHARED, smem_bytes),
                      "cuFuncSetAttribute")
        self.smem_bytes = smem_bytes
        self.registers = self._attribute(_FUNC_ATTR_NUM_REGS)
        self.spill_bytes = self._attribute(_FUNC_ATTR_LOCAL_SIZE)

    def _attribute(self, which: int) -> int:
        v = ctypes.c_int()
        _check_cu(_cuda().cuFuncGetAttribute(ctypes.byref(v), which, self.func), "cuFuncGetAttribute")
        return v.value

    def launch(self, grid: tuple[int, int, int], block: int, args: list, stream: int, pdl: bool = False) -> None:
        """args: ctypes values (c_void_p for pointers, c_int for ints), in the kernel's parameter order. pdl: launched
        as a programmatic dependent of the kernel before."""
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        attrs = launch_attributes(pdl)
        cfg = _LaunchConfig(grid[0], grid[1], grid[2], block, 1, 1, self.smem_bytes, ctypes.c_void_p(stream),
                            attrs, len(attrs) if attrs else 0)
        _check_cu(_cuda().cuLaunchKernelEx(ctypes.byref(cfg), self.func, params, None), "cuLaunchKernelEx")


class TensorMap:
    """A TMA tensor map (cuTensorMapEncodeTiled's 128-byte CUtensorMap, 64-byte aligned) of f16 elements: `arg` is
    the kernel argument (a `const __grid_constant__` struct of 16 u64 in the kernel). dims, innermost first; strides
    in bytes of dims 1..; box: the elements one copy moves along each dim. Out-of-bounds elements land as zeros."""

    F16 = 6              # CU_TENSOR_MAP_DATA_TYPE_FLOAT16
    L2_128B = 2          # CU_TENSOR_MAP_L2_PROMOTION_L2_128B

    def __init__(self, address: int, dims: tuple[int, ...], strides: tuple[int, ...], box: tuple[int, ...]):
        self._buffer = ctypes.create_string_buffer(128 + 64)
        aligned = (ctypes.addressof(self._buffer) + 63) & ~63
        rank = len(dims)
        u64s = (ctypes.c_uint64 * rank)
        u32s = (ctypes.c_uint32 * rank)
        _ensure_context()
        _check_cu(_cuda().cuTensorMapEncodeTiled(
            ctypes.c_void_p(aligned), self.F16, rank, ctypes.c_void_p(address), u64s(*dims),
            (ctypes.c_uint64 * (rank - 1))(*strides), u32s(*box), u32s(*([1] * rank)), 0, 0, self.L2_128B, 0),
            "cuTensorMapEncodeTiled")
        self.arg = (ctypes.c_uint64 * 16).from_address(aligned)


CLOCK_RATE_KHZ = 13      # CU_DEVICE_ATTRIBUTE_CLOCK_RATE: the SMs' peak clock


def device_attribute(device_index: int, attribute: int) -> int:
    """cuDeviceGetAttribute of the device (what torch's device properties do not carry, such as the clock)."""
    _ensure_context()
    value = ctypes.c_int()
    _check_cu(_cuda().cuDeviceGetAttribute(ctypes.byref(value), attribute, device_index), "cuDeviceGetAttribute")
    return value.value


def arch_of(device: torch.device) -> str:
    """The NVRTC architecture of a device: "90a" on Hopper (wgmma and setmaxnreg need the a)."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}" + ("a" if major == 9 else "")
