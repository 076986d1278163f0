"""A GEMV of 1-8 tokens whose weights are copied into shared memory before its wait (gemv_chain.resident_launch)
against the plan's GEMV, each alone and behind a spin kernel that stands for decode attention at a few rows.

    PYTHONPATH=src python bench/resident_gemv.py [--spin-us 10] [--out $OUT/resident_gemv.json]

Why: a persistent decode step could keep the next matrix's weights in shared memory while attention (which leaves
HBM idle at a few rows) runs. That pays only if a matrix's kernel gets short once its weights are there; the o
projection on the CUDA GEMM's ring did not (bench/results/decode_o_resident_ab.md). The spin kernel lets its
dependents launch at its start, as decode attention's split kernel would, so the GEMV after it (a programmatic
dependent) becomes resident and, for the resident kernel, copies its weights in under the spin. Two spins: one CTA,
and 64 CTAs holding 100 KB of shared memory each (about decode attention's programs at B = 1 on Llama-3-8B), which
leaves 68 SMs free for the kernel after it. "after" is the pair's time less the spin's alone: what the matrix adds.

Every call's output is checked against quant_matmul_ref first. Weights rotate past L2 (bench/kernels.py's copies).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))   # sibling scripts by name
import kernels  # noqa: E402
from timing import captured, copy_bandwidth, replay_seconds  # noqa: E402

from cobatch.kernels import gemv_chain, nvrtc  # noqa: E402
from cobatch.kernels.gemv_chain import ChainConfig  # noqa: E402
from cobatch.kernels.packed_weight import PackedWeight  # noqa: E402
from cobatch.kernels.quant_matmul import quant_matmul_ref  # noqa: E402

SPIN_SOURCE = r"""
extern "C" __global__ void spin(long long cycles, int* sink) {
    extern __shared__ unsigned char held[];           // shared memory a program of the kernel it stands for holds
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
    if (cycles < 0) sink[threadIdx.x] = held[threadIdx.x];
}
"""
SM_CLOCK_MHZ = 1980          # the H100's and H200's boost clock: the spin's cycles a microsecond
SPINS = {"1 CTA": (1, 0), "64 CTAs x 100 KB": (64, 100 * 1024)}
SHAPES = {"o": (4096, 4096), "qkv": (6144, 4096)}
CONFIGS = [ChainConfig(W=8, RT=2, U=4), ChainConfig(W=8, RT=2, U=8), ChainConfig(W=4, RT=1, U=8),
           ChainConfig(W=8, RT=1, U=8)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spin-us", type=float, default=10.0)
    ap.add_argument("--toks", default="1,8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    copy_gbps = copy_bandwidth()
    cycles = int(args.spin_us * SM_CLOCK_MHZ)
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbps:.0f} GB/s; spin {cycles} cycles", flush=True)
    spin_cubin, _ = nvrtc.compile_cubin(SPIN_SOURCE, "spin", nvrtc.arch_of(device))
    sink = torch.zeros(1024, dtype=torch.int32, device=device)
    spins = {}
    for name, (ctas, smem) in SPINS.items():
        k = nvrtc.Kernel(spin_cubin, "spin", smem)
        spins[name] = lambda k=k, ctas=ctas: k.launch(
            (ctas, 1, 1), 128, [ctypes.c_longlong(cycles), ctypes.c_void_p(sink.data_ptr())],
            torch.cuda.current_stream().cuda_stream)
    rows_out = []
    for shape, (n_rows, n_cols) in SHAPES.items():
        w = kernels.random_weight("q8_0", n_rows, n_cols)
        pw = PackedWeight.from_quant(w, "cuda")
        copies = kernels.rotating(pw)
        for n_tok in [int(t) for t in args.toks.split(",")]:
            x = torch.randn(n_tok, n_cols, device=device).to(torch.float16)
            out = torch.empty(n_tok, n_rows, device=device, dtype=torch.float16)
            ref = quant_matmul_ref(x, w)
            variants = {"GEMV (plan)": lambda w, x=x, out=out: w.matmul(x, out=out)}
            for cfg in CONFIGS:
                try:
                    gemv_chain.resident_launch(pw.planes, x, out, n_tok, cfg, pdl=True)
                except ValueError:
                    continue
                variants[f"resident W{cfg.W} RT{cfg.RT} U{cfg.U}"] = (
                    lambda w, cfg=cfg, x=x, out=out: gemv_chain.resident_launch(w.planes, x, out, n_tok, cfg, pdl=True))
            for name, call in variants.items():
                out.fill_(float("nan"))
                call(pw)
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                if not err < 4e-3:
                    raise SystemExit(f"{shape} {name} n={n_tok}: rel err {err:.2e}")
                alone = replay_seconds(captured([lambda c=c: call(c) for c in copies]), 15) / len(copies)
                row = {"shape": shape, "n_tok": n_tok, "variant": name, "alone_us": alone * 1e6,
                       "alone_of_copy": pw.nbytes / alone / 1e9 / copy_gbps, "rel_err": err}
                for spin_name, spin in spins.items():
                    only = replay_seconds(captured([spin for _ in copies]), 15) / len(copies)
                    pairs = []
                    for c in copies:
                        pairs += [spin, lambda c=c: call(c)]
                    both = replay_seconds(captured(pairs), 15) / len(copies)
                    row[f"after {spin_name} us"] = (both - only) * 1e6
                rows_out.append(row)
                print(f"  {shape} n={n_tok} {name}: alone {alone * 1e6:.1f} us "
                      f"({100 * row['alone_of_copy']:.0f} % of copy), after a spin "
                      + ", ".join(f"{k}: {row[f'after {k} us']:.1f} us" for k in SPINS), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_gbps": copy_gbps,
                                              "spin_us": args.spin_us, "rows": rows_out}, indent=1))
    print(f"\ncopy {copy_gbps:.0f} GB/s; us a call: alone (% of copy) | after each spin (the pair less the spin)")
    for r in rows_out:
        share = f"{r['alone_us']:6.1f} ({100 * r['alone_of_copy']:3.0f} %)"
        after = "".join(f" | {r[f'after {k} us']:6.1f}" for k in SPINS)
        print(f"{r['shape']:4} n={r['n_tok']} {r['variant']:26} {share}{after}")


if __name__ == "__main__":
    main()
