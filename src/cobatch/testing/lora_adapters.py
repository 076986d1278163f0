"""LoRA adapters for tests: random ones made and saved by PEFT itself, and the same written as a llama.cpp GGUF
adapter in the layout convert_lora_to_gguf.py writes (general.type "adapter", adapter.type "lora",
adapter.lora.alpha; per projection `blk.N.<tensor>.weight.lora_a` [r, in] and `.lora_b` [out, r], B's q and k rows
permuted as the llama converter permutes those weights). peft is a test dependency: imported only when asked.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
FEED_FORWARD = ["gate_proj", "up_proj", "down_proj"]
FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]      # phi3's modules
# PEFT module -> GGUF tensor of the llama family
GGUF_TENSOR = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "qkv_proj": "attn_qkv",
               "o_proj": "attn_output", "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def write_peft_adapter(model, folder: str | Path, targets: list[str], seed: int, rank: int = 4, alpha: int = 8,
                       **config) -> tuple[object, Path]:
    """A random LoRA adapter on a transformers model, saved by PEFT to `folder`; returns (the PEFT model, folder).
    B is random too (PEFT's default starts it at zero, which would test nothing), about as large as A."""
    import peft
    torch.manual_seed(seed)
    lora = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **config)
    peft_model = peft.get_peft_model(model, lora)
    peft_model.save_pretrained(folder)
    return peft_model, Path(folder)


def peft_to_gguf(folder: str | Path, out: str | Path, arch: str, n_heads: int, n_kv_heads: int) -> Path:
    """A PEFT adapter folder (of a llama-family model) rewritten as llama.cpp's GGUF adapter for `arch`."""
    import gguf
    from safetensors.torch import load_file
    folder, out = Path(folder), Path(out)
    config = json.loads((folder / "adapter_config.json").read_text())
    weights = load_file(folder / "adapter_model.safetensors")
    writer = gguf.GGUFWriter(out, arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(config["lora_alpha"]))
    for key in sorted(weights):
        if ".lora_A." not in key:
            continue
        module = key.split(".lora_A.")[0]
        layer = int(module.split("layers.")[1].split(".")[0])
        kind = module.rsplit(".", 1)[1]
        a, b = weights[key].float(), weights[key.replace(".lora_A.", ".lora_B.")].float()
        if arch == "llama" and kind in ("q_proj", "k_proj"):
            heads = n_heads if kind == "q_proj" else n_kv_heads
            b = b.reshape(heads, 2, b.shape[0] // heads // 2, b.shape[1]).swapaxes(1, 2).reshape(b.shape)
        name = f"blk.{layer}.{GGUF_TENSOR[kind]}.weight"
        writer.add_tensor(name + ".lora_a", a.numpy())
        writer.add_tensor(name + ".lora_b", b.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def write_random_adapter(folder: str | Path, cfg, rank: int, seed: int = 0) -> Path:
    """A random LoRA adapter of rank `rank` on every attention and feed-forward projection of a model of config
    `cfg` (a ModelConfig), in PEFT's layout, written without PEFT: for benchmarks on models of real shapes. A is
    scaled as PEFT's Kaiming init, B so that the adapter moves each output by about a hundredth of its input."""
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    q, kv, d, ff = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.d_model, cfg.ffn_dim
    shapes = {"self_attn.q_proj": (q, d), "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d),
              "self_attn.o_proj": (d, q), "mlp.gate_proj": (ff, d), "mlp.up_proj": (ff, d), "mlp.down_proj": (d, ff)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.n_layers):
        for module, (rows, cols) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, cols, generator=gen) * cols ** -0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(rows, rank, generator=gen) * (0.01 * rank ** -0.5)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "bias": "none",
              "target_modules": [m.split(".")[1] for m in shapes]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder
