"""A chain of q8_0 GEMVs of up to 8 tokens in one persistent launch (gemv_chain.cu, compiled at run time by NVRTC).

Why: at a few tokens a step is a chain of small kernels, and each GEMV of a 10-60 MB matrix spends about as long in
its launch, ramp and tail as in its bytes: read from L2, the o projection's GEMV still takes 6.7 us against 9.2 from
HBM (bench/results/l2_prefetch.md). One launch that runs several matrices back to back, each CTA asking L2 for its
next weights before it waits for the stage before, lets the weights of stage s + 1 stream in under the tail of
stage s. This is a first step towards a persistent decode step (docs/kernels.md): products only (q8_0; the ring
engine also q4_1's planes), one stream, and not yet used by the models: bench/gemv_chain.py measures it against the
package's plans, which it does not beat yet (bench/results/gemv_chain.md). Two engines: items handed out to CTAs
whose warps load their own weights, and (ChainConfig.RING) a static schedule whose producer warp streams the weights
through a ring in shared memory, never waiting for the stage before, so the next matrix's bytes arrive while this
one's last items finish.

Each stage reads the planes the GEMV reads (fragment order), so no second copy of the weights exists. The torch
reference is `chain_ref`; quant_matmul.quant_matmul_ref is the product's.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from cobatch.kernels import nvrtc, quant_gemv, quant_pack
from cobatch.kernels.quant_gemm_cuda import BLOCKS_SIDE, COMMON, asm_literal

SOURCE = Path(__file__).with_suffix(".cu")
MAX_STAGES = 8
MAX_TOK = 8                    # mma.sync m16n8k16: the tokens are its N = 8
# the planes each engine reads: the item engine q8_0's; the ring engine also q4_1's (q4_1 and q4_K: 64-column chunks)
FORMATS = (quant_pack.Q8_0,)
RING_FORMATS = (quant_pack.Q8_0, quant_pack.Q4_1)
DTYPES = {torch.float16: 0, torch.bfloat16: 1}


@dataclass(frozen=True, slots=True)
class ChainConfig:
    """W warps a CTA (they split an item's K range), RT 16-row tiles a row block, CTAS CTAs an SM (the grid), U
    chunks a load group (loads run one group ahead), PF: each item's weights asked of L2 when it starts; a stage's
    K split across CTAs until it has ITEMS items a CTA of the grid (smaller items balance the CTAs' tails; each costs
    RT x 512 bytes of partial sums). A grid larger than fits the GPU still runs (a CTA only waits for items that
    running CTAs took), only slower."""
    W: int = 8
    RT: int = 1
    CTAS: int = 2
    U: int = 4
    ITEMS: int = 1
    PF: bool = False
    PIPE: bool = False   # the next item's first loads issued before this item's reduction
    RING: int = 0        # > 0: the ring engine, a producer warp streaming the weights through RING slots
    CH: int = 16         # the ring engine's chunks a slot (each of the W warps takes CH / W of them)
    OWN: bool = False    # the ring engine's warps take whole slots (slot k of an item to warp k % W)
    PRODUCERS: int = 1   # the ring engine's producer warps (producer p fills slots p, p + PRODUCERS, ...)
    ACC: int = 1         # the ring engine's accumulators a row tile (MMA m of a slot to m % ACC: shorter chains)

    def __post_init__(self):
        if self.W not in (1, 2, 4, 8) or self.RT not in (1, 2, 4) or self.CTAS < 1 or self.U not in (1, 2, 4, 8) \
                or self.ITEMS < 1:
            raise ValueError(f"ChainConfig needs W of 1-8, RT of 1, 2 or 4, U of 1-8 (powers of 2), CTAS and ITEMS "
                             f">= 1: {self}")
        ring_ok = (self.RING >= 2 and self.CH in (2, 4, 8, 16, 32) and (self.OWN or self.CH % self.W == 0)
                   and not (self.PF or self.PIPE) and self.ITEMS == 1
                   and self.PRODUCERS in (1, 2, 4) and self.RING % self.PRODUCERS == 0 and self.ACC in (1, 2, 4))
        if (self.RING and not ring_ok) or (not self.RING and (self.OWN or self.PRODUCERS != 1 or self.ACC != 1)):
            # a slot filled by one producer only: its waits for the slot's release by parity then never alias a lap
            raise ValueError(f"the ring engine needs RING >= 2, CH of 2-32 (a power of 2) divisible by W unless OWN, "
                             f"1, 2 or 4 PRODUCERS dividing RING, ACC of 1, 2 or 4, and neither PF, PIPE nor ITEMS "
                             f"(its items are whole row blocks); OWN, PRODUCERS and ACC are the ring engine's: {self}")

    @property
    def threads(self) -> int:
        return 32 * (self.W + self.PRODUCERS) if self.RING else 32 * self.W

    def smem_bytes(self, fmt_id: int = quant_pack.Q8_0) -> int:
        """The ring engine's slots (dynamic shared memory); the other engine has none."""
        return self.RING * self.RT * self.CH * (512 + BLOCKS_SIDE[fmt_id][1])


@dataclass(frozen=True)
class ChainStage:
    """out[:n_tok] = x[:n_tok] @ W.T (act: act(gate) * up of rows interleaved 8 by 8, out half as wide)."""
    planes: quant_pack.PackedPlanes
    x: torch.Tensor
    out: torch.Tensor
    act: str | None = None


def source(cfg: ChainConfig, dtype: torch.dtype, pdl: bool, fmt_id: int = quant_pack.Q8_0) -> str:
    defines = dict(W=cfg.W, RT=cfg.RT, U=cfg.U, PF=int(cfg.PF), PIPE=int(cfg.PIPE), RING=cfg.RING, CH=cfg.CH,
                   OWN=int(cfg.OWN), PRODUCERS=cfg.PRODUCERS, ACC=cfg.ACC, FMT=int(fmt_id == quant_pack.Q4_1),
                   DT=DTYPES[dtype], MAX_STAGES=MAX_STAGES, PDL=int(pdl))
    head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
    head += f"#define ASM_DEQUANT_Q8 {asm_literal(quant_gemv.ASM_Q8)}\n"
    head += f"#define ASM_DEQUANT_Q4 {asm_literal(quant_gemv.ASM_NIB_AFFINE)}\n"
    return head + COMMON.read_text() + SOURCE.read_text()


@functools.cache
def cubin(cfg: ChainConfig, dtype: torch.dtype, pdl: bool, arch: str = "90a",
          fmt_id: int = quant_pack.Q8_0) -> tuple[bytes, str]:
    return nvrtc.compile_cubin(source(cfg, dtype, pdl, fmt_id), "gemv_chain", arch)


_kernels: dict[tuple, nvrtc.Kernel] = {}


def kernel(cfg: ChainConfig, dtype: torch.dtype, pdl: bool, device: torch.device,
           fmt_id: int = quant_pack.Q8_0) -> nvrtc.Kernel:
    key = (cfg, dtype, pdl, device.index, fmt_id)
    k = _kernels.get(key)
    if k is None:
        with torch.cuda.device(device):
            k = _kernels[key] = nvrtc.Kernel(cubin(cfg, dtype, pdl, nvrtc.arch_of(device), fmt_id)[0], "gemv_chain",
                                             cfg.smem_bytes(fmt_id))
    return k


def split_of(planes: quant_pack.PackedPlanes, cfg: ChainConfig, ctas: int) -> int:
    """K ranges a row block is split into across CTAs: the fewest that give ITEMS items a CTA of the grid, each warp's
    share of a range a whole number of U-chunk groups (at most down to one group a warp)."""
    blocks, n_chunks = planes.rows_pad // (16 * cfg.RT), planes.qs.shape[1] // 512
    if cfg.RING:
        if n_chunks % cfg.CH or planes.rows_pad % (16 * cfg.RT):
            raise ValueError(f"{planes.rows_pad} rows x {n_chunks} chunks do not divide into row blocks of {cfg.RT} "
                             f"tiles and slots of {cfg.CH} chunks: {cfg}")
        return 1
    splits = [s for s in range(1, n_chunks + 1) if n_chunks % s == 0 and (n_chunks // s) % (cfg.W * cfg.U) == 0]
    if not splits or planes.rows_pad % (16 * cfg.RT):
        raise ValueError(f"{planes.rows_pad} rows x {n_chunks} chunks do not divide into row blocks of {cfg.RT} tiles "
                         f"and {cfg.W} warps' groups of {cfg.U} chunks: {cfg}")
    return next((s for s in splits if blocks * s >= cfg.ITEMS * ctas), splits[-1])


class _Stage(ctypes.Structure):
    _fields_ = [("qs", ctypes.c_void_p), ("d", ctypes.c_void_p), ("x", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("partial", ctypes.c_void_p), ("arrivals", ctypes.c_void_p),
                ("blocks", ctypes.c_int), ("n_chunks", ctypes.c_int), ("split", ctypes.c_int), ("act", ctypes.c_int),
                ("x_stride", ctypes.c_int), ("out_stride", ctypes.c_int), ("rows", ctypes.c_int),
                ("out_dt", ctypes.c_int)]


class _Chain(ctypes.Structure):
    _fields_ = [("stage", _Stage * MAX_STAGES), ("counters", ctypes.c_void_p), ("n_stages", ctypes.c_int),
                ("n_tok", ctypes.c_int)]


class ChainScratch:
    """The counters (zero between launches: each launch re-arms them) and each stage's split-K partial sums and
    row-block arrivals, for one stream's chains on one device; grown outside CUDA-graph captures (reserve)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.counters = torch.zeros(2 * MAX_STAGES + 1, dtype=torch.int32, device=device)
        self.partial = [torch.empty(0, dtype=torch.float32, device=device) for _ in range(MAX_STAGES)]
        self.arrivals = [torch.zeros(0, dtype=torch.int32, device=device) for _ in range(MAX_STAGES)]

    def reserve(self, s: int, items: int, blocks: int, rt: int) -> None:
        if self.partial[s].numel() < items * rt * 128:
            self.partial[s] = torch.empty(items * rt * 128, dtype=torch.float32, device=self.device)
        if self.arrivals[s].numel() < blocks:
            self.arrivals[s] = torch.zeros(blocks, dtype=torch.int32, device=self.device)


def check(stage: ChainStage, n_tok: int, formats: tuple[int, ...] = FORMATS) -> None:
    p, x, out = stage.planes, stage.x, stage.out
    problems = []
    if p.fmt_id not in formats or not p.fragment or p.cols != p.cols_pad:
        names = " or ".join("q8_0" if f == quant_pack.Q8_0 else "q4_1's (q4_1, q4_K)" for f in formats)
        problems.append(f"{names} fragment-order planes without padded columns")
    if x.dtype not in DTYPES or out.dtype not in DTYPES:
        problems.append("x and out f16 or bf16")
    if x.shape[-1] != p.cols or x.stride(-1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        problems.append("x [n_tok, cols], rows 16-byte aligned")
    if out.stride(-1) != 1 or out.shape[-1] != (p.rows // 2 if stage.act else p.rows):
        problems.append("out [n_tok, rows] (rows / 2 with act)")
    if not 1 <= n_tok <= MAX_TOK or x.shape[0] < n_tok or out.shape[0] < n_tok:
        problems.append(f"1 to {MAX_TOK} tokens")
    if problems:
        raise ValueError("gemv_chain needs " + "; ".join(problems))


def launch(stages: list[ChainStage], n_tok: int, cfg: ChainConfig, scratch: ChainScratch,
           pdl: bool = False) -> None:
    """Run the stages in order in one launch on the current stream. A stage may read what an earlier one wrote.
    The stages' planes are of one format (the kernel is compiled for it)."""
    if not 1 <= len(stages) <= MAX_STAGES:
        raise ValueError(f"gemv_chain runs 1 to {MAX_STAGES} stages, not {len(stages)}")
    fmt_id, dtype = stages[0].planes.fmt_id, stages[0].x.dtype
    if any(st.planes.fmt_id != fmt_id for st in stages):
        raise ValueError("gemv_chain needs the stages' planes of one format")
    if any(st.x.dtype != dtype for st in stages):
        raise ValueError("gemv_chain needs the stages' x of one dtype (the kernel is compiled for it)")
    device = scratch.device
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    ctas = sms * cfg.CTAS
    chain = _Chain()
    for s, st in enumerate(stages):
        check(st, n_tok, RING_FORMATS if cfg.RING else FORMATS)
        p = st.planes
        split, blocks, n_chunks = split_of(p, cfg, ctas), p.rows_pad // (16 * cfg.RT), p.qs.shape[1] // 512
        if split > 1:                                  # partial sums only where K is split (never on the ring)
            scratch.reserve(s, blocks * split, blocks, cfg.RT)
        chain.stage[s] = _Stage(p.qs.data_ptr(), p.d.data_ptr(), st.x.data_ptr(), st.out.data_ptr(),
                                scratch.partial[s].data_ptr(), scratch.arrivals[s].data_ptr(), blocks, n_chunks, split,
                                quant_gemv.ACTS[st.act], st.x.stride(0), st.out.stride(0), p.rows,
                                DTYPES[st.out.dtype])
    chain.counters, chain.n_stages, chain.n_tok = scratch.counters.data_ptr(), len(stages), n_tok
    k = kernel(cfg, dtype, pdl, device, fmt_id)
    if cfg.RING and k.resident_per_sm(cfg.threads) < cfg.CTAS:
        # a static schedule waits for items that only running CTAs can finish: every CTA must be resident at once
        raise ValueError(f"the ring engine's {cfg.CTAS} CTAs an SM do not fit ({k.resident_per_sm(cfg.threads)} do): "
                         f"{cfg}")
    k.launch((ctas, 1, 1), cfg.threads, [chain], torch.cuda.current_stream(device).cuda_stream, pdl=pdl)


def chain_ref(stages: list[tuple[object, str | None]], x: torch.Tensor) -> torch.Tensor:
    """The torch reference: each stage's product (quant_matmul_ref on its QuantWeight) of the stage before's output,
    rounded to x's dtype between stages, and act(gate) * up where a stage has an act."""
    from cobatch.kernels.activation import gated_mul_ref
    from cobatch.kernels.quant_matmul import quant_matmul_ref
    for weight, act in stages:
        y = quant_matmul_ref(x, weight).to(x.dtype)
        x = gated_mul_ref(y, act, interleaved=True) if act else y
    return x


# Decode steps' feed-forward through the chain, behind a switch until whole steps are timed: COBATCH_CHAIN_MLP
# names a ring config's fields ("RING=24,CH=8,OWN=1,W=8"; "1": RING_MLP_DEFAULT), and steps of up to MAX_TOK rows
# whose gate|up and down planes it reads run gate|up (act) then down in one launch (ops.feed_forward). The ring needs
# no partial sums, only the device's counters (reserve_mlp_scratch, at load): one chain at a time on a device, which
# holds while the models' only feed-forward beside another stream's work is DeepSeek's shared experts beside the
# routed ones.
RING_MLP_DEFAULT = ChainConfig(W=8, RT=1, CTAS=1, RING=24, CH=8, OWN=True)


def config_from_spec(spec: str) -> ChainConfig | None:
    """"" or "0": None (the switch off); "1": RING_MLP_DEFAULT; else comma-separated FIELD=int of a ring
    ChainConfig (RING > 0)."""
    spec = spec.strip()
    if spec in ("", "0"):
        return None
    if spec == "1":
        return RING_MLP_DEFAULT
    fields = {}
    for part in spec.split(","):
        name, _, value = part.partition("=")
        if name.strip() not in ChainConfig.__dataclass_fields__ or not value.strip().lstrip("-").isdigit():
            raise ValueError(f"COBATCH_CHAIN_MLP: {part!r} is not FIELD=int of ChainConfig")
        kind = ChainConfig.__dataclass_fields__[name.strip()].type
        fields[name.strip()] = bool(int(value)) if kind in (bool, "bool") else int(value)
    cfg = ChainConfig(**fields)
    if not cfg.RING:
        raise ValueError(f"COBATCH_CHAIN_MLP: the feed-forward takes the ring engine (RING > 0), not {cfg}")
    return cfg


MLP_CONFIG = config_from_spec(os.environ.get("COBATCH_CHAIN_MLP", ""))
_mlp_scratch: dict[int, ChainScratch] = {}


def reserve_mlp_scratch(device: torch.device) -> None:
    """The device's counters for feed_forward's chains (at load: never inside a CUDA-graph capture)."""
    if MLP_CONFIG is None or device.type != "cuda":
        return
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _mlp_scratch:
        _mlp_scratch[index] = ChainScratch(torch.device("cuda", index))


def feed_forward(h: torch.Tensor, gate_up, down, act: str, dtype: torch.dtype,
                 cfg: ChainConfig) -> torch.Tensor | None:
    """(act(h @ gate.T) * (h @ up.T)) @ down.T in `dtype` as one chain launch, or None where the chain does not take
    these weights and rows (then the caller runs its own kernels). h: [rows, cols] in its weights' operand dtype."""
    rows = h.shape[0]
    planes = [getattr(w, "planes", None) for w in (gate_up, down)]
    formats = RING_FORMATS if cfg.RING else FORMATS
    if (not h.is_cuda or not 1 <= rows <= MAX_TOK or h.dtype not in DTYPES or dtype not in DTYPES
            or not getattr(gate_up, "gate_up_interleaved", False) or act is None or act not in quant_gemv.ACTS
            or any(p is None or not p.fragment or p.fmt_id not in formats or p.cols != p.cols_pad for p in planes)
            or planes[0].fmt_id != planes[1].fmt_id or h.stride(-1) != 1 or h.stride(0) % 8 or h.data_ptr() % 16):
        return None
    scratch = _mlp_scratch.get(h.device.index)
    if scratch is None:
        return None
    try:
        for p in planes:
            split_of(p, cfg, 1)
    except ValueError:
        return None
    mid = torch.empty(rows, planes[0].rows // 2, dtype=h.dtype, device=h.device)
    out = torch.empty(rows, planes[1].rows, dtype=dtype, device=h.device)
    launch([ChainStage(planes[0], h, mid, act), ChainStage(planes[1], mid, out)], rows, cfg, scratch)
    return out
