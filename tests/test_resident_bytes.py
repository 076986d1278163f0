"""The weight bytes a loaded model holds (the serve banner's "weights:" line), against the GGUF file's own count."""

from __future__ import annotations

import math

import gguf
import torch

from cobatch.model_files import smollm2_path
from cobatch.models.linear import resident_bytes

from model_fixtures import load_llm


def test_cpu_model_holds_every_gguf_weight_once_in_float32():
    """The CPU path dequantizes every matrix to float32 at load; SmolLM2 ties its head to the embedding, so each
    GGUF tensor is held once, plus the RoPE table. Counted from gguf-py's reader, not from our loader."""
    llm = load_llm("smollm2")
    weights = sum(math.prod(int(d) for d in t.shape) for t in gguf.GGUFReader(smollm2_path()).tensors)
    held = resident_bytes(llm.model)
    assert held["quantized"] == 0 and held["bf16_copies"] == 0
    assert llm.model.dtype == torch.float32
    assert 4 * weights <= held["dense"] <= 4 * weights * 1.02, (held, weights)
