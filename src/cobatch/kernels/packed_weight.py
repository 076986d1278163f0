"""What the GPU model holds for one linear layer: a PackedWeight, repacked once at load, then `matmul` per step.

At load a weight's GGUF blocks become the planes its kernels read (quant_pack.py: fragment order for the Gluon GEMV
and GEMM on CUDA) and it gets its plan (matmul_plans.py); the shared scratch its kernels need (split-K partials,
the dense matrix of DEQUANT_CUBLAS, the GEMM's x operands) is grown then, never inside a CUDA-graph capture. Per
call, `matmul` runs the kernel the plan gives the call's token count. Formats without a packed layout (q2_K, q3_K,
f16/bf16/f32 matrices) are dequantized once at load to a dense matrix and go through F.linear: correct, but they
read 2 bytes per weight.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from cobatch.kernels import quant_gemm, quant_gemm_cuda, quant_gemv, quant_matmul, quant_pack
from cobatch.kernels.activation import gated_mul_triton
from cobatch.kernels.matmul_plans import DEQUANT_CUBLAS, MatmulPlan, load_plan, uses_gemv
from cobatch.kernels.operand_order import NATURAL, order_of
from cobatch.kernels.quant_gemm import GemmConfig
from cobatch.kernels.quant_gemm_cuda import CudaGemmConfig
from cobatch.kernels.quant_gemv import GemvConfig, GemvPlan
from cobatch.kernels.quant_matmul import TileConfig, dequantize_planes
from cobatch.kernels.quant_pack import PACKED_FORMATS, PackedPlanes, pack_planes
from cobatch.kernels.scratch import DeviceScratch, SplitScratch
from cobatch.kernels.triton_support import interpreting
from cobatch.quant.weight import QuantWeight

# PackedWeight.operand_dtype: f16 where the GEMV and the GEMM read it natively (COBATCH_F16_OPERANDS=0: the model's
# dtype throughout)
F16_OPERANDS = os.environ.get("COBATCH_F16_OPERANDS", "1") != "0"

# PackedWeight.operand_order: the kernel writing an x that the ring GEMM reads writes it in the planes' column order,
# so the GEMM launches no x_operands (bench/results/decode_ordered_operands_ab.md: q8_0 B = 64 2.4 % shorter;
# COBATCH_ORDERED_OPERANDS=0: x_operands puts every x in order)
ORDERED_OPERANDS = os.environ.get("COBATCH_ORDERED_OPERANDS", "1") != "0"
# PackedWeight.act_orders: gate|up's act epilogue stores down's x in down's GEMM's column order too
# (q8_0 B = 128 2 % shorter; COBATCH_ORDERED_ACT=0: x_operands puts down's x in order)
ORDERED_ACT = os.environ.get("COBATCH_ORDERED_ACT", "1") != "0"

# Q5_0 (what llama.cpp writes where a width is not whole 256-blocks: DeepSeek-V2-Lite's down experts and dense down,
# 133 of the 170 quantized tensors of Qwen2.5-Coder-0.5B's Q4_K_M) has fragment planes of its own, the GEMV and the
# GEMM reading its fifth bits beside the nibbles. COBATCH_Q5_0_AS_Q8_0=1 converts such weights to Q8_0 at load
# instead (the same values in 55 % more bytes), dense and routed, as every Q5_0 weight was before: for comparisons.
AS_Q8_0 = ("q5_0",) if os.environ.get("COBATCH_Q5_0_AS_Q8_0") == "1" else ()


def as_q8_0_on(w: QuantWeight, device: torch.device) -> QuantWeight:
    """w, or on CUDA w as Q8_0 (converted on the device) where its format is one of AS_Q8_0."""
    if w.fmt.name not in AS_Q8_0 or torch.device(device).type != "cuda":
        return w
    return QuantWeight(w.fmt, w.rows, w.cols, w.raw.to(device)).as_q8_0()


RESIDENT_DENSE_CROSSOVER = 16   # with a resident dense copy (keep_dense), see from_quant


# The DEQUANT_CUBLAS path's dense matrix, as bytes: grown at load to the largest matrix.
_DENSE_SCRATCH = DeviceScratch(torch.uint8)


def _dense_scratch(device: torch.device, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A [rows, cols] matrix of dtype (2 bytes) in the dense scratch."""
    return _DENSE_SCRATCH.get(device, rows * cols * 2).view(dtype).view(rows, cols)


def _scratch_need(cfg: TileConfig | GemvConfig | GemvPlan | GemmConfig | CudaGemmConfig, n_rows_pad: int,
                  max_tok: int) -> tuple[int, int]:
    """(partial elements, tile counters) of the split-K reduction of calls of up to max_tok tokens in `cfg`, by the
    module of the config's kernel."""
    if isinstance(cfg, (GemvConfig, GemvPlan)):
        return quant_gemv.scratch_need(cfg, n_rows_pad, max_tok)
    if isinstance(cfg, GemmConfig):
        return quant_gemm.scratch_need(cfg, n_rows_pad, max_tok)
    if isinstance(cfg, CudaGemmConfig):
        return quant_gemm_cuda.scratch_need(cfg, n_rows_pad, max_tok)
    return quant_matmul.scratch_need(cfg, n_rows_pad, max_tok)


def reserve_scratch(device: torch.device, plan: MatmulPlan, rows_pad: int, rows: int, cols: int,
                    dense: bool = True) -> None:
    """Grow the shared split-K buffers, and with `dense` the dequantize-to-cuBLAS matrix, to what a weight of
    this plan and shape needs (at load: never inside a CUDA-graph capture)."""
    SplitScratch.reserve(device, *_scratch_need(plan.narrow, rows_pad, plan.crossover))
    for cfg, upto in plan.gemm_ranges():
        SplitScratch.reserve(device, *_scratch_need(cfg, rows_pad, upto))
        if isinstance(cfg, CudaGemmConfig):
            quant_gemm_cuda.reserve_scratch(device, upto, cols)
        elif cfg.streams_x():
            quant_gemm.reserve_x_scratch(device, quant_gemm.x_scratch_rows(upto) * cols)
    if dense and plan.gemm == DEQUANT_CUBLAS:
        _DENSE_SCRATCH.reserve(device, rows * cols * 2)


class PackedWeight:
    """What the GPU model holds for one linear layer: repacked once at load, then `matmul` per step."""

    def __init__(self, fmt_name: str, rows: int, cols: int, planes: PackedPlanes | None = None,
                 dense: torch.Tensor | None = None, plan: MatmulPlan | None = None, gate_up_interleaved: bool = False):
        self.fmt_name, self.rows, self.cols = fmt_name, rows, cols
        self.planes, self.dense, self.plan = planes, dense, plan
        # rows are a gate|up pair interleaved 8 by 8 (kernels/activation.py): matmul(x, act=...) applies act*mul
        self.gate_up_interleaved = gate_up_interleaved
        # the kernel before each call is decode attention (o's): quant_gemv.launch(dependent=...)
        self.follows_attention = False
        self.resident_dense: torch.Tensor | None = None   # see from_quant(keep_dense=True)
        self.nbytes = planes.nbytes if planes is not None else dense.numel() * dense.element_size()

    @classmethod
    def from_quant(cls, w: QuantWeight, device, dtype: torch.dtype = torch.bfloat16,
                   plan: MatmulPlan | None = None, keep_dense: bool = False,
                   gate_up_interleaved: bool = False) -> "PackedWeight":
        """keep_dense: also keep a dequantized copy for n_tok above the crossover (big decode batches,
        prefill), trading memory (2 bytes/weight) for skipping the per-call dequantize pass there.
        gate_up_interleaved: w is a gate|up pair with its rows interleaved (QuantWeight.interleave_rows)."""
        device = torch.device(device)
        if plan is None:
            w = as_q8_0_on(w, device)
        # a row scale (FP8 and NVFP4 checkpoints) travels in their planes only
        assert w.row_scale is None or PACKED_FORMATS.get(w.fmt.name) in (None, *quant_pack.ROW_SCALED), w.fmt.name
        if not quant_pack.weight_packable(w.fmt.name, w.row_scale):   # documented fallback: dense matrix + cuBLAS
            return cls(w.fmt.name, w.rows, w.cols, dense=w.dequantize(torch.float32).to(device, dtype))
        # An explicit Triton TileConfig plan keeps row-major planes (tests, benchmarks of that kernel).
        gemv = uses_gemv(w.fmt.name, device) and (plan is None or isinstance(plan.narrow, (GemvConfig, GemvPlan)))
        planes = pack_planes(w.fmt, w.rows, w.cols, w.raw, device, fragment=gemv,
                             row_scale=w.row_scale if PACKED_FORMATS[w.fmt.name] in quant_pack.ROW_SCALED else None)
        plan = plan or load_plan(w.fmt.name, w.rows, w.cols, planes, device, keep_dense)
        if keep_dense and plan.gemm == DEQUANT_CUBLAS:
            # Past 16 tokens the narrow kernel's time grows per 16-token tile, while cuBLAS on the resident
            # bf16 copy costs about the same from 16 to 64 tokens (H200: B=32 11.3 ms/step narrow vs
            # B=64 8.7 ms dense, bench/results/decode-2026-11-29-dense.md at 5a66009^): hand over at 16.
            plan = MatmulPlan(plan.narrow, plan.gemm, min(plan.crossover, RESIDENT_DENSE_CROSSOVER))
        self = cls(w.fmt.name, w.rows, w.cols, planes=planes, plan=plan, gate_up_interleaved=gate_up_interleaved)
        if device.type == "cuda" or interpreting():
            resident = keep_dense and plan.gemm == DEQUANT_CUBLAS
            if resident:
                self.resident_dense = dequantize_planes(planes, torch.empty(w.rows, w.cols, dtype=dtype,
                                                                            device=device))
            reserve_scratch(device, plan, planes.rows_pad, w.rows, w.cols, dense=not resident)
        return self

    def narrow_upto(self) -> int:
        """The most rows a call runs in the plan's narrow kernel (the GEMV's), 0 without planes."""
        return self.plan.crossover if self.planes is not None else 0

    def reserve_narrow_scratch(self, max_tok: int) -> None:
        """Grow the split-K buffers (of the lane in effect: scratch.side_lane) for narrow calls of up to max_tok
        rows (at load)."""
        SplitScratch.reserve(self.planes.qs.device, *_scratch_need(self.plan.narrow, self.planes.rows_pad, max_tok))

    def operand_dtype(self, n_tok: int, dtype: torch.dtype) -> torch.dtype:
        """The dtype in which this weight's kernels read an x of n_tok rows: f16 where they are the GEMV or the
        mid-batch GEMM, which read f16 x as it is and convert bf16 x as they load it (on the H200 that costs a
        q8_0 down GEMV 4-9 % and q4_K's o, gate_up and down 5-8 % at 1-8 tokens, bench/results/kernels.json's
        us_bf16_input); else `dtype`. A kernel writing this weight's input in it spares them the conversion."""
        if not F16_OPERANDS or dtype != torch.bfloat16 or self.dense is not None:
            return dtype
        config = self.plan.config_for(n_tok)
        return torch.float16 if isinstance(config, (GemvConfig, GemvPlan, GemmConfig, CudaGemmConfig)) else dtype

    def operand_order(self, n_tok: int, dtype: torch.dtype) -> int:
        """The column order in which this weight's kernels read an x of n_tok rows whose model dtype is `dtype`
        (operand_order.py): the planes' where the ring or TMA GEMM streams an f16 x, so that the kernel writing x
        writes it so (and tells matmul through x_order); else NATURAL."""
        if not ORDERED_OPERANDS or self.dense is not None or self.cols % 32:
            return NATURAL
        config = self.plan.config_for(n_tok)
        streamed = isinstance(config, GemmConfig) and bool(config.RING or config.TMA)
        f16 = self.operand_dtype(n_tok, dtype) == torch.float16
        return order_of(self.planes.fmt_id) if streamed and f16 else NATURAL

    def act_orders(self, n_tok: int) -> bool:
        """Can this gate|up weight's act(gate) * up of n_tok rows be stored in another column order (matmul's
        out_order)? Where the Gluon GEMV or GEMM applies act in its epilogue, and ORDERED_ACT is on."""
        if not ORDERED_ACT or self.dense is not None:
            return False
        return self.gate_up_interleaved and isinstance(self.plan.config_for(n_tok), (GemvConfig, GemvPlan, GemmConfig))

    def matmul(self, x: torch.Tensor, config: TileConfig | str | None = None, out: torch.Tensor | None = None,
               act: str | None = None, x_order: int = NATURAL, out_order: int = NATURAL) -> torch.Tensor:
        """x [n_tok, cols] bf16/f16 -> [n_tok, rows] in x's dtype. `config` overrides the plan (benchmarks).
        act ("silu", "gelu_tanh"; gate_up_interleaved weights only): act(gate) * up, [n_tok, rows / 2], applied
        in the GEMV's epilogue, or by gated_mul after the other kernels. x_order: x's columns are already in
        operand_order's order (its writer put them there), which must be this call's. out_order: act's output
        stored in that column order (the next weight's operand_order; where act_orders)."""
        assert act is None or self.gate_up_interleaved, "act needs a gate|up weight packed interleaved"
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.cols)
        n_tok = x2.shape[0]
        out_cols = self.rows // 2 if act else self.rows
        if config is None and self.dense is None:
            config = self.plan.config_for(n_tok)
        assert x_order == NATURAL or (isinstance(config, GemmConfig) and bool(config.RING or config.TMA)
                                      and x_order == order_of(self.planes.fmt_id)), \
            f"an x in order {x_order} is for the ring or TMA GEMM of {self.fmt_name}, not {config}"
        assert out_order == NATURAL or (act and isinstance(config, (GemvConfig, GemvPlan, GemmConfig))), \
            f"only act's output in the Gluon GEMV's or GEMM's epilogue takes another column order, not {config}"
        if act and not isinstance(config, (GemvConfig, GemvPlan, GemmConfig, CudaGemmConfig)):
            y = self.matmul(x2, config)
            return gated_mul_triton(y, act, out=out, interleaved=True).reshape(*lead, out_cols)
        if self.dense is not None:
            y = F.linear(x2, self.dense if self.dense.dtype == x.dtype else self.dense.to(x.dtype))
            return (y if out is None else out.copy_(y)).reshape(*lead, self.rows)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = torch.empty(n_tok, out_cols, dtype=x.dtype, device=x.device) if out is None else out
        if n_tok == 0:
            return out.reshape(*lead, out_cols)
        if config == DEQUANT_CUBLAS and x2.dtype != out.dtype:
            x2 = x2.to(out.dtype)        # cuBLAS multiplies in one dtype (an x in another op's operand_dtype)
        if config == DEQUANT_CUBLAS and self.resident_dense is not None and self.resident_dense.dtype == x.dtype:
            torch.mm(x2, self.resident_dense.t(), out=out.view(n_tok, self.rows))
        elif config == DEQUANT_CUBLAS:
            w = dequantize_planes(self.planes, _dense_scratch(x.device, self.rows, self.cols, x.dtype))
            torch.mm(x2, w.t(), out=out.view(n_tok, self.rows))
        elif isinstance(config, (GemvConfig, GemvPlan)):
            xg = x2 if x2.dtype in (torch.float16, torch.bfloat16) else x2.to(torch.float16)   # f32 x
            partial, count = out, out
            if config.split_k > 1:
                SplitScratch.reserve(x.device, *_scratch_need(config, self.planes.rows_pad, n_tok))
                partial, count = SplitScratch.get(x.device)
            quant_gemv.launch(self.planes, xg, out.view(n_tok, out_cols), config, partial, count, act=act,
                              out_order=out_order, dependent=self.follows_attention)
        elif isinstance(config, (GemmConfig, CudaGemmConfig)):
            xg = x2 if x2.dtype in (torch.float16, torch.bfloat16) else x2.to(torch.float16)
            partial, count = out, out
            if config.split_k > 1:
                SplitScratch.reserve(x.device, *_scratch_need(config, self.planes.rows_pad, n_tok))
                partial, count = SplitScratch.get(x.device)
            if isinstance(config, GemmConfig):
                quant_gemm.launch(self.planes, xg, out.view(n_tok, out_cols), config, partial, count, act=act,
                                  x_ordered=x_order != NATURAL, out_order=out_order)
            else:
                quant_gemm_cuda.launch(self.planes, xg, out.view(n_tok, out_cols), config, partial, count, act=act)
        else:
            quant_matmul.launch(self.planes, x2, out, config)
        return out.reshape(*lead, out_cols)

    def __repr__(self) -> str:
        kind = "dense" if self.dense is not None else "packed"
        return f"PackedWeight({self.fmt_name}, {self.rows}x{self.cols}, {kind}, {self.nbytes} B)"
