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
"""

from __future__ import annotations

import ctypes
import functools
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


@dataclass(frozen=True, slots=True)
class MlaCudaConfig:
    """segments: the ring's slots of 16 cached rows (4 a tile; the shared memory holds up to 10 at DeepSeek's
    576-wide rows). early: as a programmatic dependent, copy every segment but the step's new row's before waiting
    for the kernel before (older rows are never written by it)."""
    segments: int = 10
    early: bool = True


MLA_CUDA_CONFIG = MlaCudaConfig()


def smem_bytes(cfg: MlaCudaConfig, lat: int, rope: int) -> int:
    pitch = (lat + rope) * 2 + 16
    return cfg.segments * 16 * pitch + HEADS * (lat + rope) * 2 + HEADS * TILE * 2 + 3 * 4 * HEADS * 4 \
        + 16 * cfg.segments


def ctas_per_sm(cfg: MlaCudaConfig, lat: int, rope: int) -> int:
    """1 or 2: as many CTAs as the ring lets an SM hold (their registers are budgeted for that many)."""
    return 2 if 2 * (smem_bytes(cfg, lat, rope) + 1024) <= SM_SMEM else 1


def source(cfg: MlaCudaConfig, lat: int, rope: int, block: int, single: bool, bf16: bool, pdl: bool,
           min_split: int) -> str:
    defines = dict(LAT=lat, ROPE=rope, BLOCK=block, SEGS=cfg.segments, SINGLE=int(single), BF16=int(bf16),
                   PDL=int(pdl), EARLY=int(cfg.early), MIN_SPLIT=min_split, MINB=ctas_per_sm(cfg, lat, rope))
    head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
    return head + COMMON.read_text() + SOURCE.read_text()


@functools.cache
def cubin(cfg: MlaCudaConfig, lat: int, rope: int, block: int, single: bool, bf16: bool, pdl: bool, min_split: int,
          arch: str = "90a") -> tuple[bytes, str]:
    return nvrtc.compile_cubin(source(cfg, lat, rope, block, single, bf16, pdl, min_split), "mla_decode", arch)


_kernels: dict[tuple, nvrtc.Kernel] = {}


def kernel(cfg: MlaCudaConfig, lat: int, rope: int, block: int, single: bool, bf16: bool, pdl: bool, min_split: int,
           device: torch.device) -> nvrtc.Kernel:
    key = (cfg, lat, rope, block, single, bf16, pdl, min_split, device.index)
    k = _kernels.get(key)
    if k is None:
        with torch.cuda.device(device):
            binary = cubin(cfg, lat, rope, block, single, bf16, pdl, min_split, nvrtc.arch_of(device))[0]
            k = nvrtc.Kernel(binary, "mla_decode", smem_bytes(cfg, lat, rope))
        _kernels[key] = k
    return k


def _aligned(t: torch.Tensor, *strides: int) -> bool:
    return t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in strides)


def unsupported(q: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, block_n: int,
                cfg: MlaCudaConfig = MLA_CUDA_CONFIG) -> str | None:
    """Why the kernel cannot run this call's shapes, or None: q [N, H, lat], q_rope [N, H, rope] (both multiples of
    64), cache [blocks, block_size, lat + rope] (one head, rows contiguous), all of one 16-bit dtype, 16-byte
    aligned rows; the plan's tiles of 64 rows; a ring of a tile's segments at least, within an SM's shared
    memory."""
    lat, rope = q.shape[2], q_rope.shape[2]
    width = lat + rope
    if q.dtype not in DTYPES or not q.dtype == q_rope.dtype == cache.dtype:
        return f"dtypes {q.dtype}, {q_rope.dtype}, {cache.dtype}: one of {list(DTYPES)} for all"
    if block_n != TILE:
        return f"the plan's tiles are {block_n} rows, the kernel's {TILE}"
    if lat % 64 or rope % 64 or cache.shape[2] != width or cache.stride(1) != width:
        return f"latent {lat} and rope {rope} (multiples of 64), rows {cache.shape[2]} wide, contiguous"
    if cache.shape[1] % 16:
        return f"cache blocks of {cache.shape[1]} rows: whole segments of 16 needed"
    if cfg.segments < 4 or smem_bytes(cfg, lat, rope) > SMEM_LIMIT:
        return f"a ring of {cfg.segments} segments: 4 to {SMEM_LIMIT} bytes of shared memory"
    if not (_aligned(q, q.stride(0), q.stride(1)) and _aligned(q_rope, q_rope.stride(0), q_rope.stride(1))
            and _aligned(cache, cache.stride(0))):
        return "queries or cache blocks not 16-byte aligned"
    return None


def supports(q: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, block_n: int,
             cfg: MlaCudaConfig = MLA_CUDA_CONFIG, meta: AttentionMetadata | None = None) -> bool:
    """Can the CUDA kernel run this call? Its shapes (unsupported), int32 block tables and lengths, on Hopper, with
    NVRTC."""
    int32 = meta is None or (meta.block_tables.dtype == meta.seq_lens.dtype == torch.int32)
    return (q.is_cuda and int32 and unsupported(q, q_rope, cache, block_n, cfg) is None
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
    k = kernel(cfg, lat, rope, cache.shape[1], single, q.dtype == torch.bfloat16, pdl, min_split, device)
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())     # noqa: E731
    i64 = ctypes.c_longlong
    args = [ptr(q), ptr(q_rope), ptr(cache), ptr(block_tables), ptr(seq_lens), ptr(out), ptr(part_acc),
            ptr(part_ml), i64(q.stride(0)), i64(q.stride(1)), i64(q_rope.stride(0)), i64(q_rope.stride(1)),
            i64(block_tables.stride(0)), i64(cache.stride(0)), i64(out.stride(0)), i64(out.stride(1)),
            ctypes.c_int(n_heads), ctypes.c_int(num_splits), ctypes.c_float(qk_scale)]
    k.launch((-(-n_heads // HEADS), n_rows, chunks), 160, args, torch.cuda.current_stream(device).cuda_stream,
             pdl=pdl)
