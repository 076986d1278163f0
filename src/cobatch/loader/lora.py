"""LoRA adapters from disk, in the two layouts users have them in:

  - a PEFT folder (adapter_config.json and adapter_model.safetensors), as PEFT saves it and vLLM serves it;
  - a llama.cpp GGUF adapter (general.type "adapter", adapter.type "lora"), as convert_lora_to_gguf.py writes it.

Either becomes an `Adapter`: for each layer and projection part it touches (cobatch's names: q, k, v, or a fused
qkv; o; gate, up, or a fused gate_up; down), the pair A [r, in] and B [out, r] such that the part's output gains
x @ A.T @ B.T. Its scale (alpha / r, or alpha / sqrt(r) for rsLoRA) is folded into B, and B's rows are in the base
model's order: a GGUF llama file stores q's and k's rows permuted for its pairwise rotation, where Hugging Face's
checkpoints (and so PEFT's adapters) rotate halves, so B's q and k rows are permuted as llama.cpp's converter
permutes the weights.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from cobatch.config import ModelConfig
from cobatch.errors import UserError

# PEFT's module path -> (layer, part): the llama family's attention and dense feed-forward projections
_PEFT_MODULE = re.compile(r"(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)\.(q_proj|k_proj|v_proj|qkv_proj|o_proj|gate_proj|"
                          r"up_proj|gate_up_proj|down_proj)$")
_PEFT_PART = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "qkv_proj": "qkv", "o_proj": "o", "gate_proj": "gate",
              "up_proj": "up", "gate_up_proj": "gate_up", "down_proj": "down"}
# GGUF tensor name (blk.N.<name>.weight) -> part; phi3's fused gate|up is its ffn_up (told apart by its rows)
_GGUF_PART = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_qkv": "qkv", "attn_output": "o", "ffn_gate": "gate",
              "ffn_up": "up", "ffn_down": "down"}
_GGUF_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")
MAX_SCALE = 100.0         # a request's share of an adapter (1: as trained); far past any use, and within float16
MAX_VALUE = 1000.0        # the largest magnitude of an A or a B (scale folded in) taken


@dataclass(slots=True)
class Adapter:
    name: str                 # what requests call it (`model`)
    path: Path
    # (layer, part) -> (A [r, in], B [out, r] with the scale folded in), float32
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    scale: float = 1.0        # how much of it a request gets (llama.cpp's --lora-scaled); 1: as trained
    # what it computes, hashed: the prefix cache keys its KV blocks by it (engine/kv_cache.prefix_root), so an
    # adapter changed on disk under the same name does not find the old one's blocks
    fingerprint: bytes = b""

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _ in self.pairs.values())


def _fingerprint(pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], scale: float) -> bytes:
    h = hashlib.blake2b(repr(scale).encode(), digest_size=8)
    for key in sorted(pairs):
        h.update(repr(key).encode())
        for t in pairs[key]:
            h.update(t.contiguous().numpy().tobytes())
    return h.digest()


def load_adapter(path: str | Path, cfg: ModelConfig, name: str | None = None, scale: float = 1.0) -> Adapter:
    """The adapter at `path` (a PEFT folder or a GGUF file) for a base model of config `cfg`."""
    path = Path(path)
    name = name or _adapter_name(path)
    if cfg.mla is not None:
        raise UserError(f"LoRA adapter {name}: adapters are not supported for {cfg.arch} models (latent attention)")
    if path.is_dir():
        pairs = _peft_pairs(path, cfg)
    elif path.is_file():
        pairs = _gguf_pairs(path, cfg)
    else:
        raise UserError(f"LoRA adapter not found: {path}")
    if not pairs:
        raise UserError(f"LoRA adapter {path} holds no projection cobatch applies")
    if not -MAX_SCALE <= scale <= MAX_SCALE:
        raise UserError(f"LoRA adapter {name}: scale must be between -{MAX_SCALE:g} and {MAX_SCALE:g} (got {scale})")
    for (layer, part), (a, b) in pairs.items():
        _check_shape(path, cfg, layer, part, a, b)
    return Adapter(name, path, pairs, scale, _fingerprint(pairs, scale))


def adapter_flags(args) -> tuple[tuple[str, str, float], ...]:
    """(name, path, scale) of every adapter the command line's LoRA flags name: vLLM's --lora-modules (NAME=PATH,
    or JSON), llama.cpp's --lora PATH and --lora-scaled PATH SCALE."""
    out = []
    for item in getattr(args, "lora_modules", []):
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                out.append((str(spec["name"]), str(spec["path"]), 1.0))
            except (ValueError, KeyError, TypeError):
                raise UserError(f"--lora-modules: {item!r} is not a JSON object with a name and a path") from None
        elif "=" in item and item.split("=", 1)[0] and item.split("=", 1)[1]:
            name, path = item.split("=", 1)
            out.append((name, path, 1.0))
        else:
            raise UserError(f"--lora-modules: {item!r} is not NAME=PATH")
    for path in getattr(args, "lora", []):
        out.append((_adapter_name(path), path, 1.0))
    for path, scale in getattr(args, "lora_scaled", []):
        try:
            out.append((_adapter_name(path), path, float(scale)))
        except ValueError:
            raise UserError(f"--lora-scaled: the scale {scale!r} is not a number") from None
    return tuple(out)


def _adapter_name(path: str | Path) -> str:
    """What an adapter given by its path alone is called: its folder's name, or its GGUF file's without .gguf."""
    p = Path(path)
    return p.name if p.suffix != ".gguf" else p.stem


# ----------------------------------------------------------------------------------------------- PEFT

def _peft_pairs(folder: Path, cfg: ModelConfig) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise UserError(f"LoRA adapter folder {folder} has no adapter_config.json")
    try:
        config = json.loads(config_file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{config_file}: not valid JSON ({exc})") from None
    _check_peft_config(folder, config)
    weights = _peft_tensors(folder)
    permute = not cfg.rope_neox      # a GGUF llama base: q and k rows in pairwise-rotation order
    pairs = {}
    for key in weights:
        if ".lora_A." not in key:
            if ".lora_B." not in key:
                raise UserError(f"LoRA adapter {folder}: tensor {key} is not a LoRA pair's (only the projections' "
                                f"lora_A and lora_B are supported)")
            continue
        module = key.split(".lora_A.")[0]
        match = _PEFT_MODULE.fullmatch(module)
        if match is None or (match.group(2) == "mlp" and cfg.n_experts):
            raise UserError(f"LoRA adapter {folder}: {module} is not a projection cobatch applies adapters to "
                            f"(the attention projections, and a dense model's feed-forward)")
        b_key = key.replace(".lora_A.", ".lora_B.")
        if b_key not in weights:
            raise UserError(f"LoRA adapter {folder}: {key} has no {b_key}")
        a, b = weights[key].float(), weights[b_key].float()
        layer, part = int(match.group(1)), _PEFT_PART[match.group(3)]
        _check_shape(folder, cfg, layer, part, a, b)        # (before B's rows are permuted)
        r, short = a.shape[0], _short_name(module)
        alpha = _pattern_value(config.get("alpha_pattern") or {}, short, config.get("lora_alpha", 8))
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            raise UserError(f"LoRA adapter {folder}: lora_alpha of {module} is {alpha!r}, not a number")
        b = b * (alpha / (math.sqrt(r) if config.get("use_rslora") else r))
        if permute and part in ("q", "k"):
            b = _rotation_order(b, cfg.n_heads if part == "q" else cfg.n_kv_heads)
        pairs[(layer, part)] = (a, b)
    return pairs


def _check_peft_config(folder: Path, config: dict) -> None:
    if not isinstance(config, dict) or not isinstance(config.get("alpha_pattern") or {}, dict):
        raise UserError(f"LoRA adapter {folder}: adapter_config.json is not PEFT's (an object, alpha_pattern one too)")
    refuse = [
        (config.get("peft_type", "LORA") != "LORA", f"peft_type {config.get('peft_type')!r} (only LORA)"),
        (bool(config.get("use_dora")), "use_dora (DoRA's magnitude vectors)"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out (GPT-2's transposed layers)"),
        (config.get("bias", "none") != "none", f"bias {config.get('bias')!r} (only 'none')"),
        (bool(config.get("modules_to_save")), f"modules_to_save {config.get('modules_to_save')} (whole trained "
                                              "layers beside the adapter)"),
    ]
    for bad, what in refuse:
        if bad:
            raise UserError(f"LoRA adapter {folder}: {what} is not supported")


def _peft_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    file = folder / "adapter_model.safetensors"
    if file.is_file():
        try:
            return load_file(file)
        except (SafetensorError, OSError) as exc:
            raise UserError(f"{file}: not a readable safetensors file ({exc})") from None
    if (folder / "adapter_model.bin").is_file():
        raise UserError(f"LoRA adapter {folder}: adapter_model.bin (a pickle) is not read; save it as safetensors "
                        "(PEFT's default)")
    raise UserError(f"LoRA adapter folder {folder} has no adapter_model.safetensors")


def _short_name(module: str) -> str:
    """PEFT's key for rank_pattern / alpha_pattern: the module path from `model.layers...` on."""
    return module.split("base_model.model.", 1)[-1]


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """PEFT's per-module override: the first pattern the module path ends with (as a regular expression)."""
    for pattern, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{pattern}", module):
            return value
    return default


def _rotation_order(b: torch.Tensor, n_heads: int) -> torch.Tensor:
    """B's rows of q or k from Hugging Face's half-split rotation order to a GGUF llama file's pairwise one: the
    permutation llama.cpp's converter applies to the weights (convert_hf_to_gguf.py, LlamaModel.permute)."""
    rows = b.shape[0]
    return b.reshape(n_heads, 2, rows // n_heads // 2, *b.shape[1:]).swapaxes(1, 2).reshape(b.shape)


# ----------------------------------------------------------------------------------------------- GGUF

def _gguf_pairs(file: Path, cfg: ModelConfig) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    from cobatch.loader.gguf import GGUFFile
    gguf = GGUFFile(file)
    md = gguf.metadata
    if md.get("general.type") != "adapter" or md.get("adapter.type") != "lora":
        raise UserError(f"{file} is not a LoRA adapter (general.type {md.get('general.type')!r}, adapter.type "
                        f"{md.get('adapter.type')!r})")
    arch = md.get("general.architecture")
    if arch != cfg.arch:
        raise UserError(f"LoRA adapter {file} is for {arch} models; the model is {cfg.arch}")
    alpha = float(md.get("adapter.lora.alpha", 0.0))
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor in gguf.tensors:
        match = _GGUF_TENSOR.fullmatch(tensor)
        if match is None or match.group(2) not in _GGUF_PART:
            raise UserError(f"LoRA adapter {file}: tensor {tensor} is not a projection cobatch applies adapters to")
        layer, kind = int(match.group(1)), match.group(2)
        if kind.startswith("ffn_") and cfg.n_experts:
            raise UserError(f"LoRA adapter {file}: {tensor}: the model's feed-forward is its experts")
        halves.setdefault((layer, _GGUF_PART[kind]), {})[match.group(3)] = gguf.quant_weight(tensor).dequantize(
            torch.float32)
    pairs = {}
    for (layer, part), ab in halves.items():
        if set(ab) != {"a", "b"}:
            raise UserError(f"LoRA adapter {file}: layer {layer}'s {part} has lora_{''.join(ab)} alone")
        a, b = ab["a"], ab["b"]
        if part == "up" and b.dim() == 2 and b.shape[0] == 2 * cfg.ffn_dim:     # phi3: ffn_up holds gate|up
            part = "gate_up"
        _check_shape(file, cfg, layer, part, a, b)
        # llama.cpp: scale alpha / rank, where rank is B's inner size; no alpha: scale 1
        pairs[(layer, part)] = (a, b * (alpha / b.shape[1] if alpha else 1.0))
    return pairs


# ----------------------------------------------------------------------------------------------- shapes

def part_rows(cfg: ModelConfig, part: str) -> tuple[str, int, int]:
    """(projection, first row, rows) of a part in cobatch's fused projections: q|k|v and gate|up."""
    q, kv, ff = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    return {"q": ("qkv", 0, q), "k": ("qkv", q, kv), "v": ("qkv", q + kv, kv), "qkv": ("qkv", 0, q + 2 * kv),
            "o": ("o", 0, cfg.d_model), "gate": ("gate_up", 0, ff), "up": ("gate_up", ff, ff),
            "gate_up": ("gate_up", 0, 2 * ff), "down": ("down", 0, cfg.d_model)}[part]


def projection_inputs(cfg: ModelConfig, projection: str) -> int:
    """The width of a projection's input."""
    widths = {"qkv": cfg.d_model, "o": cfg.n_heads * cfg.head_dim, "gate_up": cfg.d_model, "down": cfg.ffn_dim}
    return widths[projection]


def _check_shape(path: Path, cfg: ModelConfig, layer: int, part: str, a: torch.Tensor, b: torch.Tensor) -> None:
    projection, _, rows = part_rows(cfg, part)
    cols = projection_inputs(cfg, projection)
    where = f"LoRA adapter {path}: layer {layer}'s {part}"
    if not 0 <= layer < cfg.n_layers:
        raise UserError(f"{where}: the model has {cfg.n_layers} layers")
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] == 0:
        raise UserError(f"{where}: A {list(a.shape)} and B {list(b.shape)} are not a low-rank pair")
    # A step multiplies the other adapters' columns by zero: a NaN, or a product past the dtype's range, there
    # would reach every row, the base model's too. Trained adapters stay far inside this.
    if not all(torch.isfinite(t).all() and t.abs().max() <= MAX_VALUE for t in (a, b)):
        raise UserError(f"{where} holds values that are not finite numbers or past +-{MAX_VALUE:g}: not a trained "
                        "adapter's")
    if a.shape[1] != cols or b.shape[0] != rows:
        raise UserError(f"{where} is {b.shape[0]} x {a.shape[1]}; the model's is {rows} x {cols}")
