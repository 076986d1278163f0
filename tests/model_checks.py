"""Shared by the model tests: open a GGUF, run one prompt's prefill, compare the CUDA path with the CPU one or
with Hugging Face transformers reading the same file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cobatch.batch import AttentionMetadata
from cobatch.config import ModelConfig
from cobatch.engine.kv_cache import KVPool
from cobatch.loader.gguf import GGUFFile
from cobatch.models.llama import LlamaModel
from cobatch.models.registry import model_class


def open_gguf(path) -> tuple[GGUFFile, ModelConfig]:
    f = GGUFFile(path)
    return f, ModelConfig.from_metadata(f.metadata, set(f.tensors))


def load_model(path, device="cpu", dtype=torch.float32, max_positions: int = 128):
    f, cfg = open_gguf(path)
    return f, cfg, model_class(cfg)(cfg, f, device, dtype, max_positions=max_positions)


def prompt_logits(model: LlamaModel, cfg: ModelConfig, ids: list[int], kv_dtype=None) -> torch.Tensor:
    """float32 logits of every position of one prompt, prefilled in one step on the model's device (CPU out);
    the KV cache in kv_dtype (default: the model's dtype)."""
    dev, n, bs = model.device, len(ids), 16
    blocks = -(-n // bs)
    pool = KVPool(cfg, blocks, bs, kv_dtype or model.dtype, dev)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=dev), query_start=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=dev)[None], max_query_len=n, max_seq_len=n)
    with torch.inference_mode():
        hidden = model.forward(torch.tensor(ids, device=dev), torch.arange(n, device=dev), meta, pool.k, pool.v)
        return model.logits(hidden).float().cpu()


def gpu_and_cpu_logits(path, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(f16 CUDA logits, f32 CPU logits) of the same file and prompt."""
    _, cfg, cpu = load_model(path)
    _, _, gpu = load_model(path, "cuda", torch.float16)
    return prompt_logits(gpu, cfg, ids), prompt_logits(cpu, cfg, ids)


def transformers_float_model(folder):
    """transformers' float32 model of a checkpoint folder, with its eager attention: the exact reference whatever
    the installed version's default (Gemma-2's logit softcapping and sliding window are not in every other path).
    The GPU machine's transformers 5.17 put its tiny Gemma-2 folders 2-6e-3 from ours with the default attention;
    whether eager closes that was not yet run there."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def transformers_logits(path, ids: list[int], **config) -> torch.Tensor:
    """float32 logits of one prompt from transformers loading the same GGUF (the independent reference; skips
    without transformers). `config` overrides what its GGUF mapping does not carry."""
    transformers = pytest.importorskip("transformers")
    path = Path(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                           **config)
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def assert_same_or_tie(ref_logits, prompt, want, got, tol):
    """Token lists equal, or they first differ where the reference scores both choices within tol."""
    i = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), None)
    if i is None:
        assert len(want) == len(got)
        return None
    logits = ref_logits(prompt + want[:i])[-1]
    gap = (logits[want[i]] - logits[got[i]]).abs().item()
    assert gap <= tol, f"diverged at step {i} with a reference margin of {gap:.4f} (> {tol}): not a tie"
    return i, gap
