"""How fast Hopper's wgmma runs at the mid-batch GEMM's shapes: m64 x N x k16, f16 in, f32 accumulated, with A
from registers (as the quantized GEMMs feed it: dequantized in registers) or from shared memory, N = 16 .. 256
tokens, one or two warpgroups a CTA, one CTA an SM on every SM. Back-to-back MMAs on one accumulator, nothing
else in the loop: the tensor pipe's own ceiling at each shape, which bounds the GEMM at that token count.

    PYTHONPATH=src python bench/wgmma_rate.py

Prints TFLOP/s per shape and mode; JSON to $OUT and bench/results/wgmma_rate.json. CUDA C++ through NVRTC
(cobatch.kernels.nvrtc), timed with CUDA events over a launch of many iterations.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "src"))

import provenance  # noqa: E402  (bench/, the script's own folder)
from cobatch.kernels import nvrtc, quant_gemm_cuda  # noqa: E402

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;

static __device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 r;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// no-swizzle K-major operand of `rows` rows x 16 columns: 8 x 8 core matrices, the two 8-column groups apart by
// rows * 16 bytes, the 8-row groups by 128
static __device__ __forceinline__ u64 descriptor(u32 addr, u32 rows) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((rows * 16) >> 4) << 16) | ((u64)(128 >> 4) << 32);
}

WGMMA_FUNCTIONS

extern "C" __global__ void __launch_bounds__(128 * WG, 1) rate(float* out, int iters) {
    extern __shared__ __align__(128) unsigned char smem[];
    for (int i = threadIdx.x; i < (64 + BN) * 32 / 4; i += blockDim.x) ((u32*)smem)[i] = 0x3C003C00u ^ (i & 7);
    __syncthreads();
    const u32 a_addr = smem_u32(smem), b_addr = a_addr + 64 * 32;
    const u64 da = descriptor(a_addr, 64), db = descriptor(b_addr, BN);
    const u32 a0 = 0x3C003C00u ^ threadIdx.x, a1 = a0 ^ 1, a2 = a0 ^ 2, a3 = a0 ^ 3;
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
#if SS
            mma_ss(acc, da, db);
#else
            wgmma_bn(acc, a0, a1, a2, a3, db);
#endif
        }
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 2;" ::: "memory");
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) s += acc[i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
"""


def _functions(bn: int) -> str:
    """The kernel's two MMAs: A from registers (the quantized GEMM's own, quant_gemm_cuda.wgmma_source) and A from
    shared memory."""
    n = bn // 2
    regs = ", ".join(f"%{i}" for i in range(n))
    outs = ", ".join(f'"+f"(acc[{i}])' for i in range(n))
    return quant_gemm_cuda.wgmma_source(bn) + (
        "static __device__ __forceinline__ void mma_ss(float* acc, u64 da, u64 db) {\n"
        '    asm volatile("{\\n .reg .pred p;\\n setp.ne.b32 p, 1, 0;\\n"\n'
        f'        " wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.f16.f16 {{{regs}}}, %{n}, %{n + 1}, "\n'
        '        "p, 1, 1, 0, 0;\\n}"\n'
        f'        : {outs} : "l"(da), "l"(db));\n'
        "}\n")


def source(bn: int, wg: int, ss: bool) -> str:
    return (f"#define BN {bn}\n#define WG {wg}\n#define SS {int(ss)}\n"
            + SOURCE.replace("WGMMA_FUNCTIONS", _functions(bn)))


def main() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    iters = 4096
    rows = []
    for bn in (16, 32, 64, 128, 256):
        for wg in (1, 2):
            for ss in (False, True):
                cubin, _ = nvrtc.compile_cubin(source(bn, wg, ss), "rate", nvrtc.arch_of(device))
                k = nvrtc.Kernel(cubin, "rate", (64 + bn) * 32)
                out = torch.empty(sms * 128 * wg, device=device)
                args = [ctypes.c_void_p(out.data_ptr()), ctypes.c_int(iters)]
                stream = torch.cuda.current_stream(device).cuda_stream
                k.launch((sms, 1, 1), 128 * wg, args, stream)            # warm-up
                times = []
                for _ in range(5):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    k.launch((sms, 1, 1), 128 * wg, args, stream)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) / 1e3)
                flops = 2 * 64 * bn * 16 * 4 * iters * wg * sms
                tflops = flops / min(times) / 1e12
                rows.append(dict(n=bn, warpgroups=wg, a_operand="shared" if ss else "registers",
                                 tflops=tflops, registers=k.registers))
                print(f"N={bn:3d} warpgroups={wg} A from {'shared   ' if ss else 'registers'}: {tflops:6.0f} TFLOP/s",
                      flush=True)
    commit = provenance.tree()
    result = dict(benchmark="wgmma_rate", date=datetime.date.today().isoformat(), tree=commit or None,
                  device=torch.cuda.get_device_name(), command="PYTHONPATH=src python bench/wgmma_rate.py",
                  iterations=iters * 4, rows=rows)
    for d in [ROOT / "bench" / "results"] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else []):
        (d / "wgmma_rate.json").write_text(json.dumps(result, indent=1))
    print("\n| N | warpgroups | A from registers TFLOP/s | A from shared memory TFLOP/s |\n|---|---|---|---|")
    for r in rows[::2]:
        ss = next(x for x in rows if x["n"] == r["n"] and x["warpgroups"] == r["warpgroups"]
                  and x["a_operand"] == "shared")
        print(f"| {r['n']} | {r['warpgroups']} | {r['tflops']:.0f} | {ss['tflops']:.0f} |")


if __name__ == "__main__":
    main()
