"""MLA decode attention's split kernel in CUDA C++ (mla_decode_cuda.cu), compiled at run time by NVRTC (nvrtc.py).

Why a second implementation beside the Triton one (mla_attention._mla_decode_split_kernel): that kernel reads 57 %
of copy at 64 rows x 8192 on DeepSeek-V2-Lite's 16 heads, one program an SM, each 72 KB latent tile's chain (wait,
two dots, softmax across warps, rescale) in series with its loads (docs/kernels.md, *MLA decode*). Here a producer
warp streams the cached rows into a ring of 16-row segments with cp.async.bulk while one consumer warpgroup takes 64
rows a tile through two wgmma products (rows as M, the 16 heads as N), so the loads run ahead of the arithmetic by
up to the ring's depth.

The same split planner (attention.plan_decode_splits, 64-row tiles; one program an SM), the same partials and the
same reduce kernel as the Triton kernel, so a row's output depends on its own length only (not its bits: another
order of sums). It runs bf16 or f16 caches of one latent head whose blocks hold whole 16-row segments, on Hopper;
mla_decode_attention takes it where `supports` says so (unless COBATCH_MLA_CUDA=0). The torch reference is
mla_attention.mla_attention_ref. Measured against the Triton kernel: bench/results/mla_cuda_ab.md.

An fp8 (e4m3) cache, rows of half the bytes widened to f16 between shared memory and the wgmmas (the .cu header
says how), runs here too (COBATCH_MLA_CUDA_FP8=0: the Triton kernels): DeepSeek-V2-Lite's steps with an fp8 latent
cache, 8 layers on the H100, B = 64 at ctx 8192 5.11 -> 3.39 ms, B = 8 1.80 -> 1.47 (bench/results/mla_kv_fp8.md).
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from cobatch.batch import AttentionMetadata
from cobatch.kernels import nvrtc
from cobatch.kernels.scratch import device_key

SOURCE = Path(__file__).with_suffix(".cu")
COMMON = Path(__file__).with_name("cuda_common.cuh")
SMEM_LIMIT = 227 * 1024
SM_SMEM = 228 * 1024      # an SM's shared memory, 1 KB of it reserved per CTA
TILE = 64           # cached rows a tile (the kernel's wgmma M): the split plan's block_n
HEADS = 16          # query heads a CTA (the kernel's wgmma N)
DTYPES = {torch.bfloat16: 1, torch.float16: 0}
FP8 = torch.float8_e4m3fn
# an fp8 cache in this kernel (COBATCH_MLA_CUDA_FP8=0: the Triton kernels, mla_attention._split_kernel_triton)
MLA_CUDA_FP8 = os.environ.get("COBATCH_MLA_CUDA_FP8", "1") != "0"


@dataclass(frozen=True, slots=True)
class MlaCudaConfig:
    """segments: the ring's slots of 16 cached rows (4 a tile; the shared memory holds up to 10 at DeepSeek's
    576-wide rows), fp8_segments: the same with an fp8 cache (up to 20; 8 leave room for two CTAs an SM). early: as
    a programmatic dependent, copy every segment but the step's new row's before waiting for the kernel before
    (older rows are never written by it). out_bits: the output's product widens e4m3 rows by bit moves on the
    integer pipe instead of the conversion unit's cvt (the .cu header says how). producers, fp8_producers: the warps
    copying rows into the ring, with a 16-bit and an fp8 cache (a warp's copies, one a row, issue one after another,
    at about 45 ns a row: one warp held bf16 rows to 73 % of copy at 64 rows x 8192 on the H200, two took them to
    86 %; bench/results/mla_producers.md)."""
    segments: int = 10
    early: bool = True
    fp8_segments: int = 8
    out_bits: bool = False
    producers: int = 2
    fp8_producers: int = 2

    def ring(self, fp8: bool) -> int:
        return self.fp8_segments if fp8 else self.segments

    def producer_warps(self, fp8: bool) -> int:
        return self.fp8_producers if fp8 else self.producers


MLA_CUDA_CONFIG = MlaCudaConfig()


def smem_bytes(cfg: MlaCudaConfig, lat: int, rope: int, fp8: bool = False) -> int:
    """The ring (rows of 1 or 2 bytes a value, 16 bytes apart), the queries' and p's 16-bit images, the softmax's
    exchange and the ring's barriers."""
    segments, pitch = cfg.ring(fp8), (lat + rope) * (1 if fp8 else 2) + 16
    return segments * 16 * pitch + HEADS * (lat + rope) * 2 + HEADS * TILE * 2 + 3 * 4 * HEADS * 4 + 16 * segments


def threads(cfg: MlaCudaConfig, fp8: bool = False) -> int:
    """A warpgroup of consumers and the producer warps."""
    return 128 + 32 * cfg.producer_warps(fp8)


def ctas_per_sm(cfg: MlaCudaConfig, lat: int, rope: int, fp8: bool = False) -> int:
    """1 or 2: as many CTAs as the ring lets an SM hold (their registers are budgeted for that many)."""
    return 2 if 2 * (smem_bytes(cfg, lat, rope, fp8) + 1024) <= SM_SMEM else 1


def source(cfg: MlaCudaConfig, lat: int, rope: int, block: int, single: bool, bf16: bool, pdl: bool,
           min_split: int, fp8: bool = False) -> str:
    """The kernel's text for one variant: bf16 the queries' (and output's) dtype, else f16; fp8 an e4m3 cache,
    else the queries' dtype."""
    defines = dict(LAT=lat, ROPE=rope, BLOCK=block, SEGS=cfg.ring(fp8), SINGLE=int(single), BF16=int(bf16),
                   FP8=int(fp8), OUT_BITS=int(fp8 and cfg.out_bits), PDL=int(pdl), EARLY=int(cfg.early),
                   MIN_SPLIT=min_split, MINB=ctas_per_sm(cfg, lat, rope, fp8),
                   PRODUCERS=cfg.producer_warps(fp8))
    head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
    return head + COMMON.read_text() + SOURCE.read_text()


@functools.cache
def cubin(cfg: MlaCudaConfig, lat: int, rope: int, block: int, single: bool, bf16: bool, pdl: bool, min_split: int,
          fp8: bool = False, arch: str = "90a") -> tuple[bytes, str]:
    return nvrtc.compile_cubin(source(cfg, lat, rope, block, single, bf16, pdl, min_split, fp8), "mla_decode", arch)


_kernels: dict[tuple, nvrtc.Kernel] = {}


def kernel(cfg: MlaCudaConfig, lat: int, rope: int, block: int, single: bool, bf16: bool, pdl: bool, min_split: int,
           fp8: bool, device: torch.device) -> nvrtc.Kernel:
    key = (cfg, lat, rope, block, single, bf16, pdl, min_split, fp8, device.index)
    k = _kernels.get(key)
    if k is None:
        with torch.cuda.device(device):
            binary = cubin(cfg, lat, rope, block, single, bf16, pdl, min_split, fp8, nvrtc.arch_of(device))[0]
            k = nvrtc.Kernel(binary, "mla_decode", smem_bytes(cfg, lat, rope, fp8))
        _kernels[key] = k
    return k


def _aligned(t: torch.Tensor, *strides: int) -> bool:
    return t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in strides)


def unsupported(q: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, block_n: int,
                cfg: MlaCudaConfig = MLA_CUDA_CONFIG, fp8: bool | None = None) -> str | None:
    """Why the kernel cannot run this call's shapes, or None: q [N, H, lat], q_rope [N, H, rope] (both multiples of
    64), cache [blocks, block_size, lat + rope] (one head, rows contiguous), all of one 16-bit dtype, or the cache
    in e4m3 (with fp8, default MLA_CUDA_FP8; the latent then a multiple of 128), 16-byte aligned rows; the plan's
    tiles of 64 rows; a ring of a tile's segments at least, within an SM's shared memory."""
    lat, rope = q.shape[2], q_rope.shape[2]
    width = lat + rope
    fp8_cache = cache.dtype == FP8
    if fp8_cache and not (MLA_CUDA_FP8 if fp8 is None else fp8):
        return "an fp8 cache: the Triton kernels (COBATCH_MLA_CUDA_FP8=0)"
    if q.dtype not in DTYPES or q.dtype != q_rope.dtype or not (fp8_cache or cache.dtype == q.dtype):
        return f"dtypes {q.dtype}, {q_rope.dtype}, {cache.dtype}: one of {list(DTYPES)} for all, or an {FP8} cache"
    if block_n != TILE:
        return f"the plan's tiles are {block_n} rows, the kernel's {TILE}"
    if lat % (128 if fp8_cache else 64) or rope % 64 or cache.shape[2] != width or cache.stride(1) != width:
        return f"latent {lat} and rope {rope} (multiples of 64; 128 for an fp8 latent), rows {cache.shape[2]} wide, " \
               "contiguous"
    if cache.shape[1] % 16:
        return f"cache blocks of {cache.shape[1]} rows: whole segments of 16 needed"
    segments = cfg.ring(fp8_cache)
    if segments < 4 or smem_bytes(cfg, lat, rope, fp8_cache) > SMEM_LIMIT:
        return f"a ring of {segments} segments: 4 to {SMEM_LIMIT} bytes of shared memory"
    if not (_aligned(q, q.stride(0), q.stride(1)) and _aligned(q_rope, q_rope.stride(0), q_rope.stride(1))
            and cache.data_ptr() % 16 == 0 and cache.stride(0) * cache.element_size() % 16 == 0):
        return "queries or cache blocks not 16-byte aligned"
    return None


def supports(q: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, block_n: int,
             cfg: MlaCudaConfig = MLA_CUDA_CONFIG, meta: AttentionMetadata | None = None,
             fp8: bool | None = None) -> bool:
    """Can the CUDA kernel run this call? Its shapes (unsupported), int32 block tables and lengths, on Hopper, with
    NVRTC."""
    int32 = meta is None or (meta.block_tables.dtype == meta.seq_lens.dtype == torch.int32)
    return (q.is_cuda and int32 and unsupported(q, q_rope, cache, block_n, cfg, fp8) is None
            and torch.cuda.get_device_capability(q.device)[0] == 9 and nvrtc.available())


def launch_split(q: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, qk_scale: float, num_splits: int, chunks: int, min_split: int,
                 out: torch.Tensor, part_acc: torch.Tensor, part_ml: torch.Tensor, pdl: bool,
                 cfg: MlaCudaConfig = MLA_CUDA_CONFIG) -> None:
    """The split kernel over (head blocks of 16, rows, chunks): with one split the rows' outputs into `out`, else
    each split's (max, sum, acc) into part_ml / part_acc for attention._decode_reduce_kernel. qk_scale carries
    log2(e)."""
    n_rows, n_heads, lat = q.shape
    rope = q_rope.shape[2]
    single = num_splits == 1
    device = device_key(q.device)
    k = kernel(cfg, lat, rope, cache.shape[1], single, q.dtype == torch.bfloat16, pdl, min_split, cache.dtype == FP8,
               device)
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())     # noqa: E731
    i64 = ctypes.c_longlong
    args = [ptr(q), ptr(q_rope), ptr(cache), ptr(block_tables), ptr(seq_lens), ptr(out), ptr(part_acc),
            ptr(part_ml), i64(q.stride(0)), i64(q.stride(1)), i64(q_rope.stride(0)), i64(q_rope.stride(1)),
            i64(block_tables.stride(0)), i64(cache.stride(0)), i64(out.stride(0)), i64(out.stride(1)),
            ctypes.c_int(n_heads), ctypes.c_int(num_splits), ctypes.c_float(qk_scale)]
    k.launch((-(-n_heads // HEADS), n_rows, chunks), threads(cfg, cache.dtype == FP8), args,
             torch.cuda.current_stream(device).cuda_stream, pdl=pdl)
