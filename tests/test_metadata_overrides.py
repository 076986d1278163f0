"""llama.cpp's --override-kv and rope flags: parsed into metadata overrides, applied to a GGUF file's metadata at
load, and reaching the model (its rope base changes its logits; the file's own value leaves them as they were)."""

from __future__ import annotations

import pytest
import torch

from cobatch.cli import build_parser
from cobatch.errors import UserError
from cobatch.llm import LLM, EngineOptions
from cobatch.loader.metadata_overrides import apply_overrides, override_flags, parse_override
from cobatch.model_files import smollm2_path
from model_checks import prompt_logits


def test_parse_override_types_and_errors():
    assert parse_override("llama.context_length=int:4096") == ("llama.context_length", 4096)
    assert parse_override("llama.rope.freq_base=float:5e5") == ("llama.rope.freq_base", 500000.0)
    assert parse_override("tokenizer.ggml.add_bos_token=bool:false") == ("tokenizer.ggml.add_bos_token", False)
    assert parse_override("general.name=str:a=b:c") == ("general.name", "a=b:c")
    for bad in ("llama.context_length", "k=int", "k=long:5", "k=int:5.5", "k=bool:yes", "k=float:nan", "=int:1"):
        with pytest.raises(UserError, match="--override-kv"):
            parse_override(bad)


def test_flags_become_overrides_and_a_scale_stretches_the_context():
    args = build_parser().parse_args(["serve", "--rope-freq-scale", "0.25", "--rope-freq-base", "1e6",
                                      "--override-kv", "llama.block_count=int:2"])
    overrides = override_flags(args)
    metadata = {"general.architecture": "llama", "llama.context_length": 2048, "llama.block_count": 30}
    apply_overrides(metadata, overrides)
    assert metadata == {"general.architecture": "llama", "llama.context_length": 8192, "llama.block_count": 2,
                        "llama.rope.freq_base": 1e6, "llama.rope.scaling.factor": 4.0,
                        "llama.rope.scaling.type": "linear", "llama.rope.scaling.original_context_length": 2048}
    # an explicit context length wins; a file's own scaling type stays
    metadata = {"general.architecture": "qwen2", "qwen2.context_length": 4096, "qwen2.rope.scaling.type": "yarn"}
    apply_overrides(metadata, [("{arch}.rope.scaling.factor", 2.0), ("{arch}.context_length", 5000)])
    assert (metadata["qwen2.context_length"], metadata["qwen2.rope.scaling.type"]) == (5000, "yarn")
    for bad in (["--rope-freq-scale", "2"], ["--rope-scale", "0"], ["--yarn-attn-factor", "-1"]):
        with pytest.raises(UserError):
            override_flags(build_parser().parse_args(["serve", *bad]))


def test_the_rope_base_reaches_the_model():
    def load(*overrides):
        return LLM.load(smollm2_path(), EngineOptions(device="cpu", ctx=64, max_num_seqs=1, kv_cache_gb=0.05,
                                                      metadata_overrides=overrides, quiet=True))
    plain = load()
    ids = plain.encode_prompt("The capital of France is Paris, and the capital of Italy is")
    base = prompt_logits(plain.model, plain.config, ids)
    own = plain.config.rope_theta
    same = load(("{arch}.rope.freq_base", own))
    assert torch.equal(prompt_logits(same.model, same.config, ids), base)
    moved = load(("{arch}.rope.freq_base", own / 50))
    assert moved.config.rope_theta == own / 50
    shifted = prompt_logits(moved.model, moved.config, ids)
    assert (shifted - base).abs().max() > 1e-2
    by_key = load(("llama.rope.freq_base", own / 50))
    assert torch.equal(prompt_logits(by_key.model, by_key.config, ids), shifted)
