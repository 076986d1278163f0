"""Hugging Face checkpoint folders for tests: tiny random models written by transformers itself
(`save_pretrained`), and FP8 / NVFP4 checkpoints made from a float one in the layouts vLLM and ModelOpt read.

A tiny model has random weights (norms and biases too, so a misplaced tensor shows in its logits), a byte-level BPE
tokenizer trained on a few sentences (tokenizer.json, tokenizer_config.json with a ChatML template) and a
generation_config.json; it is written in well under a second. transformers is a test dependency: this module
imports it only when asked.

FP8 (compressed-tensors, "float-quantized"): each linear layer's `weight` in float8_e4m3fn with `weight_scale`
float32, [1] per tensor or [out, 1] per channel (amax / 448); config.json's quantization_config as llm-compressor
writes it. NVFP4 (ModelOpt): `weight` uint8 [out, in / 2] of e2m1 pairs (the even element in the low nibble),
`weight_scale` float8_e4m3fn [out, in / 16] (each 16-value block's amax / 6, over the global scale),
`weight_scale_2` float32 scalar (the tensor's amax / (6 * 448)), `input_scale` float32 scalar;
quantization_config {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16} and hf_quant_config.json.
The lm_head, embeddings, norms and MoE routers stay as they were.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from cobatch.quant.formats import E2M1_VALUES, format_of, nvfp4_blocks
from cobatch.quant.weight import QuantWeight

FP8_MAX, E2M1_MAX = 448.0, 6.0
INT4_GROUP = 64           # the test checkpoints' INT4 groups: several a tiny matrix's row
FP8_BLOCK = (48, 96)       # the test checkpoints' FP8 blocks (rows, columns): the tiny matrices end in part blocks
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello, world! How are you today?",
           "def add(a, b):\n    return a + b\n", "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 1000.",
           "A tiny model has a tiny vocabulary, trained on a few sentences like these ones."] * 4

# 256 wide, so that every matrix is whole q4_K super-blocks
_TINY = dict(vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-6)
# DeepSeek's latent attention and experts, tiny (the heads' keys 32 + 16 wide, values 32, a latent of 64)
_MLA = dict(num_key_value_heads=4, head_dim=None, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
            v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
            first_k_dense_replace=1)
# family -> (transformers config class, its fields beyond _TINY)
FAMILIES = {
    "llama": ("LlamaConfig", {"rope_theta": 10000.0}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {"rope_theta": 1e6}),
    "qwen3": ("Qwen3Config", {"rope_theta": 1e6}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 256}),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
                                     "shared_expert_intermediate_size": 512}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
                                     "norm_topk_prob": True}),
    "phi3": ("Phi3Config", {"num_key_value_heads": 4, "head_dim": None, "pad_token_id": 0}),
    "gemma2": ("Gemma2Config", {"sliding_window": 8, "query_pre_attn_scalar": 64, "attn_logit_softcapping": 50.0,
                                "final_logit_softcapping": 30.0, "num_hidden_layers": 4}),
    "gemma3_text": ("Gemma3TextConfig", {"sliding_window": 8, "query_pre_attn_scalar": 64,
                                         "num_hidden_layers": 6, "rope_local_base_freq": 10000.0}),
    # Granite: Granite-3.3-8B's multipliers but q.k's (its 1/128 would flatten these 64-wide heads' scores)
    "granite": ("GraniteConfig", {"embedding_multiplier": 12.0, "attention_multiplier": 0.1,
                                  "residual_multiplier": 0.22, "logits_scaling": 16.0}),
    # DeepSeek: MLA (V2 with q straight from h, V3 through its LoRA pair), a dense first layer, shared experts; V2's
    # softmax router limited to 2 of 4 groups, V3's sigmoid with its correction bias and YaRN
    "deepseek_v2": ("DeepseekV2Config", {**_MLA, "q_lora_rank": None, "n_shared_experts": 2, "n_group": 4,
                                         "topk_group": 2, "topk_method": "group_limited_greedy",
                                         "routed_scaling_factor": 1.5, "norm_topk_prob": False}),
    "deepseek_v3": ("DeepseekV3Config", {**_MLA, "q_lora_rank": 64, "n_shared_experts": 1, "n_group": 4,
                                         "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                                         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                             "original_max_position_embeddings": 64,
                                                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707,
                                                             "mscale_all_dim": 0.707}}),
}


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE trained on _CORPUS, saved through transformers (tokenizer.json, tokenizer_config.json)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                         show_progress=False))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                                eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(folder)


def write_tiny_model(folder: str | Path, family: str, seed: int = 0, max_shard_size: str | None = None) -> Path:
    """A random `family` model saved by transformers (f32 safetensors; sharded with an index when
    max_shard_size is given, e.g. "200KB"), with its tokenizer and generation_config.json."""
    import transformers
    folder = Path(folder)
    class_name, extra = FAMILIES[family]
    fields = {**_TINY, **extra}
    if fields.get("head_dim") is None:
        fields.pop("head_dim")
    config = getattr(transformers, class_name)(**fields, bos_token_id=0, eos_token_id=2,
                                               tie_word_embeddings=family.startswith("gemma"))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:        # norms around their identity (gemma stores w - 1), biases around 0
                base = 0.0 if family.startswith("gemma") or name.endswith("bias") else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(p.shape[-1] ** -0.5 * torch.randn(p.shape, generator=gen))
        for name, buf in model.named_buffers():     # DeepSeek-V3's correction of the experts' choice (a buffer)
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))
    model.generation_config = transformers.GenerationConfig(temperature=0.6, top_p=0.9, top_k=20, do_sample=True,
                                                            eos_token_id=[2, 1], bos_token_id=0)
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    write_tokenizer(folder, config.vocab_size - 16)      # the embedding has rows past the tokenizer's vocabulary
    return folder


# ---------------------------------------------------------------- pre-quantized checkpoints

def _quantized_names(names: list[str]) -> list[str]:
    """The linear layers a quantizer converts (vLLM's and ModelOpt's default: not lm_head, embeddings, routers)."""
    keep = ("lm_head", "embed_tokens", "mlp.gate.weight", "shared_expert_gate", "block_sparse_moe.gate.weight")
    return [n for n in names if n.endswith("proj.weight") or n.endswith((".w1.weight", ".w2.weight", ".w3.weight"))
            if not any(k in n for k in keep)]


def to_fp8(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale [out, 1] or [1]) with w ~ weight * scale."""
    amax = w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
    scale = (amax / FP8_MAX).clamp(min=1e-12).float()
    q = (w.float() / (scale if per_channel else scale[0])).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def to_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale [ceil(out / block[0]), ceil(in / block[1])]) with w ~ weight * its block's scale,
    as DeepSeek-V3's and Qwen3's FP8 releases hold them (the scale named weight_scale_inv)."""
    rows, cols = w.shape
    br, bc = block
    padded = torch.zeros(-(-rows // br) * br, -(-cols // bc) * bc)
    padded[:rows, :cols] = w.float()
    amax = padded.reshape(padded.shape[0] // br, br, padded.shape[1] // bc, bc).abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    per_value = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return (w.float() / per_value).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def to_int4_packed(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """w as compressed-tensors' pack-quantized symmetric INT4 (W4A16) holds it, packed by compressed-tensors' own
    compressor: weight_packed, weight_scale (bf16, a group's amax / 7.5; group 0: one a row), weight_shape."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    rows, cols = w.shape
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group" if group else "channel",
                            group_size=group or None)
    scale = (w.float().reshape(rows, -1, group or cols).abs().amax(-1) / 7.5).clamp(min=1e-8).to(torch.bfloat16)
    return PackedQuantizationCompressor.compress({"weight": w.float(), "weight_scale": scale},
                                                 QuantizationScheme(targets=["Linear"], weights=args))


_SHIFTS = 4 * torch.arange(8)      # value k of an int32 word of 4-bit values at bits 4 k


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (int64) as the int32 tensors the checkpoints store (the same bits)."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _with_zero_points(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float16 scale, zero point in 0..15) of each group of the last dim: (max - min) / 15 and round(-min / scale)."""
    low, high = blocks.amin(-1), blocks.amax(-1)
    scale = ((high - low).clamp(min=1e-5) / 15).half()
    return scale, (-low / scale.float()).round().clamp(0, 15).long()


def _nibbles(blocks: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Each value of each group as round(value / scale) + zero, in 0..15."""
    return ((blocks / scale.float()[..., None]).round() + zero[..., None]).clamp(0, 15).long()


def to_gptq(w: torch.Tensor, group: int, sym: bool = True) -> dict[str, torch.Tensor]:
    """w as a 4-bit GPTQ checkpoint holds it, in AutoGPTQ's layout (group 0: one a row): qweight int32 [in / 8,
    out], input rows 8 r .. 8 r + 7 of a column in word r, row 8 r + k at bits 4 k, each value round(w / scale) +
    zero; scales float16 [groups, out]; qzeros int32 [groups, out / 8], columns packed 8 a word the same way, each
    zero stored less 1 as AutoGPTQ writes it; g_idx int32 [in], each input's group. sym: zero 8 and a group's
    amax / 7.5 as its scale; else (max - min) / 15 and round(-min / scale)."""
    rows, cols = w.shape
    group = group or cols
    blocks = w.float().reshape(rows, -1, group)
    if sym:
        scale = (blocks.abs().amax(-1) / 7.5).clamp(min=1e-8).half()
        zero = torch.full(scale.shape, 8)
    else:
        scale, zero = _with_zero_points(blocks)
    q = _nibbles(blocks, scale, zero).reshape(rows, cols)
    qweight = (q.t().reshape(cols // 8, 8, rows) << _SHIFTS[:, None]).sum(1)        # word r: inputs 8 r + k
    qzeros = ((zero.t() - 1).reshape(cols // group, rows // 8, 8) << _SHIFTS).sum(-1)  # word c: columns 8 c + k
    return {"qweight": _as_int32(qweight), "qzeros": _as_int32(qzeros), "scales": scale.t().contiguous(),
            "g_idx": (torch.arange(cols) // group).to(torch.int32)}


def to_int8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """w as compressed-tensors' int-quantized symmetric INT8 (W8A16 / W8A8) holds it, quantized by compressed-tensors'
    own compressor: weight int8, weight_scale (bf16, [out, 1]: a row's amax / 127.5)."""
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    scale = (w.float().abs().amax(1, keepdim=True) / 127.5).clamp(min=1e-8).to(torch.bfloat16)
    return IntQuantizationCompressor.compress({"weight": w.float(), "weight_scale": scale},
                                              QuantizationScheme(targets=["Linear"], weights=args))


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # AutoAWQ's GEMM layout: value k of a word is column 8 c + AWQ_ORDER[k]


def to_awq(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """w as a 4-bit AWQ checkpoint holds it in AutoAWQ's GEMM layout: per group of `group` inputs of a column, a
    scale (float16, (max - min) / 15) and a zero point (round(-min / scale)), each value round(w / scale) + zero in
    0..15; qweight int32 [in, out / 8] and qzeros int32 [groups, out / 8] packing 8 output columns a word, column
    8 c + AWQ_ORDER[k] at bits 4 k; scales [groups, out]."""
    rows, cols = w.shape
    blocks = w.float().reshape(rows, -1, group)
    scale, zero = _with_zero_points(blocks)                                        # [out, groups]
    q = _nibbles(blocks, scale, zero).reshape(rows, cols)

    def pack_columns(values: torch.Tensor) -> torch.Tensor:    # [n, out] -> [n, out / 8]
        return _as_int32((values.reshape(values.shape[0], -1, 8)[..., list(AWQ_ORDER)] << _SHIFTS).sum(-1))

    return {"qweight": pack_columns(q.t()), "qzeros": pack_columns(zero.t()), "scales": scale.t().contiguous()}


def to_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uint8 [out, in / 2] e2m1 pairs, e4m3 block scales [out, in / 16], float32 global scale [])."""
    w = w.float()
    rows, cols = w.shape
    global_scale = (w.abs().amax() / (E2M1_MAX * FP8_MAX)).clamp(min=1e-12)
    blocks = w.reshape(rows, cols // 16, 16)
    block_scale = (blocks.abs().amax(-1) / E2M1_MAX / global_scale).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    denom = block_scale.float()[..., None] * global_scale
    scaled = torch.where(denom > 0, blocks / torch.where(denom > 0, denom, 1), 0).clamp(-E2M1_MAX, E2M1_MAX)
    grid = torch.tensor(E2M1_VALUES)
    code = (scaled.abs()[..., None] - grid).abs().argmin(-1).to(torch.uint8) | ((scaled < 0).to(torch.uint8) << 3)
    code = code.reshape(rows, cols // 2, 2)
    return code[..., 0] | (code[..., 1] << 4), block_scale, global_scale.reshape(())


def checkpoint_weight(values: torch.Tensor, fmt_name: str) -> QuantWeight:
    """Float values [rows, cols] as an FP8 (per channel) or NVFP4 checkpoint holds them, in the QuantWeight
    loader/hf.py reads from it: the format's bytes and the row scale."""
    rows, cols = values.shape
    if fmt_name == "fp8_e4m3":
        q, scale = to_fp8(values, per_channel=True)
        return QuantWeight(format_of(fmt_name), rows, cols, q.view(torch.uint8), scale[:, 0])
    codes, block_scale, global_scale = to_nvfp4(values)
    return QuantWeight(format_of(fmt_name), rows, cols, nvfp4_blocks(codes, block_scale),
                       global_scale.expand(rows).contiguous())


def write_pre_quantized(src: str | Path, dst: str | Path, kind: str) -> Path:
    """src's float checkpoint as `kind`:
      - "fp8_tensor" / "fp8_channel" (compressed-tensors);
      - "int4_group" / "int4_channel" (compressed-tensors' pack-quantized W4A16, INT4_GROUP values a scale or one a
        row); "int8" (compressed-tensors' int-quantized W8A8, a scale a row);
      - "gptq" / "gptq_asym" (AutoGPTQ's layout, symmetric or with zero points, INT4_GROUP values a scale);
      - "awq" (AutoAWQ's GEMM layout, a scale and a zero a group);
      - "fp8_blocks" (fp8's block-wise scales, 128 x 128 in DeepSeek's and Qwen's releases, FP8_BLOCK here: several
        a tiny matrix, the last ones part blocks);
      - "nvfp4" (ModelOpt)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            tensors.update({n: f.get_tensor(n) for n in f.keys()})
    out = dict(tensors)
    for name in _quantized_names(list(tensors)):
        base = name.removesuffix("weight")
        if kind == "nvfp4":
            out[name], out[base + "weight_scale"], out[base + "weight_scale_2"] = to_nvfp4(tensors[name])
            out[base + "input_scale"] = torch.tensor(1.0)
        elif kind == "fp8_blocks":
            out[name], out[base + "weight_scale_inv"] = to_fp8_blocks(tensors[name], FP8_BLOCK)
        elif kind.startswith("int4"):
            del out[name]
            packed = to_int4_packed(tensors[name], INT4_GROUP if kind == "int4_group" else 0)
            out.update({base + part: t for part, t in packed.items()})
        elif kind == "int8":
            out.update({base + part: t for part, t in to_int8(tensors[name]).items()})
        elif kind in ("gptq", "gptq_asym", "awq"):
            del out[name]
            packed = (to_awq(tensors[name], INT4_GROUP) if kind == "awq"
                      else to_gptq(tensors[name], INT4_GROUP, sym=kind == "gptq"))
            out.update({base + part: t for part, t in packed.items()})
        else:
            out[name], scale = to_fp8(tensors[name], per_channel=kind == "fp8_channel")
            out[base + "weight_scale"] = scale
    save_file({n: t.contiguous() for n, t in out.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if kind == "nvfp4":
        quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": ["lm_head"]}
        config["quantization_config"] = {"quant_method": "modelopt", **quant}
        (dst / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"},
                                                              "quantization": quant}, indent=2))
    elif kind == "fp8_blocks":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": list(FP8_BLOCK)}
    elif kind.startswith("gptq"):
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": INT4_GROUP,
                                         "sym": kind == "gptq",
                                         "desc_act": False, "checkpoint_format": "gptq", "damp_percent": 0.01,
                                         "true_sequential": True, "static_groups": False}
    elif kind == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": INT4_GROUP, "zero_point": True,
                                         "version": "gemm", "modules_to_not_convert": None}
    elif kind == "int8":
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                      "dynamic": True}}}}
    elif kind.startswith("int4"):
        grouped = kind == "int4_group"
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": None,
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "dynamic": False, "actorder": None,
                            "strategy": "group" if grouped else "channel",
                            "group_size": INT4_GROUP if grouped else None}}}}
    else:
        strategy = "channel" if kind == "fp8_channel" else "tensor"
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                      "dynamic": True}}}}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


# ---------------------------------------------------------------- random full-size checkpoints (benchmarks)

def write_random_checkpoint(folder: str | Path, shape: str, seed: int = 0, device: str = "cpu",
                            shard_bytes: int = 4 << 30, layers: int | None = None) -> Path:
    """A bf16 Hugging Face folder of random weights in one of gguf_writer's dense llama / qwen2 shapes (e.g.
    llama3-8b), written shard by shard (a tensor drawn on `device` at a time, never the whole model in memory), with
    the tiny byte-level tokenizer: benchmarks time loading and decoding, which the weights' values do not change."""
    from safetensors.torch import save_file
    from cobatch.testing.gguf_writer import lookup_shape
    s = lookup_shape(shape)
    if s.arch not in ("llama", "qwen2") or s.n_experts:
        raise ValueError(f"write_random_checkpoint writes dense llama and qwen2 shapes, not {shape!r}")
    n_layers = layers or s.n_layers
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    d, hd, ffn, vocab = s.d_model, s.head_dim, s.ffn_dim, s.vocab_size or 384
    tensors = [("model.embed_tokens.weight", (vocab, d))]
    for i in range(n_layers):
        p = f"model.layers.{i}."
        tensors += [(p + "input_layernorm.weight", (d,)), (p + "post_attention_layernorm.weight", (d,)),
                    (p + "self_attn.q_proj.weight", (s.n_heads * hd, d)),
                    (p + "self_attn.k_proj.weight", (s.n_kv_heads * hd, d)),
                    (p + "self_attn.v_proj.weight", (s.n_kv_heads * hd, d)),
                    (p + "self_attn.o_proj.weight", (d, s.n_heads * hd)),
                    (p + "mlp.gate_proj.weight", (ffn, d)), (p + "mlp.up_proj.weight", (ffn, d)),
                    (p + "mlp.down_proj.weight", (d, ffn))]
        if s.qkv_bias:
            tensors += [(p + f"self_attn.{x}_proj.bias", (n,)) for x, n in
                        (("q", s.n_heads * hd), ("k", s.n_kv_heads * hd), ("v", s.n_kv_heads * hd))]
    tensors.append(("model.norm.weight", (d,)))
    if not s.tied_embeddings:
        tensors.append(("lm_head.weight", (vocab, d)))
    gen = torch.Generator(device=device).manual_seed(seed)
    shards: list[list[tuple[str, tuple]]] = [[]]
    size = 0
    for name, dims in tensors:
        n = 2 * int(torch.Size(dims).numel())
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += n
    weight_map = {}
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        out = {}
        for name, dims in shard:
            if len(dims) == 1:
                t = (0.0 if name.endswith("bias") else 1.0) + 0.1 * torch.randn(dims, generator=gen, device=device)
            else:
                t = dims[-1] ** -0.5 * torch.randn(dims, generator=gen, device=device)
            out[name] = t.to(torch.bfloat16).cpu()
            weight_map[name] = file
        save_file(out, folder / file, metadata={"format": "pt"})
        del out
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {"architectures": ["LlamaForCausalLM" if s.arch == "llama" else "Qwen2ForCausalLM"],
              "model_type": s.arch, "hidden_size": d, "intermediate_size": ffn, "num_hidden_layers": n_layers,
              "num_attention_heads": s.n_heads, "num_key_value_heads": s.n_kv_heads, "head_dim": hd,
              "vocab_size": vocab, "max_position_embeddings": s.context_length, "rms_norm_eps": s.rms_eps,
              "rope_theta": s.rope_theta, "tie_word_embeddings": s.tied_embeddings, "torch_dtype": "bfloat16",
              "bos_token_id": 0, "eos_token_id": 2, "hidden_act": "silu"}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(folder, 368)      # the embedding has rows past the tokenizer's vocabulary
    return folder
