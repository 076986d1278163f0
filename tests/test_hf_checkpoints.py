"""Hugging Face checkpoint folders (loader/hf.py): tiny random models written by transformers, loaded by cobatch and
compared with transformers on the same folder (the real SmolLM2 through both loaders is in test_reference.py,
beside the transformers reading of its GGUF that it shares); FP8 / NVFP4 checkpoints against a numpy reference of
the formats (written from the OCP 8-bit and MX FP4 specifications and ModelOpt's NVFP4 description, not from our
code); the CLI's answers to bad folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from cobatch import cli
from cobatch.errors import UserError
from cobatch.loader import hf_config
from cobatch.loader.hf import HFCheckpoint
from cobatch.models.registry import model_class
from cobatch.quant.formats import dequantize
from cobatch.testing import hf_checkpoints
from conftest import requires_cuda
from model_checks import prompt_logits, transformers_float_model

transformers = pytest.importorskip("transformers")

# every family config.json maps, each against transformers (the first five keep the seeds QUANT_BOUNDS was measured on)
FIRST = ["llama", "qwen2", "qwen3", "mixtral", "gemma2"]
FAMILIES = FIRST + [f for f in hf_checkpoints.FAMILIES if f not in FIRST]
IDS = [(i * 37 + 5) % 360 for i in range(24)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> (folder, transformers' float32 logits of IDS). llama's is sharded, with an index."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, family in enumerate(FAMILIES):
        folder = hf_checkpoints.write_tiny_model(root / family, family, seed=i,
                                                 max_shard_size="300KB" if family == "llama" else None)
        model = transformers_float_model(folder)
        with torch.inference_mode():
            out[family] = folder, model(torch.tensor([IDS])).logits[0].float()
    return out


def cobatch_logits(folder, quantization="none", ids=IDS) -> torch.Tensor:
    ckpt = HFCheckpoint(folder, quantization)
    return prompt_logits(model_class(ckpt.config)(ckpt.config, ckpt, max_positions=64), ckpt.config, ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_float_checkpoint_matches_transformers(folders, family):
    """DeepSeek too: V2 (q straight from h, softmax routing in 2 of 4 groups) and V3 (q LoRA, sigmoid routing with a
    random correction bias, YaRN), MLA absorbed on our side and decompressed on transformers'."""
    folder, ref = folders[family]
    ours = cobatch_logits(folder)
    # float32 both ways, the same weights: only summation order differs (measured: under 4e-6 of logits up to 7)
    assert (ours - ref).abs().max() < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_deepseek_config_maps_onto_deepseek2(folders):
    """config.json's MLA widths, router and YaRN as llama.cpp's convert writes deepseek2's keys."""
    v2, v3 = (HFCheckpoint(folders[f][0], "none").config for f in ("deepseek_v2", "deepseek_v3"))
    assert (v2.mla.q_lora_rank, v2.mla.kv_lora_rank, v2.mla.qk_nope_dim, v2.mla.qk_rope_dim, v2.mla.v_head_dim) == \
        (0, 64, 32, 16, 32)
    assert (v2.expert_gating, v2.expert_groups, v2.expert_groups_used, v2.expert_weights_scale,
            v2.expert_weights_norm, v2.shared_expert_ffn_dim, v2.leading_dense_layers) == ("softmax", 4, 2, 1.5, False,
                                                                                          256, 1)
    assert (v3.mla.q_lora_rank, v3.expert_gating, v3.expert_weights_norm, v3.shared_expert_ffn_dim) == \
        (64, "sigmoid", True, 128)
    assert v3.rope_scaling["type"] == "yarn" and v3.yarn_log_multiplier == pytest.approx(0.0707)
    assert not v2.rope_neox and not v3.rope_neox


@pytest.mark.parametrize("change, message", [({"moe_layer_freq": 2}, "moe_layer_freq"),
                                             ({"rope_interleave": False}, "rope_interleave"),
                                             ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                                   "original_max_position_embeddings": 64,
                                                                   "mscale": 1.0, "mscale_all_dim": 0.707}},
                                              "mscale")])
def test_deepseek_configs_it_cannot_run_are_user_errors(folders, change, message):
    config = {**json.loads((folders["deepseek_v3"][0] / "config.json").read_text()), **change}
    with pytest.raises(UserError, match=message):
        hf_config.metadata(config, "deepseek_v3", "deepseek2", "tiny")


def test_deepseek_folder_generates_what_transformers_does(folders):
    """The engine on a DeepSeek-V3 folder, greedy: the tokens transformers' generate gives (float32 both)."""
    from cobatch.engine.sampler import SamplingParams
    from cobatch.llm import LLM, EngineOptions
    folder = folders["deepseek_v3"][0]
    llm = LLM.load(folder, EngineOptions(device="cpu", ctx=64, max_num_seqs=2, quiet=True, quantization="none"))
    got = llm.engine.generate([IDS[:10], IDS[5:12]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    model = transformers_float_model(folder)
    for prompt, tokens in zip((IDS[:10], IDS[5:12]), got):
        want = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6)
        assert tokens == want[0, len(prompt):].tolist()


def _relative_rms(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).square().mean() / ref.square().mean()).sqrt().item()


# Logit error of quantization on load against the float checkpoint, on the tiny random models (weights of std
# 1 / sqrt(in), 2 layers, 24 positions; random weights have no redundancy, so these are worst cases next to real
# models). Measured, relative RMS error of the logits / top-1 agreement with the float model:
#   llama q8_0 0.026 / 1.0    q5_K 0.141 / 0.75   q4_K 0.277 / 0.67    (q5_1 0.144 / 0.79, q4_1 0.283 / 0.63)
#   qwen3 q8_0 0.024 / 0.875  q5_K 0.122 / 0.875  q4_K 0.241 / 0.75    (q5_1 0.129 / 0.79, q4_1 0.269 / 0.71)
# (qwen2, mixtral, gemma2: q8_0 0.019-0.022, q5_K 0.110-0.164, q4_K 0.236-0.280, each K-quant below its q5_1 /
# q4_1.)
QUANT_BOUNDS = {"q8_0": (0.04, 0.85), "q5_k": (0.2, 0.7), "q4_k": (0.35, 0.6)}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_quantized_on_load_error_is_bounded(folders, family):
    folder, ref = folders[family]
    errors = {}
    for quant, (bound, agreement) in QUANT_BOUNDS.items():
        ours = cobatch_logits(folder, quant)
        errors[quant] = _relative_rms(ours, ref)
        assert errors[quant] < bound, (quant, errors[quant])
        assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= agreement
    assert errors["q8_0"] < errors["q4_k"] / 5 and errors["q5_k"] < 0.6 * errors["q4_k"]
    assert errors["q4_k"] < _relative_rms(cobatch_logits(folder, "q4_1"), ref)      # the scale search pays
    assert errors["q5_k"] < _relative_rms(cobatch_logits(folder, "q5_1"), ref)


def test_quantization_formats_and_head(folders):
    ckpt = HFCheckpoint(folders["llama"][0], "q4_k")
    assert ckpt.quant_weight("blk.0.attn_q.weight").fmt.name == "q4_k"
    assert ckpt.quant_weight("output.weight").fmt.name == "q8_0"                       # the head at 8 bits
    five = HFCheckpoint(folders["llama"][0], "q5_k")
    assert five.quant_weight("blk.0.attn_q.weight").fmt.name == "q5_k"
    assert five.quant_weight("output.weight").fmt.name == "q8_0"
    assert ckpt.quant_weight("blk.0.ffn_down.weight").raw.dtype == torch.uint8
    assert HFCheckpoint(folders["llama"][0]).quantization == "q8_0"                      # auto on a float one
    none = HFCheckpoint(folders["llama"][0], "none").quant_weight("blk.0.attn_q.weight")
    assert none.fmt.name == "f32" and none.rows == 256 and none.cols == 256


# ---------------------------------------------------------------- FP8 / NVFP4: numpy references from the specs

def e4m3_reference(byte: int) -> float:
    """OCP FP8 E4M3 (the "fn" variant): 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
    subnormal (m / 8 * 2^-6); S.1111.111 is NaN, there are no infinities."""
    sign, exp, man = byte >> 7, (byte >> 3) & 15, byte & 7
    if exp == 15 and man == 7:
        return float("nan")
    value = man / 8 * 2.0 ** -6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
    return -value if sign else value


def e2m1_reference(code: int) -> float:
    """OCP MX FP4 E2M1: 1 sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal (m * 0.5)."""
    sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
    value = man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1)
    return -value if sign else value


E4M3 = np.array([e4m3_reference(b) for b in range(256)])         # every code, decoded as the spec says
E2M1 = np.array([e2m1_reference(c) for c in range(16)])


def nvfp4_reference(packed: np.ndarray, scales: np.ndarray, global_scale: float) -> np.ndarray:
    """ModelOpt NVFP4: value = e2m1 * e4m3 block scale (one per 16 values) * per-tensor f32 scale; two values a byte,
    element 2i in the low nibble."""
    rows, half = packed.shape
    codes = np.stack([packed & 15, packed >> 4], -1).reshape(rows, half * 2)
    return E2M1[codes] * np.repeat(E4M3[scales], 16, axis=1) * global_scale


def test_fp8_values_match_the_spec():
    raw = torch.arange(256, dtype=torch.uint8).reshape(1, 256)
    ours = dequantize(raw, "fp8_e4m3", 256)[0].numpy()
    ref = E4M3
    assert np.array_equal(np.isnan(ours), np.isnan(ref))
    assert np.array_equal(ours[~np.isnan(ref)], ref[~np.isnan(ref)])


def test_nvfp4_random_blocks_match_the_spec():
    gen = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (4, 32), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 0x7E, (4, 4), dtype=torch.uint8, generator=gen)          # finite, positive e4m3
    blocks = torch.cat([scales.reshape(-1, 1), packed.reshape(-1, 8)], 1).reshape(4, -1)
    ours = dequantize(blocks, "nvfp4", 64).double() * 0.125
    ref = nvfp4_reference(packed.numpy(), scales.numpy(), 0.125)
    assert np.array_equal(ours.numpy(), ref)


def _reference_model(float_folder, quantized_folder, kind):
    """transformers on the float checkpoint with each quantized layer's weight replaced by its dequantization
    (numpy, from the specs): the dequantize-then-matmul reference."""
    from safetensors import safe_open
    model = transformers_float_model(float_folder)
    params = dict(model.named_parameters())
    with safe_open(quantized_folder / "model.safetensors", "pt") as f:
        for name in f.keys():
            if not name.endswith(("weight_scale", "weight_scale_inv")):
                continue
            base = name.removesuffix("_inv").removesuffix("weight_scale")
            weight = f.get_tensor(base + "weight")
            if kind == "nvfp4":
                values = nvfp4_reference(weight.numpy(), f.get_tensor(name).view(torch.uint8).numpy(),
                                         float(f.get_tensor(base + "weight_scale_2")))
            elif kind == "fp8_blocks":      # each value times its block's scale
                codes = weight.view(torch.uint8).numpy()
                blocks = np.kron(f.get_tensor(name).double().numpy(), np.ones(hf_checkpoints.FP8_BLOCK))
                values = E4M3[codes] * blocks[:codes.shape[0], :codes.shape[1]]
            else:
                codes = weight.view(torch.uint8).numpy()
                values = E4M3[codes] * f.get_tensor(name).double().numpy().reshape(-1, 1)
            with torch.no_grad():
                params[base + "weight"].copy_(torch.from_numpy(values))
    with torch.inference_mode():
        return model(torch.tensor([IDS])).logits[0].float()


@pytest.mark.parametrize("kind", ["fp8_tensor", "fp8_channel", "nvfp4"])
def test_pre_quantized_checkpoint_matches_dequantize_then_matmul(folders, tmp_path, kind):
    float_folder = folders["qwen2"][0]
    folder = hf_checkpoints.write_pre_quantized(float_folder, tmp_path / kind, kind)
    ckpt = HFCheckpoint(folder)
    assert ckpt.quant_weight("blk.0.attn_q.weight").fmt.name == ("nvfp4" if kind == "nvfp4" else "fp8_e4m3")
    ours = cobatch_logits(folder, "auto")
    ref = _reference_model(float_folder, folder, kind)
    assert (ours - ref).abs().max() < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("kind", ["int4_group", "int4_channel"])
def test_int4_checkpoint_keeps_its_values_as_q4_0(folders, tmp_path, kind):
    """compressed-tensors' pack-quantized W4A16 (symmetric INT4, written by compressed-tensors' own compressor):
    every weight runs as q4_0 holding exactly the values compressed-tensors' own unpacking gives times their scales,
    and the logits are transformers' on those values."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors import safe_open
    folder = hf_checkpoints.write_pre_quantized(folders["qwen2"][0], tmp_path / kind, kind)
    weights = {}
    with safe_open(folder / "model.safetensors", "pt") as f:
        for name in (n for n in f.keys() if n.endswith("weight_packed")):
            base = name.removesuffix("weight_packed")
            shape = f.get_tensor(base + "weight_shape")
            q = unpack_from_int32(f.get_tensor(name), 4, torch.Size(shape.tolist()))
            scale = f.get_tensor(base + "weight_scale").float()
            weights[base + "weight"] = q.float() * scale.repeat_interleave(-(-q.shape[1] // scale.shape[1]), 1)
    _assert_runs_as(folders, folder, weights, "q4_0", exact=True)


def test_int8_checkpoint_keeps_its_values_as_q8_0(folders, tmp_path):
    """compressed-tensors' int-quantized W8A8 (symmetric INT8 weights, a scale a row, written by compressed-tensors'
    own compressor): every weight runs as q8_0 holding exactly its values times its scales (the activations stay
    float), and the logits are transformers' on those values."""
    pytest.importorskip("compressed_tensors")
    from safetensors import safe_open
    folder = hf_checkpoints.write_pre_quantized(folders["qwen2"][0], tmp_path / "int8", "int8")
    with safe_open(folder / "model.safetensors", "pt") as f:
        weights = {name: f.get_tensor(name).float() * f.get_tensor(name + "_scale").float()
                   for name in f.keys() if name.endswith("proj.weight") and f.get_tensor(name).dtype == torch.int8}
    _assert_runs_as(folders, folder, weights, "q8_0", exact=True)


def _assert_runs_as(folders, folder, weights: dict[str, torch.Tensor], fmt: str, exact: bool) -> None:
    """A 4-bit folder made from qwen2's: its 14 matrices (2 layers of q, k, v, o, gate, up, down) run as `fmt`
    holding `weights` (the layout's reference dequantization; bitwise where `exact`, else within the f16 rounding
    of each offset), and the logits are transformers' on the float model with those weights."""
    model = transformers_float_model(folders["qwen2"][0])
    params = dict(model.named_parameters())
    assert len(weights) == 2 * 7
    with torch.no_grad():
        for name, values in weights.items():
            params[name].copy_(torch.as_tensor(values))
    w, want = HFCheckpoint(folder).quant_weight("blk.1.ffn_down.weight"), params["model.layers.1.mlp.down_proj.weight"]
    assert w.fmt.name == fmt
    if exact:
        assert torch.equal(w.dequantize(), want)
    else:
        assert (w.dequantize() - want).abs().max() <= 2 ** -11 * want.abs().max()
    with torch.inference_mode():
        ref = model(torch.tensor([IDS])).logits[0].float()
    ours = cobatch_logits(folder, "auto")
    if exact:
        assert (ours - ref).abs().max() < 1e-4
    else:                 # measured 1.5e-3 on AWQ: a block's 32 weights share an offset's rounding
        assert _relative_rms(ours, ref) < 5e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("weights", [{"symmetric": False}, {"actorder": "group"}, {"group_size": 48}],
                         ids=["zero-points", "activation-order", "group-of-48"])
def test_int4_schemes_it_cannot_hold_are_refused(weights):
    """Zero points, activation order (a group index a column) and groups that are not whole 32-value blocks have no
    q4_0 form: one line naming the scheme, not a wrong model."""
    from cobatch.loader.hf import pre_quantized
    config = {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                      "config_groups": {"group_0": {"weights": {
                                          "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                          "group_size": 128, "actorder": None, **weights}}}}}
    with pytest.raises(UserError, match="unsupported quantization_config: quant_method 'compressed-tensors'"):
        pre_quantized(Path("."), config)


def gptq_reference(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray) -> np.ndarray:
    """AutoGPTQ's 4-bit dequantization, written from its layout's description: input i of output column o is
    (qweight[i // 8, o] >> 4 (i % 8)) & 15, in group g = g_idx[i], whose zero is (qzeros[g, o // 8] >> 4 (o % 8)) & 15
    plus 1 (the format stores it less 1); the weight is scales[g, o] (q - zero). -> float64 [out, in]."""
    qw, qz = qweight.astype(np.int64) & 0xFFFFFFFF, qzeros.astype(np.int64) & 0xFFFFFFFF
    i, o = np.arange(qw.shape[0] * 8)[:, None], np.arange(qw.shape[1])[None, :]
    q = (qw[i // 8, o] >> (4 * (i % 8))) & 15
    g = g_idx.astype(np.int64)[i]
    zero = ((qz[g, o // 8] >> (4 * (o % 8))) & 15) + 1
    return (scales.astype(np.float64)[g, o] * (q - zero)).T


@pytest.mark.parametrize("kind, fmt", [("gptq", "q4_0"), ("gptq_asym", "q4_1")])
def test_gptq_checkpoint_runs_as_q4_0_or_with_zero_points_q4_1(folders, tmp_path, kind, fmt):
    """A 4-bit GPTQ checkpoint (AutoGPTQ's layout): symmetric, every weight runs as q4_0 holding exactly the values
    the layout's own dequantization gives; with zero points as q4_1 (the offset the scale times minus the zero,
    rounded to f16 once); the logits are transformers' on those values."""
    from safetensors import safe_open
    folder = hf_checkpoints.write_pre_quantized(folders["qwen2"][0], tmp_path / kind, kind)
    with safe_open(folder / "model.safetensors", "np") as f:
        weights = {base + "weight": gptq_reference(*(f.get_tensor(base + part)
                                                     for part in ("qweight", "qzeros", "scales", "g_idx")))
                   for base in (n.removesuffix("qweight") for n in f.keys() if n.endswith(".qweight"))}
    _assert_runs_as(folders, folder, weights, fmt, exact=fmt == "q4_0")


def test_gptq_activation_order_is_refused(folders, tmp_path):
    """Groups reordered by activation order (a g_idx other than each input's own group) have no q4 block form:
    one line, not a wrong model."""
    from safetensors.torch import load_file, save_file
    folder = hf_checkpoints.write_pre_quantized(folders["qwen2"][0], tmp_path / "gptq", "gptq")
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="activation order"):
        HFCheckpoint(folder).quant_weight("blk.0.attn_output.weight")


def awq_reference(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    """AutoAWQ's GEMM-layout dequantization, written from its description: output column o of input i is value
    k = AWQ_REVERSE_ORDER[o % 8] of word qweight[i, o // 8] ((word >> 4 k) & 15), its zero the same value of
    qzeros[i // group, o // 8]; the weight is scales[i // group, o] (q - zero). -> float64 [out, in]."""
    reverse = np.array([0, 4, 1, 5, 2, 6, 3, 7])        # AutoAWQ's AWQ_REVERSE_ORDER
    qw, qz = qweight.astype(np.int64) & 0xFFFFFFFF, qzeros.astype(np.int64) & 0xFFFFFFFF
    i, o = np.arange(qw.shape[0])[:, None], np.arange(qw.shape[1] * 8)[None, :]
    q = (qw[i, o // 8] >> (4 * reverse[o % 8])) & 15
    zero = (qz[i // group, o // 8] >> (4 * reverse[o % 8])) & 15
    return (scales.astype(np.float64)[i // group, o] * (q - zero)).T


def test_awq_checkpoint_runs_as_q4_1(folders, tmp_path):
    """A 4-bit AWQ checkpoint (AutoAWQ's GEMM layout, zero points): every weight runs as q4_1, its scale and the
    scale times minus the zero point as the offset (rounded to f16 once, as q4_K's offsets are): the values of the
    layout's own dequantization to that rounding, and transformers' logits on them."""
    from safetensors import safe_open
    folder = hf_checkpoints.write_pre_quantized(folders["qwen2"][0], tmp_path / "awq", "awq")
    with safe_open(folder / "model.safetensors", "np") as f:
        weights = {base + "weight": awq_reference(*(f.get_tensor(base + part)
                                                    for part in ("qweight", "qzeros", "scales")),
                                                  hf_checkpoints.INT4_GROUP)
                   for base in (n.removesuffix("qweight") for n in f.keys() if n.endswith(".qweight"))}
    _assert_runs_as(folders, folder, weights, "q4_1", exact=False)


def test_block_wise_fp8_checkpoint_dequantizes_on_load(folders, tmp_path):
    """fp8 with weight_block_size (DeepSeek-V3's and Qwen3's FP8 releases): no kernel reads its block scales, so
    the values are dequantized at load: as they are with --quantization none (the dequantize-then-matmul
    reference), and to q8_0 by default."""
    float_folder = folders["qwen2"][0]
    folder = hf_checkpoints.write_pre_quantized(float_folder, tmp_path / "fp8_blocks", "fp8_blocks")
    ours = cobatch_logits(folder, "none")
    ref = _reference_model(float_folder, folder, "fp8_blocks")
    assert (ours - ref).abs().max() < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    ckpt = HFCheckpoint(folder)
    assert ckpt.scheme.block == hf_checkpoints.FP8_BLOCK and ckpt.quantization == "q8_0"
    assert ckpt.quant_weight("blk.0.attn_q.weight").fmt.name == "q8_0"
    assert HFCheckpoint(folder, "none").quant_weight("blk.0.attn_q.weight").fmt.name == "f32"


# ---------------------------------------------------------------- bad folders: one line, exit code 2

def _broken(folders, tmp_path, family="qwen2"):
    folder = tmp_path / "broken"
    shutil.copytree(folders[family][0], folder)
    return folder


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _no_config(folder):
    (folder / "config.json").unlink()


def _unknown_architecture(folder):
    _edit_config(folder, architectures=["FalconForCausalLM"])


def _wrong_shape(folder):
    _edit_config(folder, intermediate_size=384)


def _unsupported_quantization(folder):
    _edit_config(folder, quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})


@pytest.mark.parametrize("breakage, message", [
    (_no_config, "no config.json"), (_unknown_architecture, "unsupported architecture FalconForCausalLM"),
    (_wrong_shape, "config.json implies [384, 256]"), (_unsupported_quantization, "quant_method 'bitsandbytes'")],
    ids=["no-config", "architecture", "shape", "quantization"])
def test_bad_folder_is_one_line_and_exit_code_2(folders, tmp_path, capsys, breakage, message):
    folder = _broken(folders, tmp_path)
    breakage(folder)
    assert cli.main(["inspect", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_missing_shard_is_one_line_and_exit_code_2(folders, tmp_path, capsys):
    folder = _broken(folders, tmp_path, "llama")
    shard = sorted(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values()))[1]
    (folder / shard).unlink()
    assert cli.main(["generate", "-m", str(folder), "-p", "hi", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"shard {shard} is missing" in err


def test_generate_from_a_folder_uses_its_tokenizer_template_and_generation_config(folders, tmp_path, capsys):
    from cobatch.llm import LLM, EngineOptions
    llm = LLM.load(folders["qwen2"][0], EngineOptions(device="cpu", ctx=64, max_num_seqs=1, quiet=True))
    assert llm.generation_defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.9}
    # what serve's requests take: these under the flags (vLLM's --generation-config auto), or none (vllm)
    from cobatch.server.context import ServerContext, ServerOptions
    assert ServerContext(llm, ServerOptions(sampling_defaults={"top_k": 5})).options.sampling_defaults == {
        "temperature": 0.6, "top_k": 5, "top_p": 0.9}
    assert ServerContext(llm, ServerOptions(checkpoint_defaults=False)).options.sampling_defaults == {}
    assert {1, 2} <= llm.tokenizer.stop_ids                       # generation_config's eos_token_id list
    ids = llm.encode_chat([{"role": "user", "content": "Hello"}])
    assert llm.tokenizer.decode(ids) == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    # tokenizer.json as transformers runs it (AutoTokenizer would rebuild Qwen2's own pre-tokenizer instead)
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folders["qwen2"][0] / "tokenizer.json"))
    text = "The quick brown fox, 42 times."
    assert llm.encode_prompt(text) == reference(text)["input_ids"]
    assert cli.main(["generate", "-m", str(folders["qwen2"][0]), "-p", "Hello", "-n", "3", "--device", "cpu",
                     "--quantization", "q4_1", "--seed", "1"]) == 0


def test_random_benchmark_checkpoint_is_the_model_transformers_reads(tmp_path):
    """The benchmarks' random bf16 writer (bench/hf_load.py: full-size shapes, shard by shard) on the tiny llama
    shape, in several shards: transformers reads the same model from it as cobatch does."""
    folder = hf_checkpoints.write_random_checkpoint(tmp_path / "random", "tiny", seed=3, shard_bytes=300_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1 and len(index) == 2 + 2 * 9 + 1
    model = transformers_float_model(folder)
    with torch.inference_mode():
        want = model(torch.tensor([IDS])).logits[0].float()
    got = cobatch_logits(folder)
    assert (got - want).norm() / want.norm() < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@requires_cuda
@pytest.mark.parametrize("family, kind", [("deepseek_v2", None), ("deepseek_v3", None), ("qwen3_moe", None),
                                          ("qwen2", "gptq"), ("qwen2", "awq"), ("qwen2", "fp8_blocks"),
                                          ("qwen2", "int8")])
def test_gpu_folder_is_close_to_the_cpu_path(folders, tmp_path, family, kind):
    """A folder on CUDA (f16) against the CPU path on the same weights, as the GGUF models' GPU tests bound it:
    float ones quantized on load to q8_0 (DeepSeek's MLA kernels, experts routed on the device), and GPTQ, AWQ
    (q4_0 / q4_1 through the GEMV and the GEMM), block-wise FP8 and INT8 (q8_0) ones as they load by default."""
    folder = folders[family][0]
    if kind == "int8":
        pytest.importorskip("compressed_tensors")        # its compressor writes the checkpoint
    if kind is not None:
        folder = hf_checkpoints.write_pre_quantized(folder, tmp_path / kind, kind)
    quantization = "q8_0" if kind is None else "auto"
    cpu = cobatch_logits(folder, quantization)
    ckpt = HFCheckpoint(folder, quantization, device="cuda")
    gpu = prompt_logits(model_class(ckpt.config)(ckpt.config, ckpt, "cuda", torch.float16, max_positions=64),
                        ckpt.config, IDS)
    assert ((gpu - cpu).norm() / cpu.norm()).item() < 1e-2
    assert (gpu.argmax(-1) == cpu.argmax(-1)).float().mean() > 0.9
