"""The mid-batch quantized GEMM in CUDA C++ (quant_gemm_cuda.cu), compiled at run time by NVRTC (nvrtc.py).

Why a second implementation beside the Gluon one (quant_gemm.py): there a consumer's chain per ring stage carries
CTA barriers the compiler adds around every mbarrier wait and arrive (Gluon's arrive is one thread's), and 34-48 %
of the consumer warps' stall cycles were spent at them (bench/results/ncu_gemm.txt). Here each consumer warp waits
on a stage's mbarrier and arrives on its `empty` barrier on its own, a CTA carries one or two 64-row blocks per
warpgroup (x read once for up to 256 rows), and the producer copies the planes with cp.async.bulk, without
tensor maps. It reads the same fragment-order planes, so no second copy of the weights exists.

q8_0 and q4_1's planes (q4_1, q4_K). Plans name it where it beat the Gluon GEMM in whole decode steps: q4_K's qkv, o
and down at their fewest GEMM tokens (matmul_plans' `first` range; bench/gemm_cuda.py weighs it per matrix,
docs/kernels.md has what it showed). x is staged once per call by `x_image` (one small Triton launch, like
quant_gemm.x_operands): per token tile and 32-column chunk, the tile's BN tokens x 32 columns as f16 in the planes'
column order (quant_pack.k_order), laid out as wgmma's no-swizzle K-major B operand reads them: 8 x 8 core matrices
of 128 contiguous bytes, the four 8-column groups of K outermost, then the token groups. One bulk copy a stage moves
it.

The torch reference is x_image_ref for the staging and quant_matmul.quant_matmul_ref for the product.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from cobatch.kernels import nvrtc, quant_gemv, quant_pack
from cobatch.kernels.scratch import DeviceScratch, device_key
from cobatch.kernels.triton_support import gdc_launch_dependents, gdc_wait, jit, pdl_launch, tl

TOKEN_TILES = (16, 32, 64, 128)
FORMATS = (quant_pack.Q8_0, quant_pack.Q4_1)     # q4_K's fragment planes are q4_1's
SOURCE = Path(__file__).with_suffix(".cu")
COMMON = Path(__file__).with_name("cuda_common.cuh")   # device helpers shared with mla_decode_cuda.cu
SMEM_LIMIT = 227 * 1024
OUT_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def token_tile(n_tok: int) -> int:
    return next((b for b in TOKEN_TILES if n_tok <= b), TOKEN_TILES[-1])


@dataclass(frozen=True, slots=True)
class CudaGemmConfig:
    """WG consumer warpgroups of RB 64-row blocks each (a CTA: 64 WG RB rows), stages of CH 32-column chunks, a
    ring of S stages (fewer where they do not fit: stages()), split_k CTAs per row block, MINB CTAs an SM for
    ptxas's register budget. Only split_k changes a row's bits."""
    WG: int = 2
    RB: int = 1
    CH: int = 4
    S: int = 6
    split_k: int = 1
    MINB: int = 1
    LAG: bool = False     # a stage's MMAs stay in flight while the next stage is dequantized
    PROBE: int = 0        # a diagnostic, never planned: 1 skips the MMAs, 2 the dequantization, 3 both (wrong sums)
    # WREG 1 or 2: the weights go from global memory straight into registers, that many stages ahead, and the ring
    # carries x only (shared memory's traffic per weight byte: x's alone)
    WREG: int = 0
    L2PF: int = 0         # with WREG: the quant bytes that many stages further ahead prefetched into L2
    PRODUCERS: int = 1    # producer warps, filling alternate stages (one warp's bulk copies issue one by one)

    def __post_init__(self):
        if self.WG not in (1, 2) or self.RB not in (1, 2) or self.CH not in (1, 2, 4, 8) or self.S < 2 \
                or self.WREG not in (0, 1, 2) or self.PRODUCERS not in (1, 2, 4):
            raise ValueError(f"CudaGemmConfig needs WG 1-2, RB 1-2, CH 1, 2, 4 or 8, 2+ stages, WREG 0-2, "
                             f"1, 2 or 4 producers: {self}")

    def threads(self) -> int:
        return 128 * self.WG + 32 * self.PRODUCERS

    def rows_per_cta(self) -> int:
        return 64 * self.WG * self.RB

    def stage_bytes(self, bn: int, fmt_id: int = quant_pack.Q8_0) -> int:
        tiles = 0 if self.WREG else 4 * self.WG * self.RB
        blocks, side = _BLOCKS_SIDE[fmt_id]
        return tiles * self.CH * (512 + side) + self.CH * blocks * bn * 64

    def stages(self, bn: int, fmt_id: int = quant_pack.Q8_0) -> int:
        """The ring's depth at token tile bn: S, or as many as fit an SM's share of MINB CTAs (x's share of a
        stage grows with bn). Below 2 the config cannot run at this tile."""
        return min(self.S, (SMEM_LIMIT // self.MINB - 1024) // self.stage_bytes(bn, fmt_id))

    def runs_at(self, bn: int, fmt_id: int = quant_pack.Q8_0) -> bool:
        """Does the ring hold 2 stages at token tile bn, and one a producer warp at least? (A producer waits on a
        slot's `empty` barrier by its phase's parity, which names the right phase only while no producer runs a
        whole lap of the ring ahead of the consumers.)"""
        return self.stages(bn, fmt_id) >= max(2, self.PRODUCERS)

    def smem_bytes(self, bn: int, fmt_id: int = quant_pack.Q8_0) -> int:
        return self.stages(bn, fmt_id) * self.stage_bytes(bn, fmt_id) + 16 * self.stages(bn, fmt_id) + 16


# per format: (32-column blocks a chunk, bytes of a 16-row tile's chunk of scale data)
_BLOCKS_SIDE = {quant_pack.Q8_0: (1, 32), quant_pack.Q4_1: (2, 128)}


def wgmma_source(bn: int) -> str:
    """wgmma_bn(acc, a0..a3, desc): acc[bn / 2] += A (registers, f16) x B (the descriptor's x), m64 n`bn` k16."""
    n = bn // 2
    regs = ", ".join(f"%{i}" for i in range(n))
    outs = ", ".join(f'"+f"(acc[{i}])' for i in range(n))
    return (
        "static __device__ __forceinline__ void wgmma_bn(float* acc, u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {\n"
        '    asm volatile("{\\n .reg .pred p;\\n setp.ne.b32 p, 1, 0;\\n"\n'
        f'        " wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.f16.f16 {{{regs}}}, '
        f'{{%{n}, %{n + 1}, %{n + 2}, %{n + 3}}}, %{n + 4}, p, 1, 1, 0;\\n}}"\n'
        f'        : {outs}\n'
        '        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));\n'
        "}\n")


def source(cfg: CudaGemmConfig, bn: int, act: int, out_type: int, pdl: bool, fmt_id: int = quant_pack.Q8_0) -> str:
    defines = dict(FMT=int(fmt_id == quant_pack.Q4_1), BN=bn, RB=cfg.RB, WG=cfg.WG, CH=cfg.CH,
                   S=cfg.stages(bn, fmt_id), SPLIT=cfg.split_k, ACT=act, OUT=out_type, PDL=int(pdl), MINB=cfg.MINB,
                   LAG=int(cfg.LAG), PROBE=cfg.PROBE, WREG=cfg.WREG, L2PF=cfg.L2PF,
                   PRODUCERS=cfg.PRODUCERS)
    head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
    head += f"#define ASM_DEQUANT_Q8 {asm_literal(quant_gemv.ASM_Q8)}\n"
    head += f"#define ASM_DEQUANT_Q4 {asm_literal(quant_gemv.ASM_NIB_AFFINE)}\n"
    body = COMMON.read_text() + SOURCE.read_text()
    marker = "extern \"C\" __global__"
    at = body.index(marker)
    return head + body[:at] + wgmma_source(bn) + "\n" + body[at:]


def asm_literal(ptx) -> str:
    """Inline PTX of the Gluon kernels (quant_gemv's ASM_* strings, operands $N) as one line of C string literals
    for asm() (operands %N): the CUDA kernel dequantizes with the very instructions the GEMV and the Gluon GEMM use."""
    text = re.sub(r"\$(\d+)", r"%\1", str(getattr(ptx, "value", ptx)))
    return " ".join(json.dumps(line + "\n") for line in text.strip().splitlines())


@functools.cache
def cubin(cfg: CudaGemmConfig, bn: int, act: int, out_type: int, pdl: bool, fmt_id: int = quant_pack.Q8_0,
          arch: str = "90a") -> tuple[bytes, str]:
    """The compiled kernel (cubin, NVRTC's log) of one config, token tile, epilogue, output type and format."""
    return nvrtc.compile_cubin(source(cfg, bn, act, out_type, pdl, fmt_id), "quant_gemm", arch)


_kernels: dict[tuple, nvrtc.Kernel] = {}


def kernel(cfg: CudaGemmConfig, bn: int, act: int, out_type: int, pdl: bool, device: torch.device,
           fmt_id: int = quant_pack.Q8_0) -> nvrtc.Kernel:
    key = (cfg, bn, act, out_type, pdl, device.index, fmt_id)
    k = _kernels.get(key)
    if k is None:
        with torch.cuda.device(device):
            k = nvrtc.Kernel(cubin(cfg, bn, act, out_type, pdl, fmt_id, nvrtc.arch_of(device))[0], "quant_gemm",
                             cfg.smem_bytes(bn, fmt_id))
        _kernels[key] = k
    return k


# A plan entry's GEMM config (quant_configs.json's "quant_gemm") runs this kernel when it says so: {"kernel": "cuda",
# ...the CudaGemmConfig's fields}; without the key it is the Gluon kernel's GemmConfig.
PLAN_KERNEL = "cuda"


def plan_entry(cfg: CudaGemmConfig) -> dict:
    fields = {f: getattr(cfg, f) for f in cfg.__dataclass_fields__ if getattr(cfg, f) != getattr(CudaGemmConfig(), f)}
    return {"kernel": PLAN_KERNEL, **fields}


def from_plan_entry(entry: dict) -> CudaGemmConfig:
    return CudaGemmConfig(**{k: v for k, v in entry.items() if k != "kernel"})


def supports(p: "quant_pack.PackedPlanes", cfg: CudaGemmConfig, max_tok: int = 1) -> bool:
    """Can cfg run these planes, at every token count up to max_tok (its stages must fit an SM at the tile)?"""
    n_chunks = p.qs.shape[1] // 512
    return (p.fragment and p.fmt_id in FORMATS and p.cols == p.cols_pad and p.rows_pad % cfg.rows_per_cta() == 0
            and n_chunks % (cfg.split_k * cfg.CH) == 0 and cfg.runs_at(token_tile(max_tok), p.fmt_id))


def scratch_need(cfg: CudaGemmConfig, rows_pad: int, max_tok: int) -> tuple[int, int]:
    """(partial elements, tile counters) of the split-K reduction for calls of up to max_tok tokens."""
    if cfg.split_k == 1:
        return 1, 1
    bn = token_tile(max_tok)
    tiles = (rows_pad // cfg.rows_per_cta()) * -(-max_tok // bn)
    return tiles * cfg.split_k * cfg.rows_per_cta() * bn, tiles


# --- x, staged as wgmma reads it ------------------------------------------------------------------------------

@jit
def _x_image_kernel(x_ptr, out_ptr, n_tok, n_cols, x_stride, BN: tl.constexpr, CB: tl.constexpr, PDL: tl.constexpr):
    """Program (token tile, CB chunks): out[tile][chunk] = the chunk's image (x_image_ref). The tile's rows are read
    whole (contiguous columns, vector loads) and permuted in registers: GGUF column 8 c + 2 j + e of a chunk is logical
    column 8 j + 2 c + e, and the image is [chunk][j][token // 8][token % 8][c][e]."""
    if PDL:  # a programmatic dependent: let the GEMM after it launch, and wait for the kernel before
        gdc_launch_dependents()
        gdc_wait()
    tile = tl.program_id(0)
    tok = tile * BN + tl.arange(0, BN)
    col = tl.program_id(1) * (CB * 32) + tl.arange(0, CB * 32)
    v = tl.load(x_ptr + tok.to(tl.int64)[:, None] * x_stride + col[None, :], mask=(tok < n_tok)[:, None], other=0.0)
    v = tl.reshape(v.to(tl.float16), [BN // 8, 8, CB, 4, 4, 2])          # token // 8, token % 8, chunk, c, j, e
    v = tl.reshape(tl.permute(v, [2, 4, 0, 1, 3, 5]), [CB * BN * 32])     # chunk, j, token // 8, token % 8, c, e
    base = (tile.to(tl.int64) * (n_cols // 32) + tl.program_id(1) * CB) * (BN * 32)
    tl.store(out_ptr + base + tl.arange(0, CB * BN * 32), v)


def x_image(x: torch.Tensor, bn: int, out: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """x [n_tok, cols] -> f16 [token tiles, cols / 32, bn * 32]: each chunk's wgmma B image (x_image_ref)."""
    n_tok, cols = x.shape
    tiles = -(-n_tok // bn)
    cb = max(1, 4096 // (bn * 32))
    while (cols // 32) % cb:
        cb //= 2
    _x_image_kernel[(tiles, cols // 32 // cb)](x, out, n_tok, cols, x.stride(0), BN=bn, CB=cb,
                                               **(pdl_launch(x) if pdl else {"PDL": False}))
    return out


def x_image_ref(x: torch.Tensor, bn: int) -> torch.Tensor:
    """The torch reference: tokens padded with zeros to whole tiles, columns in the planes' order (k_order), each
    tile and chunk as [kc (4 groups of 8 columns)][token group][token % 8][8 columns]."""
    n_tok, cols = x.shape
    tiles = -(-n_tok // bn)
    order = torch.tensor(quant_pack.k_order(quant_pack.Q8_0), device=x.device)
    xs = torch.zeros(tiles * bn, cols, dtype=torch.float16, device=x.device)
    xs[:n_tok] = x.reshape(n_tok, cols // 32, 32)[:, :, order].reshape(n_tok, cols).to(torch.float16)
    img = xs.view(tiles, bn // 8, 8, cols // 32, 4, 8).permute(0, 3, 4, 1, 2, 5)
    return img.reshape(tiles, cols // 32, bn * 32).contiguous()


# The f16 x image, grown before a CUDA-graph capture (reserve_scratch).
_IMAGE_SCRATCH = DeviceScratch(torch.float16)


def reserve_scratch(device: torch.device, max_tok: int, cols: int) -> None:
    """Grow the x image buffer to what calls of up to max_tok tokens need (at load: never inside a CUDA-graph
    capture)."""
    bn = token_tile(max_tok)
    _IMAGE_SCRATCH.reserve(device, -(-max_tok // bn) * bn * cols)


PDL = os.environ.get("COBATCH_GEMM_PDL", "1") != "0"


def launch(p: "quant_pack.PackedPlanes", x: torch.Tensor, out: torch.Tensor, cfg: CudaGemmConfig,
           partial: torch.Tensor, count: torch.Tensor, act: str | None = None) -> None:
    """out[n_tok, rows] = x @ W.T (quant_gemm.launch's contract): x_image, then the CUDA kernel."""
    n_tok = x.shape[0]
    if not supports(p, cfg, n_tok):
        raise ValueError(f"{cfg} cannot run these planes ({p.fmt_id}, {p.rows_pad}x{p.cols}) at {n_tok} tokens")
    bn = token_tile(n_tok)
    tiles = -(-n_tok // bn)
    img = _IMAGE_SCRATCH.get(x.device, tiles * bn * p.cols).view(tiles, p.cols // 32, bn * 32)
    x_image(x, bn, img, pdl=PDL)
    launch_staged(p, img, n_tok, out, cfg, partial, count, act)


def launch_staged(p: "quant_pack.PackedPlanes", img: torch.Tensor, n_tok: int, out: torch.Tensor,
                  cfg: CudaGemmConfig, partial: torch.Tensor, count: torch.Tensor, act: str | None = None) -> None:
    """The kernel alone, on x already staged by x_image into `img`."""
    bn = token_tile(n_tok)
    device = device_key(out.device)
    k = kernel(cfg, bn, quant_gemv.ACTS[act], OUT_TYPES[out.dtype], PDL, device, p.fmt_id)
    row_blocks = p.rows_pad // cfg.rows_per_cta()
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())     # noqa: E731
    args = [ptr(p.qs), ptr(p.d), ptr(img), ptr(out), ptr(partial), ptr(count), ctypes.c_int(n_tok),
            ctypes.c_int(p.rows), ctypes.c_int(out.stride(0)), ctypes.c_int(p.qs.shape[1] // 512),
            ctypes.c_int(row_blocks)]
    k.launch((-(-n_tok // bn), row_blocks * cfg.split_k, 1), cfg.threads(), args,
             torch.cuda.current_stream(device).cuda_stream, pdl=PDL)

