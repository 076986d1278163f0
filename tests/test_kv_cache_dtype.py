"""--kv-cache-dtype fp8 (vLLM's name; llama.cpp's -ctk/-ctv q8_0): K and V stored in float8 e4m3, one byte a
value, widened to the activations' dtype as attention reads them. Twice the tokens in the same memory, half
the bytes a decode step's attention reads, at the price of 3 mantissa bits per cached value.

On the CPU path: batching never changes a sequence's tokens (the logits against transformers' float32 reference are
in test_reference.py, beside the transformers models it loads once). The kernels' fp8 reads and writes are
tested in test_attention_kernels.py / test_kernels_small.py.
"""

from types import SimpleNamespace

import torch

from cobatch.engine.kv_cache import KVPool
from cobatch.engine.sampler import SamplingParams
from model_fixtures import load_llm

FP8 = torch.float8_e4m3fn


def test_an_fp8_pool_block_takes_half_the_bytes_of_bf16():
    cfg = SimpleNamespace(n_layers=32, kv_cache_heads=(8, 128, 128))     # Llama-3-8B's KV shape (heads, K, V)
    assert KVPool.bytes_per_block(cfg, 16, FP8) * 2 == KVPool.bytes_per_block(cfg, 16, torch.bfloat16) == 2 << 20
    pool = KVPool(cfg, 3, 16, FP8, "cpu")
    assert pool.k[0].dtype == FP8 and pool.nbytes == 3 * KVPool.bytes_per_block(cfg, 16, FP8)


def test_fp8_cache_batched_greedy_equals_each_alone_and_answers():
    llm = load_llm("smollm2", kv_cache_dtype="fp8")
    assert llm.engine.pool.dtype == FP8
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = [llm.encode_prompt(t) for t in ("The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,")]
    alone = [llm.engine.generate([p], greedy)[0] for p in prompts]
    assert llm.engine.generate(prompts, greedy) == alone
    chat = llm.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    answer = llm.tokenizer.decode(llm.engine.generate([chat], greedy)[0])
    assert "Paris" in answer, answer
