"""Shared loaders for the real test models (loaded once per test session: they take seconds)."""

from __future__ import annotations

import functools
from pathlib import Path

from cobatch.llm import LLM, EngineOptions
from cobatch.model_files import qwen_coder_path, smollm2_path


# The last two loads only: the suite runs in two processes (README), each going through many files, and unbounded
# caches of every variant (qwen ~3 GB, smollm2 ~1 GB each) took both to 20 GB together.
@functools.lru_cache(maxsize=2)
def load_llm(which: str, max_num_seqs: int = 8, ctx: int = 1024, prefill_chunk: int = 512,
             kv_cache_dtype: str = "auto", scheduling_policy: str = "fcfs") -> LLM:
    path = smollm2_path() if which == "smollm2" else qwen_coder_path()
    return LLM.load(path, EngineOptions(device="cpu", ctx=ctx, max_num_seqs=max_num_seqs,
                                        prefill_chunk=prefill_chunk, kv_cache_dtype=kv_cache_dtype,
                                        scheduling_policy=scheduling_policy, quiet=True))


# transformers reading a GGUF is the slowest step of the reference tests (it parses and dequantizes the file with
# gguf-py: tens of seconds for Qwen2.5-Coder-0.5B), so each process reads each file once, float32, for every test.
@functools.lru_cache(maxsize=2)
def load_transformers(path: str | Path):
    """transformers' tokenizer and float32 model (eval mode) for a GGUF file: the independent reference."""
    import pytest
    import torch
    transformers = pytest.importorskip("transformers")
    path = Path(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    return tokenizer, model.eval()
