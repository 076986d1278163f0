"""Open a Hugging Face checkpoint folder: config.json, *.safetensors (sharded with an index, or one file), the
tokenizer beside them. Nothing is downloaded.

It answers the models as a GGUFFile does (`tensors`, `quant_weight`, `float_tensor`, GGUF tensor names), so
models/ never asks where the weights come from. Each matrix is read from its memory-mapped shard once and turned
into the format it runs in:
  - float (bf16 / f16 / f32) matrices are quantized on load (quant/quantize.py, on the GPU when the model runs
    there) to --quantization's GGUF format (q8_0 by default), which the GEMV and GEMM read like a GGUF's; with
    `none` they stay as stored. No float copy of a quantized matrix is kept.
  - pre-quantized matrices (FP8 e4m3 with a per-tensor or per-channel scale, as compressed-tensors, ModelOpt and
    vLLM's fp8 write them; ModelOpt NVFP4) keep their values, re-laid as the fp8_e4m3 / nvfp4 formats
    (quant/formats.py); an explicit GGUF --quantization requantizes them from their dequantized values.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from cobatch.errors import UserError
from cobatch.loader import hf_config
from cobatch.quant.formats import format_of, int4_blocks, int8_q8_0_blocks, nvfp4_blocks, unpack_int4_words
from cobatch.quant.quantize import TORCH_QUANTIZED, quantize
from cobatch.quant.weight import QuantWeight

INDEX_FILE = "model.safetensors.index.json"
QUANTIZATIONS = ("auto", "none", *TORCH_QUANTIZED)    # --quantization's choices
# vLLM's --quantization names for a checkpoint's own scheme: here, as auto (the checkpoint says what it holds)
VLLM_METHODS = ("fp8", "modelopt", "modelopt_fp4", "compressed-tensors", "gptq", "gptq_marlin", "awq", "awq_marlin")
FLOAT_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
# 4- and 5-bit formats leave the output head (and a tied embedding) at 8 bits, as llama.cpp's mixes keep it higher
_HEAD_FORMAT = {"q4_k": "q8_0", "q4_1": "q8_0", "q5_k": "q8_0", "q5_1": "q8_0"}
# A row that is not whole blocks of the asked format takes the next that fits, else stays as stored
_FALLBACK = {"q4_k": "q4_1", "q5_k": "q5_1"}
_HEADS = ("output.weight", "token_embd.weight")
# AutoAWQ's GEMM layout packs 8 output columns a word, column 8 c + AWQ_ORDER[k] in value k (bits 4 k)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True, slots=True)
class PreQuantized:
    """What config.json's quantization_config says the checkpoint's linear layers hold."""
    kind: str             # "fp8_e4m3" | "nvfp4" | "fp8_blocks" | "int4" | "gptq" | "awq" | "int8"
    method: str           # as the config names it: compressed-tensors, modelopt, fp8
    # fp8_blocks (DeepSeek-V3's and Qwen3's FP8 releases): e4m3 weights with a float32 scale per block of
    # block[0] rows x block[1] columns (weight_scale_inv), which no kernel reads: dequantized at load, then the
    # --quantization asked for (auto: q8_0)
    block: tuple[int, int] | None = None
    # int4 (compressed-tensors' pack-quantized W4A16) and gptq (AutoGPTQ's layout), symmetric: a scale per `group`
    # values of a row (0: one a row), which the q4_0 format holds exactly (formats.int4_blocks); int8 (compressed-
    # tensors' int-quantized, W8A8 and W8A16, symmetric) likewise as q8_0 (formats.int8_q8_0_blocks); awq (AutoAWQ's
    # GEMM layout): a scale and a zero point per group, as q4_1 (its offset the scale times minus the zero point)
    group: int = 0
    # gptq: the zero point a symmetric checkpoint stores (8 less the 1 AutoGPTQ's format takes off every zero: 7;
    # GPTQModel's gptq_v2 format: 8)
    stored_zero: int = 7


def _read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
    if not isinstance(value, dict):
        raise UserError(f"{path}: expected a JSON object")
    return value


def is_checkpoint_folder(path: str | os.PathLike) -> bool:
    return Path(path).is_dir()


def pre_quantized(folder: Path, config: dict) -> PreQuantized | None:
    """The checkpoint's quantization scheme, None for a float checkpoint; a UserError for one we cannot run."""
    qc = config.get("quantization_config")
    if qc is None and (folder / "hf_quant_config.json").is_file():      # ModelOpt's own file
        qc = {"quant_method": "modelopt", **_read_json(folder / "hf_quant_config.json").get("quantization", {})}
    if qc is None:
        return None
    method = str(qc.get("quant_method", "?")).lower()
    if method == "compressed-tensors":
        groups = list((qc.get("config_groups") or {}).values())
        weights = [g.get("weights") or {} for g in groups]
        if qc.get("format") in ("float-quantized", "naive-quantized") and weights and all(
                w.get("type") == "float" and w.get("num_bits") == 8 and w.get("strategy") in ("tensor", "channel")
                for w in weights):
            return PreQuantized("fp8_e4m3", method)
        sizes = {int(w.get("group_size") or 0) if w.get("strategy") == "group" else 0 for w in weights}
        int8 = all(w.get("type") == "int" and w.get("num_bits") == 8 and w.get("symmetric", True)
                   and w.get("strategy") in ("tensor", "channel", "group") for w in weights)
        if qc.get("format") in ("int-quantized", "naive-quantized") and weights and int8 and len(sizes) == 1:
            group = next(iter(sizes))
            if group % 32 == 0:
                return PreQuantized("int8", method, group=group)
        if qc.get("format") == "pack-quantized" and weights and len(sizes) == 1 and sizes.pop() % 32 == 0 and all(
                w.get("type") == "int" and w.get("num_bits") == 4 and w.get("symmetric", True)
                and w.get("strategy") in ("group", "channel") and not w.get("actorder") for w in weights):
            w = weights[0]
            return PreQuantized("int4", method, group=int(w.get("group_size") or 0) if w["strategy"] == "group"
                                else 0)
        what = f"format {qc.get('format')!r}, weights {weights}"
    elif method == "modelopt":
        algo = str(qc.get("quant_algo", "")).upper()
        if algo == "FP8":
            return PreQuantized("fp8_e4m3", method)
        if algo == "NVFP4" and int(qc.get("group_size", 16)) == 16:
            return PreQuantized("nvfp4", method)
        what = f"quant_algo {algo!r}, group_size {qc.get('group_size')}"
    elif method == "gptq":
        bits, group = int(qc.get("bits") or 0), int(qc.get("group_size") or -1)
        fmt = qc.get("checkpoint_format") or "gptq"
        if bits == 4 and (group == -1 or group % 32 == 0) and fmt in ("gptq", "gptq_v2"):
            return PreQuantized("gptq", method, group=max(group, 0), stored_zero=8 if fmt == "gptq_v2" else 7)
        what = f"bits {bits}, group_size {group}, sym {qc.get('sym')}, checkpoint_format {fmt!r}"
    elif method == "awq":
        bits = int(qc.get("bits") or qc.get("w_bit") or 0)
        group = int(qc.get("group_size") or qc.get("q_group_size") or 0)
        version = str(qc.get("version", "gemm")).lower()
        if bits == 4 and group > 0 and group % 32 == 0 and version == "gemm" and qc.get("zero_point", True):
            return PreQuantized("awq", method, group=group)
        what = f"bits {bits}, group_size {group}, version {version!r}, zero_point {qc.get('zero_point')}"
    elif method == "fp8":
        block = qc.get("weight_block_size")
        if not block:
            return PreQuantized("fp8_e4m3", method)
        if len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
            return PreQuantized("fp8_blocks", method, (block[0], block[1]))
        what = f"weight_block_size {block}"
    else:
        what = "this method"
    raise UserError(f"unsupported quantization_config: quant_method {method!r}, {what} (supported: FP8 e4m3 with "
                    "per-tensor or per-channel scales from compressed-tensors, modelopt or fp8, or fp8's block-wise "
                    "scales; ModelOpt NVFP4; symmetric INT4 in groups of 32s or per channel, without activation "
                    "order, as compressed-tensors' pack-quantized or GPTQ's layout; AWQ's GEMM layout, 4 bits in "
                    "groups of 32s; compressed-tensors' symmetric INT8)")


def _shard_files(folder: Path) -> dict[str, Path]:
    """HF tensor name -> the shard holding it: from the index when there is one, else every *.safetensors."""
    if (folder / INDEX_FILE).is_file():
        weight_map = _read_json(folder / INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict):
            raise UserError(f"{folder / INDEX_FILE}: no weight_map")
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            raise UserError(f"{folder}: shard {missing[0]} is missing (the index names {len(missing)} absent "
                            f"file{'s' if len(missing) > 1 else ''}); the checkpoint is incomplete")
        return {name: folder / f for name, f in weight_map.items()}
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise UserError(f"{folder}: no *.safetensors files (cobatch reads safetensors checkpoints and GGUF files)")
    return {name: shard for shard in shards for name in _open(shard).keys()}


def _open(shard: Path):
    try:
        return safe_open(shard, framework="pt")
    except Exception as exc:        # safetensors raises its own error types for a bad header
        raise UserError(f"cannot read {shard}: {exc}") from None


def check_checkpoint_folder(folder: Path) -> None:
    """A UserError unless the folder exists and holds a config.json."""
    if not folder.exists():
        raise UserError(f"model not found: {folder}")
    if not (folder / "config.json").is_file():
        raise UserError(f"{folder}: no config.json; a model folder needs config.json and *.safetensors "
                        "(a Hugging Face checkpoint)")


class HFCheckpoint:
    def __init__(self, folder: str | os.PathLike, quantization: str = "auto", device: torch.device | str = "cpu"):
        self.path = folder = Path(folder)
        check_checkpoint_folder(folder)
        quantization = "auto" if quantization in VLLM_METHODS else quantization
        if quantization not in QUANTIZATIONS:
            raise UserError(f"unknown --quantization {quantization!r} (choose from {', '.join(QUANTIZATIONS)})")
        self.hf_config = config = _read_json(folder / "config.json")
        self.model_type, arch = hf_config.architecture(config)
        self.scheme = pre_quantized(folder, config)
        # auto: q8_0 for a float checkpoint and a block-wise FP8 one; another pre-quantized one keeps its format
        # (and its float matrices)
        keeps = self.scheme is not None and self.scheme.block is None
        self.quantization = ("none" if keeps else "q8_0") if quantization == "auto" else quantization
        self.device = torch.device(device)
        shards = _shard_files(folder)
        handles = {path: _open(path) for path in set(shards.values())}
        self._handle = {name: handles[path] for name, path in shards.items()}
        n_layers = int(config.get("num_hidden_layers", 0))
        sources = hf_config.tensor_sources(self.model_type, config, n_layers)
        self.tensors = {name: src for name, src in sources.items() if all(map(self._stored, src.names))}
        self._rope_factors = self._longrope_factors()
        self.tensors.update({name: hf_config.TensorSource(()) for name in self._rope_factors})
        self.metadata: dict[str, Any] = hf_config.metadata(config, self.model_type, arch, folder.name)
        self.config = hf_config.model_config(config, self.metadata, set(self.tensors))
        self._check_shapes()

    # ------------------------------------------------------------------ what the models read

    def quant_weight(self, name: str) -> QuantWeight:
        """A 2-D weight, [rows = out features, cols = in features], in the format it runs in."""
        parts = [self._matrix(name, hf_name) for hf_name in self._source(name).names]
        return QuantWeight.stack_rows(parts) if len(parts) > 1 else parts[0]

    def float_tensor(self, name: str) -> torch.Tensor:
        """A small tensor (norm weight, bias, rope factors) as float32, flat."""
        if name in self._rope_factors:
            return self._rope_factors[name]
        src = self._source(name)
        values = self._read(src.names[0]).float().reshape(-1)
        return values + 1.0 if src.plus_one else values

    # ------------------------------------------------------------------ the rest

    def hf_tensor_info(self) -> list[tuple[str, str, list[int]]]:
        """(name, safetensors dtype, shape) of every tensor of the checkpoint (for `cobatch inspect`)."""
        return [(n, h.get_slice(n).get_dtype(), list(h.get_slice(n).get_shape())) for n, h in self._handle.items()]

    def _source(self, name: str) -> hf_config.TensorSource:
        src = self.tensors.get(name)
        if src is None:
            wanted = hf_config.tensor_sources(self.model_type, self.hf_config, self.config.n_layers).get(name)
            hf_name = wanted.names[0] if wanted else name
            raise UserError(f"{self.path.name}: no tensor {hf_name}, which a {self.model_type} model needs "
                            "(an incomplete or differently converted checkpoint?)")
        return src

    def _read(self, hf_name: str) -> torch.Tensor:
        return self._handle[hf_name].get_tensor(hf_name)

    def _stored(self, hf_name: str) -> bool:
        """Does the checkpoint hold this tensor (an INT4 weight as its weight_packed)?"""
        return hf_name in self._handle or self._is_int4(hf_name)

    def _int4_words(self, hf_name: str) -> str | None:
        """The tensor of packed INT4 words that holds this weight (compressed-tensors' X.weight_packed, GPTQ's
        X.qweight), None where it is not an INT4 weight."""
        if self.scheme is None or self.scheme.kind not in ("int4", "gptq", "awq") or not hf_name.endswith(".weight"):
            return None
        words = hf_name + "_packed" if self.scheme.kind == "int4" else hf_name.removesuffix("weight") + "qweight"
        return words if words in self._handle else None

    def _is_int4(self, hf_name: str) -> bool:
        return self._int4_words(hf_name) is not None

    def _shape(self, hf_name: str) -> list[int]:
        if self._is_int4(hf_name) and self.scheme.kind in ("gptq", "awq"):   # qweight [in / 8, out], [in, out / 8]
            words = self._int4_words(hf_name)
            first, second = self._handle[words].get_slice(words).get_shape()
            return [second, 8 * first] if self.scheme.kind == "gptq" else [8 * second, first]
        if self._is_int4(hf_name):
            return [int(v) for v in self._read(hf_name.removesuffix("weight") + "weight_shape").tolist()]
        shape = list(self._handle[hf_name].get_slice(hf_name).get_shape())
        if self._is_nvfp4(hf_name):
            shape[-1] *= 2               # two e2m1 values a byte
        return shape

    def _is_nvfp4(self, hf_name: str) -> bool:
        return (self.scheme is not None and self.scheme.kind == "nvfp4" and hf_name.endswith(".weight")
                and hf_name.removesuffix("weight") + "weight_scale_2" in self._handle)

    def _is_int8(self, hf_name: str) -> bool:
        return (self.scheme is not None and self.scheme.kind == "int8"
                and self._handle[hf_name].get_slice(hf_name).get_dtype() == "I8")

    def _is_fp8(self, hf_name: str) -> bool:
        return self._handle[hf_name].get_slice(hf_name).get_dtype() == "F8_E4M3"

    def _check_shapes(self) -> None:
        expected = hf_config.expected_shapes(self.config)
        for name, src in self.tensors.items():
            want = expected.get(name)
            for hf_name in src.names if want else ():
                got = self._shape(hf_name)
                if got != list(want):
                    raise UserError(f"{self.path.name}: tensor {hf_name} has shape {got}, but config.json implies "
                                    f"{list(want)}")

    def _longrope_factors(self) -> dict[str, torch.Tensor]:
        """phi3 LongRoPE's factor lists from config.json, as the rope_factors_* tensors a GGUF carries."""
        rope = hf_config._rope(self.hf_config)
        if (rope.get("rope_type") or rope.get("type")) not in ("longrope", "su"):
            return {}
        return {f"rope_factors_{kind}.weight": torch.tensor(rope[f"{kind}_factor"], dtype=torch.float32)
                for kind in ("long", "short")}

    def _target(self, name: str, cols: int) -> str:
        """The format a float matrix runs in: --quantization's, the head at 8 bits under a 4- or 5-bit one, a fallback
        where the row is not whole blocks, "none" (as stored) for the MoE router (models/moe.py keeps it f32) and
        DeepSeek's latent up-projection (models/deepseek.py folds it into float32 query and output maps)."""
        if "ffn_gate_inp" in name or "attn_kv_b" in name or self.quantization == "none":
            return "none"
        fmt = _HEAD_FORMAT.get(self.quantization, self.quantization) if name in _HEADS else self.quantization
        while fmt != "none" and cols % format_of(fmt).block_size:
            fmt = _FALLBACK.get(fmt, "none")
        return fmt

    def _matrix(self, name: str, hf_name: str) -> QuantWeight:
        if self._is_int4(hf_name) or self._is_nvfp4(hf_name) or self._is_fp8(hf_name) or self._is_int8(hf_name):
            weight = self._pre_quantized(hf_name)
            target = self._target(name, weight.cols)
            if self.quantization == "none" or target == "none":
                return weight
            values = weight.dequantize().to(self.device)
        else:
            values = self._read(hf_name)
            if values.dtype not in FLOAT_DTYPES:
                raise UserError(f"{self.path.name}: tensor {hf_name} is {values.dtype}, not a float or a "
                                "pre-quantized weight cobatch reads")
            target = self._target(name, values.shape[1])
            if target == "none":
                fmt = format_of(FLOAT_DTYPES[values.dtype])
                return QuantWeight(fmt, values.shape[0], values.shape[1], values.contiguous().view(torch.uint8))
            values = values.to(self.device)
        return QuantWeight(format_of(target), values.shape[0], values.shape[1], quantize(values, target))

    def _pre_quantized(self, hf_name: str) -> QuantWeight:
        """A pre-quantized matrix in a cobatch format: FP8 and NVFP4 re-laid (values untouched, scales beside them),
        INT4 as q4_0 blocks (the same values), block-wise FP8 dequantized to float32."""
        base = hf_name.removesuffix("weight")
        if self.scheme is not None and self.scheme.block is not None:
            return self._fp8_blocks(hf_name, base + "weight_scale_inv")
        if self._is_int4(hf_name):
            return self._int4(hf_name, base)
        if self._is_int8(hf_name):
            return self._int8(hf_name, base)
        scale_name = base + "weight_scale"
        if scale_name not in self._handle:
            raise UserError(f"{self.path.name}: {hf_name} is quantized but the checkpoint has no {scale_name}")
        raw, scale = self._read(hf_name), self._read(scale_name)
        rows = raw.shape[0]
        if self._is_nvfp4(hf_name):
            cols = raw.shape[1] * 2
            if scale.shape != (rows, cols // 16) or scale.dtype != torch.float8_e4m3fn:
                raise UserError(f"{self.path.name}: {scale_name} is {scale.dtype} {list(scale.shape)}; NVFP4 needs "
                                f"float8_e4m3fn [{rows}, {cols // 16}] (one scale per 16 values)")
            global_scale = self._read(base + "weight_scale_2").float().reshape(-1)
            return QuantWeight(format_of("nvfp4"), rows, cols, nvfp4_blocks(raw, scale),
                               global_scale.expand(rows).contiguous())
        scale = scale.float().reshape(-1)
        if scale.numel() not in (1, rows):
            raise UserError(f"{self.path.name}: {scale_name} has {scale.numel()} values; FP8 needs one per tensor "
                            f"or one per output channel ({rows}); block-wise scales are not supported")
        return QuantWeight(format_of("fp8_e4m3"), rows, raw.shape[1], raw.view(torch.uint8),
                           scale.expand(rows).contiguous())

    def _check_f16(self, name: str, scale: torch.Tensor) -> None:
        """GGUF blocks keep their scales in float16: one a checkpoint stores beyond its range cannot go there."""
        if scale.float().abs().max() > torch.finfo(torch.float16).max:
            raise UserError(f"{self.path.name}: {name} exceeds float16's range, in which the GGUF blocks keep scales")

    def _int4(self, hf_name: str, base: str) -> QuantWeight:
        """A pack-quantized INT4 matrix as q4_0 blocks: the same values, no requantizing."""
        if self.scheme.kind == "gptq":
            return self._gptq(hf_name, base)
        if self.scheme.kind == "awq":
            return self._awq(hf_name, base)
        rows, cols = self._shape(hf_name)
        group = self.scheme.group or cols
        packed, scale = self._read(hf_name + "_packed"), self._read(base + "weight_scale")
        if packed.dtype != torch.int32 or list(packed.shape) != [rows, -(-cols // 8)]:
            raise UserError(f"{self.path.name}: {hf_name}_packed is {packed.dtype} {list(packed.shape)}; {rows} x "
                            f"{cols} INT4 values need int32 [{rows}, {-(-cols // 8)}]")
        if list(scale.shape) != [rows, -(-cols // group)] or cols % 32:
            raise UserError(f"{self.path.name}: {base}weight_scale is {list(scale.shape)}; {rows} x {cols} in groups "
                            f"of {group} need [{rows}, {-(-cols // group)}] (and whole 32-value blocks)")
        self._check_f16(base + "weight_scale", scale)
        nibbles = unpack_int4_words(packed)[:, :cols]
        return QuantWeight(format_of("q4_0"), rows, cols, int4_blocks(nibbles, scale, group))

    def _int8(self, hf_name: str, base: str) -> QuantWeight:
        """An int-quantized INT8 matrix (a scale per tensor, row or group) as q8_0 blocks: the same values."""
        values, scale = self._read(hf_name), self._read(base + "weight_scale").float()
        rows, cols = values.shape
        group = self.scheme.group or cols
        if scale.numel() == 1:
            scale = scale.reshape(1, 1).expand(rows, 1)
        if cols % 32 or list(scale.reshape(rows, -1).shape) != [rows, -(-cols // group)]:
            raise UserError(f"{self.path.name}: {base}weight_scale is {list(scale.shape)}; {rows} x {cols} INT8 values "
                            f"in groups of {group} need [{rows}, {-(-cols // group)}] (and whole 32-value blocks)")
        self._check_f16(base + "weight_scale", scale)
        return QuantWeight(format_of("q8_0"), rows, cols, int8_q8_0_blocks(values, scale.reshape(rows, -1), group))

    def _gptq(self, hf_name: str, base: str) -> QuantWeight:
        """A GPTQ matrix (AutoGPTQ's layout: qweight int32 [in / 8, out], 8 input rows a word, value k at bits 4 k;
        scales [groups, out]; qzeros [groups, out / 8], 8 columns a word; g_idx, each input's group): symmetric
        (every stored zero the scheme's), as q4_0 blocks, each value its nibble less 8; else as q4_1 blocks, the
        scale and the scale times minus the zero point as the offset, as AWQ's."""
        rows, cols = self._shape(hf_name)
        group = self.scheme.group or cols
        qweight, scales = self._read(base + "qweight"), self._read(base + "scales")
        if qweight.dtype != torch.int32 or cols % 32 or list(scales.shape) != [-(-cols // group), rows]:
            raise UserError(f"{self.path.name}: {base}qweight {qweight.dtype} {list(qweight.shape)} with scales "
                            f"{list(scales.shape)} is not GPTQ's layout of {rows} x {cols} in groups of {group}")
        zeros = unpack_int4_words(self._read(base + "qzeros"))[:, :rows] if base + "qzeros" in self._handle else None
        if base + "g_idx" in self._handle:
            order = self._read(base + "g_idx").long()
            if not torch.equal(order, torch.arange(cols) // group):
                raise UserError(f"{self.path.name}: {base}g_idx reorders the groups (desc_act): activation order is "
                                "not supported")
        self._check_f16(base + "scales", scales)
        nibbles = unpack_int4_words(qweight.t())          # [out, in]: word r's value k is input 8 r + k
        if zeros is None or bool((zeros == self.scheme.stored_zero).all()):
            return QuantWeight(format_of("q4_0"), rows, cols, int4_blocks(nibbles, scales.t(), group))
        # AutoGPTQ's v1 format stores each zero less 1 and dequantizes (q - (zero + 1))
        scale, zero = scales.float().t(), (zeros + (8 - self.scheme.stored_zero)).t().float()     # [out, groups]
        return QuantWeight(format_of("q4_1"), rows, cols, int4_blocks(nibbles, scale, group, -scale * zero))

    def _awq(self, hf_name: str, base: str) -> QuantWeight:
        """An AWQ matrix (AutoAWQ's GEMM layout: qweight int32 [in, out / 8] and qzeros [groups, out / 8], 8 output
        columns a word, column 8 c + AWQ_ORDER[k] at bits 4 k; scales [groups, out]; each weight the scale times
        the value less its zero point) as q4_1 blocks: the scale, and the scale times minus the zero as the offset."""
        rows, cols = self._shape(hf_name)
        group = self.scheme.group
        qweight, scales = self._read(base + "qweight"), self._read(base + "scales")
        if (qweight.dtype != torch.int32 or cols % 32 or base + "qzeros" not in self._handle
                or list(scales.shape) != [-(-cols // group), rows]):
            raise UserError(f"{self.path.name}: {base}qweight {qweight.dtype} {list(qweight.shape)} with scales "
                            f"{list(scales.shape)} is not AWQ's GEMM layout of {rows} x {cols} in groups of {group}")
        column_of = [AWQ_ORDER.index(j) for j in range(8)]     # where in its word's 8 values column 8 c + j is

        def columns(words: torch.Tensor) -> torch.Tensor:     # [n, out / 8] words -> [n, out] values, in column order
            return unpack_int4_words(words).reshape(words.shape[0], -1, 8)[..., column_of].reshape(words.shape[0], -1)

        nibbles = columns(qweight).t()                                          # [out, in]
        scale = scales.float().t()                                              # [out, groups]
        zeros = columns(self._read(base + "qzeros"))[:, :rows].t().float()      # [out, groups]
        return QuantWeight(format_of("q4_1"), rows, cols, int4_blocks(nibbles, scale, group, -scale * zeros))

    def _fp8_blocks(self, hf_name: str, scale_name: str) -> QuantWeight:
        """A block-wise FP8 matrix dequantized to float32: each e4m3 value times its block's scale."""
        if scale_name not in self._handle:
            raise UserError(f"{self.path.name}: {hf_name} is FP8 with block-wise scales but the checkpoint has no "
                            f"{scale_name}")
        raw, scale = self._read(hf_name), self._read(scale_name).float()
        (rows, cols), (br, bc) = raw.shape, self.scheme.block
        if scale.shape != (-(-rows // br), -(-cols // bc)):
            raise UserError(f"{self.path.name}: {scale_name} is {list(scale.shape)}; {rows} x {cols} in blocks of "
                            f"{br} x {bc} need [{-(-rows // br)}, {-(-cols // bc)}]")
        per_value = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
        values = raw.float() * per_value
        return QuantWeight(format_of("f32"), rows, cols, values.contiguous().view(torch.uint8))


def generation_defaults(folder: str | os.PathLike) -> dict[str, Any]:
    """generation_config.json's sampling fields, as vLLM takes them for requests that leave them unset."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    config = _read_json(path)
    names = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
             "typical_p": "typical_p", "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
    return {ours: config[theirs] for theirs, ours in names.items() if config.get(theirs) is not None}
