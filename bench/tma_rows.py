"""How fast one SM's TMA unit moves a box, by the width of the box's rows: the copy engine behind the GEMMs' rings.

    PYTHONPATH=src python bench/tma_rows.py [--ctas-per-sm 1,2] [--widths 16,32,64,128,256]

Every SM runs CTAs whose one thread streams 16 KB stages into a ring of 4 shared-memory slots, each stage as 2-D
tensor copies (cp.async.bulk.tensor) of boxes whose rows are W bytes wide (256 rows a box, fewer where W * 256 is
over 16 KB), or as one plain cp.async.bulk of 16 contiguous KB (`bulk`). Nothing reads the slots: the kernel times
the copies alone. Sources: a 4 MB buffer that stays in L2 (as the GEMMs' x does, every CTA reading the same bytes)
and a 4 GB one (HBM, as their weights). Reports GB/s over all SMs, the ratio to a device-to-device copy measured in
the same run, and rows a cycle an SM. The mid-batch GEMM's x at 64 tokens is about twice its weight bytes, in
64-byte rows (q8_0's 32-column blocks) or 128-byte ones (the 4-bit formats' 64): docs/kernels.md has what this rules
out. Prints a table last; JSON to $OUT/tma_rows.json.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from cobatch.kernels import nvrtc  # noqa: E402
from cobatch.kernels.quant_gemm_cuda import COMMON  # noqa: E402
import provenance  # noqa: E402
from timing import copy_bandwidth  # noqa: E402

STAGE = 16384
SLOTS = 4

SOURCE = r"""
struct __align__(64) TensorMap { u64 words[16]; };

extern "C" __global__ void tma_rows(const __grid_constant__ TensorMap map, const unsigned char* src, int tensor,
                                    int width, int rows, int n_iter, long long total_rows) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) u64 bars[SLOTS];
    if (threadIdx.x == 0) {
        for (int s = 0; s < SLOTS; ++s) mbar_init(smem_u32(&bars[s]), 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    const u32 base = smem_u32(smem);
    const long long stage_rows = STAGE / width, span = total_rows - stage_rows;
    long long row = ((long long)blockIdx.x * 7919 * stage_rows) % span;
    for (int it = 0; it < n_iter + SLOTS; ++it) {
        const int slot = it % SLOTS;
        const u32 bar = smem_u32(&bars[slot]);
        if (it >= SLOTS) mbar_wait(bar, ((it - SLOTS) / SLOTS) & 1);      // the slot's last stage landed
        if (it >= n_iter) continue;
        mbar_expect(bar, STAGE);
        const u32 dst = base + slot * STAGE;
        if (tensor) {
            for (int j = 0; j < stage_rows / rows; ++j)
                asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                             " [%0], [%1, {%2, %3}], [%4];"
                             :: "r"(dst + j * rows * width), "l"(&map), "r"(0), "r"((int)(row + j * rows)), "r"(bar)
                             : "memory");
        } else {
            bulk_copy(dst, src + row * width, STAGE, bar);
        }
        row += stage_rows;
        if (row >= span) row -= span;
    }
}
"""


def kernel() -> nvrtc.Kernel:
    # cuda_common.cuh's q8_0 helper wants its dequantization macro; this kernel dequantizes nothing
    src = f"#define STAGE {STAGE}\n#define SLOTS {SLOTS}\n#define ASM_DEQUANT_Q8 \"\"\n" + COMMON.read_text() + SOURCE
    cubin, _ = nvrtc.compile_cubin(src, "tma_rows", nvrtc.arch_of(torch.device("cuda")))
    return nvrtc.Kernel(cubin, "tma_rows", SLOTS * STAGE)


def time_copies(k: nvrtc.Kernel, buf: torch.Tensor, width: int, tensor: bool, ctas: int, n_iter: int) -> float:
    """Seconds for ctas CTAs of n_iter stages each (best of 3 after a warm-up)."""
    total_rows = buf.numel() // width
    rows = min(256, STAGE // width)
    tmap = nvrtc.TensorMap(buf.data_ptr(), (width // 2, total_rows), (width,), (width // 2, rows))
    args = [tmap.arg, ctypes.c_void_p(buf.data_ptr()), ctypes.c_int(int(tensor)), ctypes.c_int(width),
            ctypes.c_int(rows), ctypes.c_int(n_iter), ctypes.c_longlong(total_rows)]
    stream = torch.cuda.current_stream().cuda_stream
    k.launch((ctas, 1, 1), 32, args, stream)
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        k.launch((ctas, 1, 1), 32, args, stream)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="16,32,64,128,256", help="box row widths in bytes (multiples of 16, <= 256)")
    ap.add_argument("--ctas-per-sm", default="1,2")
    ap.add_argument("--stages", type=int, default=1500, help="16 KB stages a CTA copies")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    clock_hz = nvrtc.device_attribute(torch.cuda.current_device(), nvrtc.CLOCK_RATE_KHZ) * 1e3
    copy_gbps = copy_bandwidth()
    k = kernel()
    sources = {"L2 (4 MB)": torch.empty(4 << 20, dtype=torch.uint8, device="cuda").random_(),
               "HBM (4 GB)": torch.empty(4 << 30, dtype=torch.uint8, device="cuda").random_()}
    rows_out = []
    for where, buf in sources.items():
        for per_sm in (int(c) for c in args.ctas_per_sm.split(",")):
            ctas = sms * per_sm
            for width in [0] + [int(w) for w in args.widths.split(",")]:
                tensor = width > 0
                w = width or 256            # the bulk copy's row width only spreads the CTAs' offsets
                s = time_copies(k, buf, w, tensor, ctas, args.stages)
                moved = ctas * args.stages * STAGE
                gbps = moved / s / 1e9
                kind = f"tensor, {width}-byte rows" if tensor else "bulk"
                row = dict(source=where, ctas_per_sm=per_sm, copy=kind,
                           width=width, seconds=s, gbps=gbps, of_copy=gbps / copy_gbps,
                           rows_per_cycle_per_sm=(moved / w) / sms / (s * clock_hz) if tensor else None)
                rows_out.append(row)
                print(f"{where:10s} {per_sm} CTA/SM {row['copy']:24s} {gbps:7.0f} GB/s ({row['of_copy']:.0%} of copy)"
                      + (f"  {row['rows_per_cycle_per_sm']:.2f} rows/cycle/SM" if tensor else ""), flush=True)
    result = dict(benchmark="tma_rows", date=datetime.date.today().isoformat(), tree=provenance.tree() or None,
                  device=torch.cuda.get_device_name(), copy_gbps=copy_gbps, sms=sms, clock_hz=clock_hz,
                  stage_bytes=STAGE, slots=SLOTS, command="PYTHONPATH=src python bench/tma_rows.py "
                  + " ".join(sys.argv[1:]), rows=rows_out)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "tma_rows.json").write_text(json.dumps(result, indent=1))
    print(f"\ncopy {copy_gbps:.0f} GB/s, {sms} SMs")
    print("| source | CTAs an SM | copy | GB/s | of copy | rows a cycle an SM |\n|---|---|---|---|---|---|")
    for r in rows_out:
        rpc = f"{r['rows_per_cycle_per_sm']:.2f}" if r["rows_per_cycle_per_sm"] is not None else ""
        print(f"| {r['source']} | {r['ctas_per_sm']} | {r['copy']} | {r['gbps']:.0f} | {r['of_copy']:.0%} | {rpc} |")


if __name__ == "__main__":
    main()
