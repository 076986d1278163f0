"""Shared loaders for the real test models (loaded once per test session: they take seconds)."""

from __future__ import annotations

import functools

from cobatch.llm import LLM, EngineOptions
from cobatch.model_files import qwen_coder_path, smollm2_path


@functools.lru_cache(maxsize=None)
def load_llm(which: str, max_num_seqs: int = 8, ctx: int = 1024, prefill_chunk: int = 512,
             kv_cache_dtype: str = "auto") -> LLM:
    path = smollm2_path() if which == "smollm2" else qwen_coder_path()
    return LLM.load(path, EngineOptions(device="cpu", ctx=ctx, max_num_seqs=max_num_seqs,
                                        prefill_chunk=prefill_chunk, kv_cache_dtype=kv_cache_dtype, quiet=True))
