"""Which kernel and config a quantized weight runs at each token count: its MatmulPlan, looked up at load in the
plan table (quant_configs.json, measured on the H200 by bench/kernels.py --sweep and bench/gemm.py; nothing is
autotuned at run time).

A plan splits the token counts of a call into ranges:
  - narrow (n_tok <= crossover, decode): the Gluon GEMV on CUDA (quant_gemv.py, fragment-order planes: a GemvPlan
    of token tiers), else the Triton kernel's narrow tiles (quant_matmul.py);
  - mid (crossover < n_tok <= mid_upto, busy decode steps; Hopper): the Gluon quantized GEMM of quant_gemm.py, which
    reads every weight byte once per call on warpgroup MMAs from the same planes; or, where the table names it (for
    all of mid, or a `first` range of the fewest tokens), the CUDA C++ GEMM of quant_gemm_cuda.py; past `wide_from`
    a `wide` config of the same split of K;
  - gemm (past them, prefill): DEQUANT_CUBLAS (the weight's dense matrix written once per call, then cuBLAS), or the
    Triton kernel's big tiles.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import torch

from cobatch.kernels import quant_gemm, quant_gemm_cuda, quant_gemv, quant_pack
from cobatch.kernels.quant_gemm import GemmConfig
from cobatch.kernels.quant_gemm_cuda import CudaGemmConfig
from cobatch.kernels.quant_gemv import GemvConfig, GemvPlan
from cobatch.kernels.quant_matmul import TileConfig
from cobatch.kernels.quant_pack import PACKED_FORMATS, PackedPlanes
from cobatch.kernels.triton_support import interpreting, num_sms

CONFIG_PATH = Path(__file__).with_name("quant_configs.json")


# Used when quant_configs.json has no entry for a format/shape.
DEFAULT_NARROW = TileConfig(BM=16, BN=64, BK=256, split_k=1, num_warps=4, num_stages=3)
DEFAULT_GEMM = TileConfig(BM=128, BN=128, BK=64, split_k=1, num_warps=8, num_stages=3)
DEFAULT_CROSSOVER = 16
INTERPRETER_NARROW = TileConfig(BM=16, BN=32, BK=64, split_k=2)   # small tiles keep the CPU tests fast
INTERPRETER_GEMM = TileConfig(BM=32, BN=32, BK=64)
GEMV_CROSSOVER = 16             # the Gluon GEMV's token tiles are 8 and 16 wide
# measured: the quantized GEMM beats dequantize + cuBLAS up to here (bench/results/gemm.md)
QUANT_GEMM_UPTO = 128
# A shape without a crossover of its own hands calls of more tokens than this to the quantized GEMM. At 8, Qwen2.5-7B's
# unplanned shapes ran B = 12 and 16 in 3.9 ms against 5.7 on the GEMV's default 16-token tier
# (bench/results/gemm_ring_defaults.md), as most Llama-3-8B plans cross at 8; but a session would then keep its bits
# beside 7 others, not 15: a lone prompt's prefill of 9-16 rows and a step of a few decoders and a short prompt would
# part ways (tests/test_gpu_engine.py, test_gpu_batched_equals_alone). Kept at the GEMV's whole range.
QUANT_GEMM_CROSSOVER = GEMV_CROSSOVER
# A shape without a GEMM plan of its own runs quant_gemm.default_ring_config (shaped like the Llama-3-8B plans);
# COBATCH_GEMM_RING_DEFAULT=0 gives it the register path's quant_gemm.default_config instead, for comparisons
RING_DEFAULT = os.environ.get("COBATCH_GEMM_RING_DEFAULT", "1") != "0"
# A shape without a GEMV plan of its own runs default_gemv_plan: with DEEP_GEMV_DEFAULT one row tile a warp and its
# loads up to 16 K steps ahead (deep_gemv_config), else default_gemv_config's 4 row tiles a warp with K split to 2 CTAs
# an SM. COBATCH_DEEP_GEMV_DEFAULT=0 keeps the second, for comparisons.
DEEP_GEMV_DEFAULT = os.environ.get("COBATCH_DEEP_GEMV_DEFAULT", "1") != "0"
# With GEMV_TAILS the deep default's loads run up to 16 K steps ahead whatever a warp's step count, the steps past its
# last whole iteration running as a tail (quant_gemv's TAIL); without it (COBATCH_GEMV_TAILS=0, for comparisons) they
# run as far ahead as a power of two that divides the count: Qwen2.5-7B's 4-bit qkv, o and down (14 and 74 steps a
# warp) at U = 2, its q8_0 weights at U = 4. Whole Qwen2.5-7B steps, 14 layers, B = 1 / 8: q8_0 1.83 / 1.96 -> 1.75 /
# 1.89 ms, Q4_K_M 1.47 / 1.59 -> 1.42 / 1.57 (bench/results/gemv_default_tails_ab.md, H100).
GEMV_TAILS = os.environ.get("COBATCH_GEMV_TAILS", "1") != "0"
# With DEEP_GEMV_WIDE_LONG_K the deep default runs 8 warps a CTA where 4 would each walk LONG_K_STEPS K steps or more,
# as every Llama-3-8B down plan that won does (q8_0's, q4_K's, q6_K's: bench/results/gemv_plans_whole_k_ab.md).
# Qwen2.5-7B's steps on top of the tails, B = 1 / 8: q8_0 1.75 / 1.89 -> 1.72 / 1.84 ms, Q4_K_M 1.42 / 1.57 -> 1.35 /
# 1.49 (the same file). COBATCH_DEEP_GEMV_WIDE_LONG_K=0 keeps 4 warps, for comparisons.
DEEP_GEMV_WIDE_LONG_K = os.environ.get("COBATCH_DEEP_GEMV_WIDE_LONG_K", "1") != "0"
LONG_K_STEPS = 56

# plan.gemm may be this instead of a TileConfig: dequantize into a shared scratch matrix, then cuBLAS.
DEQUANT_CUBLAS = "dequant+cublas"


@dataclass(frozen=True, slots=True)
class MatmulPlan:
    """The tile configs of one weight: chosen at load, fixed for the process."""
    narrow: TileConfig | GemvPlan   # GemvPlan: the Gluon kernel on fragment-order planes
    gemm: TileConfig | str   # a TileConfig, or DEQUANT_CUBLAS
    crossover: int           # n_tok <= crossover -> narrow
    # crossover < n_tok <= mid_upto -> the quantized GEMM (quant_gemm.py, or quant_gemm_cuda.py's CudaGemmConfig)
    mid: GemmConfig | CudaGemmConfig | None = None
    mid_upto: int = 0
    # wide_from < n_tok <= mid_upto -> the GEMM in config `wide` (the TMA variant: it wins at 128-256 tokens
    # and loses below). Same split of K as `mid`, so a row's bits do not change where the plan switches.
    wide: GemmConfig | CudaGemmConfig | None = None
    wide_from: int = 0
    # crossover < n_tok <= first_upto -> the GEMM in config `first`, ahead of mid: a kernel that wins on the fewest
    # tokens only (the CUDA C++ GEMM on small matrices at 16-32 tokens). Batch invariance holds within each range.
    first: GemmConfig | CudaGemmConfig | None = None
    first_upto: int = 0

    def __post_init__(self):
        if self.wide is not None and (self.mid is None or self.wide.split_k != self.mid.split_k):
            raise ValueError(f"the wide GEMM config needs the mid config's split of K: {self.mid} / {self.wide}")

    def config_for(self, n_tok: int) -> "TileConfig | GemvPlan | GemmConfig | str":
        if n_tok <= self.crossover:
            return self.narrow
        if self.first is not None and n_tok <= self.first_upto:
            return self.first
        if self.mid is not None and n_tok <= self.mid_upto:
            return self.wide if self.wide is not None and n_tok > self.wide_from else self.mid
        return self.gemm

    def gemm_ranges(self) -> list[tuple[GemmConfig | CudaGemmConfig, int]]:
        """Each GEMM config of the plan, with the most tokens a call it serves has."""
        return [(c, upto) for c, upto in ((self.first, self.first_upto), (self.mid, self.mid_upto),
                                          (self.wide, self.mid_upto)) if c is not None]

    def gemm_configs(self) -> list[GemmConfig | CudaGemmConfig]:
        return [c for c, _ in self.gemm_ranges()]


@lru_cache(maxsize=None)
def _config_table(path: str) -> dict:
    p = Path(path)
    return json.loads(p.read_text()) if p.exists() else {}


def default_split_k(n_rows: int, n_cols_pad: int, cfg: TileConfig, sms: int = 132) -> int:
    """Enough programs to fill the GPU about twice: small matrices split K, big ones don't."""
    tiles = -(-n_rows // cfg.BN)
    k_tiles = n_cols_pad // cfg.BK
    split = 1
    while tiles * split < 2 * sms and split * 2 <= 8 and k_tiles % (split * 2) == 0:
        split *= 2
    return split


def uses_gemv(fmt_name: str, device: torch.device) -> bool:
    """Does this weight go through the Gluon GEMV (fragment-order planes)? CUDA only: Gluon has no
    interpreter. COBATCH_TRITON_GEMV=1 keeps the Triton kernel (for comparisons)."""
    return (torch.device(device).type == "cuda" and not interpreting() and quant_gemv.gluon is not None
            and PACKED_FORMATS.get(fmt_name) in quant_pack.FRAGMENT_FORMATS
            and os.environ.get("COBATCH_TRITON_GEMV") != "1")


def default_gemv_config(fmt_name: str, n_rows_pad: int, n_chunks: int, sms: int = 132) -> GemvConfig:
    """The default plan's config with DEEP_GEMV_DEFAULT off.
    4 warps x 4 row tiles per CTA (64 rows); split K across CTAs until there are about 2 CTAs per SM
    (what the H200 sweep preferred for shapes without an entry in quant_configs.json), by the fewest of the warps'
    chunks' divisors up to 16 that get there (11 splits for 44 chunks a warp group, where doubling from 1 stopped
    at 1: DeepSeek-V2-Lite's shared down, 32 CTAs); each warp's loads up to 4 K steps ahead (loads_ahead). The
    4-bit formats (the 5-bit ones with them) get a register budget: it won 14 of their 16 plan tiers on the Llama-3-8B
    shapes, q8_0 and q6_K about half (bench/results/gemv-ab-2026-11-29-xvec-regs.json at 5a66009^)."""
    w, rt = 4, 4
    ctas = n_rows_pad // (16 * rt)
    splits = [d for d in range(1, 17) if (n_chunks // w) % d == 0]
    split = next((d for d in splits if ctas * d >= 2 * sms), splits[-1])
    return GemvConfig(W=w, RT=rt, split_k=split, U=loads_ahead(n_chunks // (w * split)), D=0,
                      R=128 if fmt_name in ("q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k") else 0)


def default_gemv_plan(fmt_name: str, n_rows_pad: int, n_chunks: int, sms: int = 132) -> GemvPlan:
    """The GEMV plan of a shape without one in the table, one config for calls of 1-16 tokens."""
    if DEEP_GEMV_DEFAULT:
        return GemvPlan(deep_gemv_config(n_rows_pad, n_chunks, sms))
    return GemvPlan(default_gemv_config(fmt_name, n_rows_pad, n_chunks, sms))


def deep_gemv_config(n_rows_pad: int, n_chunks: int, sms: int = 132) -> GemvConfig:
    """4 warps (DEEP_GEMV_WIDE_LONG_K: 8 where K is long) of one 16-row tile each (16 rows a CTA), K split only as far
    as one CTA an SM needs, by the fewest divisor that leaves each warp a multiple of 4 K steps (else the fewest), and
    each warp's loads up to 16 K steps ahead, with a register budget to hold them. Why: the plans the sweeps chose
    where they beat the split default by most were of this shape (DeepSeek-V2-Lite's q|kv_a, o and shared gate|up,
    Llama-3-8B q8_0's qkv: one row tile a warp, 8-16 K steps in flight, no split), and a warp that walks K one step
    at a time waits a load round trip each (Qwen2.5-7B's qkv and down, 7 and 37 steps a warp, ran so). In whole
    steps it took Qwen2.5-7B's from 1.7-2.1x their roofline to 1.36-1.54x at B = 1-16, and beat Llama-3-8B q8_0's
    own plans (bench/results/gemv_deep_default.md)."""
    warps = 8 if DEEP_GEMV_WIDE_LONG_K and n_chunks // 4 >= LONG_K_STEPS else 4
    steps = n_chunks // warps                        # K steps a warp walks without a split
    splits = [d for d in range(1, 17) if steps % d == 0 and n_rows_pad // 16 * d >= sms] or [1]
    split = next((d for d in splits if steps // d % 4 == 0), splits[0])
    u = loads_ahead(steps // split, most=16, tail=GEMV_TAILS)
    return GemvConfig(W=warps, RT=1, split_k=split, U=u, D=0, R=128)


def default_gemm_config(fmt_name: str, rows_pad: int, n_chunks: int, sms: int = 132) -> GemmConfig:
    """The mid-batch GEMM config of a shape without one in the table (RING_DEFAULT: the ring's), for `sms`
    multiprocessors."""
    if RING_DEFAULT:
        return quant_gemm.default_ring_config(rows_pad, n_chunks, PACKED_FORMATS[fmt_name] in quant_pack.BYTE_FORMATS,
                                              sms)
    return quant_gemm.default_config(rows_pad, n_chunks, sms)


def loads_ahead(steps: int, most: int = 4, tail: bool = False) -> int:
    """The GEMV's U for a warp of `steps` K steps: the largest power of two up to `most` that divides them, or with
    `tail` (the steps past the last whole iteration run as the kernel's tail) that is no more than them. A warp
    whose steps run one at a time waits a load round trip each (DeepSeek-V2-Lite's routed down at one token: 12
    steps, 21 us for 18 MB)."""
    return next(u for u in (16, 8, 4, 2, 1) if u <= most and (u <= steps if tail else steps % u == 0))


def uses_quant_gemm(device: torch.device) -> bool:
    """Does a GEMV weight on this device also get the quantized GEMM for mid-size batches? Hopper (wgmma)
    only; COBATCH_QUANT_GEMM=0 keeps dequantize + cuBLAS there (for comparisons)."""
    device = torch.device(device)
    return (device.type == "cuda" and quant_gemm.warpgroup_mma is not None
            and torch.cuda.get_device_capability(device)[0] == 9 and os.environ.get("COBATCH_QUANT_GEMM") != "0")


def table_gemv_plan(entry: dict) -> GemvPlan:
    """The GEMV plan of a table entry: "gemv", and "gemv_upto" {"max_tok": config}, the sweep's better configs for
    calls of few tokens."""
    upto = sorted((int(n), GemvConfig(**c)) for n, c in (entry.get("gemv_upto") or {}).items())
    return GemvPlan(GemvConfig(**entry["gemv"]), tuple(upto))


def gemv_chunks(fmt_name: str, n_cols_pad: int) -> int:
    return n_cols_pad // (32 if PACKED_FORMATS.get(fmt_name) in quant_pack.BYTE_FORMATS else 64)


# A checkpoint format takes, shape by shape, the configs of the GGUF format whose kernel loops it shares, under the
# ones of its own (a sweep of its GEMV alone keeps the other's GEMM configs): FP8's planes are q8_0's (only the
# byte decode differs), NVFP4's hold q4_K's bytes a weight.
PLANS_LIKE = {"fp8_e4m3": "q8_0", "nvfp4": "q4_k"}
# The 5-bit formats take the plans of the 4-bit format whose planes theirs extend (the kernels' loops are the same
# but for the fifth bits); COBATCH_Q5_PLANS_LIKE_Q4=0 leaves them the defaults (for comparisons).
if os.environ.get("COBATCH_Q5_PLANS_LIKE_Q4", "1") != "0":
    PLANS_LIKE.update({"q5_0": "q4_0", "q5_1": "q4_1", "q5_k": "q4_k"})


def nearest_shape(n_rows: int, n_cols: int, shapes: list[str]) -> str | None:
    """Of the "NxK" keys in `shapes`: "n_rows x n_cols" itself, else the one of K = n_cols whose N is nearest to
    n_rows by ratio (the larger on a tie), else None. Every config's rows per CTA divides the planes' row padding,
    so any entry's configs run any row count."""
    exact = f"{n_rows}x{n_cols}"
    if exact in shapes:
        return exact
    same_k = [int(key.split("x")[0]) for key in shapes if key.split("x")[1] == str(n_cols)]
    if not same_k:
        return None
    rows = min(same_k, key=lambda r: (abs(math.log(r / n_rows)), -r))
    return f"{rows}x{n_cols}"


def gemm_config(entry: dict) -> GemmConfig | CudaGemmConfig:
    """A plan entry's GEMM config: the CUDA C++ kernel's where the entry names it (quant_gemm_cuda.PLAN_KERNEL), else
    the Gluon kernel's."""
    if entry.get("kernel") == quant_gemm_cuda.PLAN_KERNEL:
        return quant_gemm_cuda.from_plan_entry(entry)
    return GemmConfig(**entry)


def plan_for(fmt_name: str, n_rows: int, n_cols: int, n_cols_pad: int, gemv: bool = False,
             quant_gemm_too: bool = False, sms: int = 132) -> MatmulPlan:
    """Look up (format, "NxK") in quant_configs.json (for FP8 and NVFP4 over PLANS_LIKE's format's entry), else
    the entry of the same K whose row count is nearest (nearest_shape: a stacked q|k, say, runs the plans of the
    q|k|v it is a part of), else the format's default, else the built-in default.
    gemv: the weight runs the Gluon GEMV (its configs are the entry's "gemv" and "gemv_upto", else
    default_gemv_plan). quant_gemm_too (with gemv): mid-size batches run the quantized GEMM (the entry's
    "quant_gemm" config and "quant_gemm_upto", else default_gemm_config and QUANT_GEMM_UPTO), from
    the entry's "quant_gemm_crossover" (else QUANT_GEMM_CROSSOVER) on, and past "quant_gemm_wide_from"
    the entry's "quant_gemm_wide" config when it has one; up to "quant_gemm_first_upto" tokens, the entry's
    "quant_gemm_first" config when it has one. sms: the GPU's multiprocessors, which the defaults split K to
    fill (the table's entries were chosen on the H200's 132)."""
    if interpreting():
        return MatmulPlan(INTERPRETER_NARROW, INTERPRETER_GEMM, 4)
    table = _config_table(os.environ.get("COBATCH_QUANT_CONFIGS", str(CONFIG_PATH)))
    formats = table.get("formats", {})
    fmt_table = formats.get(fmt_name, {})
    like_shapes = formats.get(PLANS_LIKE.get(fmt_name), {}).get("shapes", {})
    shape = nearest_shape(n_rows, n_cols, [*fmt_table.get("shapes", {}), *like_shapes])
    own = fmt_table.get("shapes", {}).get(shape, {})
    like = like_shapes.get(shape, {})
    if "gemv" in own:    # a GEMV plan of its own replaces the borrowed one whole: its tiers share its K split
        like = {k: v for k, v in like.items() if k != "gemv_upto"}
    if PACKED_FORMATS.get(fmt_name) not in quant_gemm_cuda.FORMATS:   # borrowed CUDA C++ GEMM configs: not its planes
        like = {k: v for k, v in like.items()
                if not (isinstance(v, dict) and v.get("kernel") == quant_gemm_cuda.PLAN_KERNEL)}
    entry = {**table.get("default", {}), **fmt_table.get("default", {}), **like, **own}
    narrow = TileConfig.parse(entry["narrow"]) if "narrow" in entry else DEFAULT_NARROW
    if "narrow" not in entry or entry["narrow"].get("split_k") is None:
        narrow = TileConfig(narrow.BM, narrow.BN, narrow.BK, default_split_k(n_rows, n_cols_pad, narrow),
                            narrow.num_warps, narrow.num_stages)
    gemm = entry.get("gemm", DEFAULT_GEMM)
    gemm = gemm if isinstance(gemm, (TileConfig, str)) else TileConfig.parse(gemm)
    crossover = int(entry.get("crossover", DEFAULT_CROSSOVER))
    if gemv:   # fragment-order planes: the Triton GEMM tiers cannot read them
        gemm = DEQUANT_CUBLAS
        rows_pad = -(-n_rows // quant_pack.ROW_PAD) * quant_pack.ROW_PAD
        if "gemv" in entry:
            narrow = table_gemv_plan(entry)
        else:
            narrow = default_gemv_plan(fmt_name, rows_pad, gemv_chunks(fmt_name, n_cols_pad), sms)
        crossover = int(entry.get("gemv_crossover", GEMV_CROSSOVER))
        if quant_gemm_too:
            mid = (gemm_config(entry["quant_gemm"]) if "quant_gemm" in entry
                   else default_gemm_config(fmt_name, rows_pad, gemv_chunks(fmt_name, n_cols_pad), sms))
            wide = gemm_config(entry["quant_gemm_wide"]) if "quant_gemm_wide" in entry else None
            first = gemm_config(entry["quant_gemm_first"]) if "quant_gemm_first" in entry else None
            return MatmulPlan(narrow, gemm, int(entry.get("quant_gemm_crossover", QUANT_GEMM_CROSSOVER)), mid,
                              int(entry.get("quant_gemm_upto", QUANT_GEMM_UPTO)), wide,
                              int(entry.get("quant_gemm_wide_from", 0)), first,
                              int(entry.get("quant_gemm_first_upto", 0)))
    return MatmulPlan(narrow, gemm, crossover)


def load_plan(fmt_name: str, rows: int, cols: int, planes: PackedPlanes, device: torch.device,
              keep_dense: bool = False) -> MatmulPlan:
    """The plan a weight packed into `planes` gets at load, from the table in force (plan_for). A resident dense
    copy (keep_dense: --dense-large-batch) serves every batch past the GEMV itself."""
    device = torch.device(device)
    plan = plan_for(fmt_name, rows, cols, planes.cols_pad, gemv=planes.fragment,
                    quant_gemm_too=planes.fragment and not keep_dense and uses_quant_gemm(device)
                    and PACKED_FORMATS[fmt_name] in quant_gemm.FORMATS,
                    sms=num_sms(device.index if device.index is not None else torch.cuda.current_device())
                    if device.type == "cuda" else 132)
    if isinstance(plan.first, CudaGemmConfig) and not quant_gemm_cuda.nvrtc.available():
        plan = replace(plan, first=None, first_upto=0)      # without NVRTC the mid config takes those calls too
    for cfg, upto in plan.gemm_ranges():
        if isinstance(cfg, CudaGemmConfig) and not quant_gemm_cuda.supports(planes, cfg, upto):
            raise ValueError(f"the plan table gives the {fmt_name} {rows}x{cols} weight a CUDA C++ GEMM config it "
                             f"cannot run: {cfg}")
    return plan
