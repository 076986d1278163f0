"""--kv-cache-dtype fp8 (vLLM's name; llama.cpp's -ctk/-ctv q8_0): K and V stored in float8 e4m3, one byte a
value, widened to the activations' dtype as attention reads them. Twice the tokens in the same memory, half
the bytes a decode step's attention reads, at the price of 3 mantissa bits per cached value.

On the CPU path: the logits stay close to an independent reference (transformers loading the same GGUF, with
its float32 cache), and batching still never changes a sequence's tokens. The kernels' fp8 reads and writes are
tested in test_attention_kernels.py / test_kernels_small.py.
"""

from types import SimpleNamespace

import pytest
import torch

from cobatch.engine.kv_cache import KVPool
from cobatch.engine.sampler import SamplingParams
from cobatch.model_files import qwen_coder_path, smollm2_path
from model_checks import prompt_logits
from model_fixtures import load_llm, load_transformers

FP8 = torch.float8_e4m3fn
TEXTS = {
    "smollm2": "The history of the Roman Empire spans many centuries. It began when Augustus became the first emperor "
               "in 27 BC and, in the West, ended in 476 AD. During this time, the empire grew to include",
    "qwen2.5-coder": "def quicksort(items):\n    if len(items) <= 1:\n        return items\n    pivot = items[0]\n"
                     "    left = [x for x in items[1:] if x < pivot]\n",
}


def test_an_fp8_pool_block_takes_half_the_bytes_of_bf16():
    cfg = SimpleNamespace(n_layers=32, kv_cache_heads=(8, 128, 128))     # Llama-3-8B's KV shape (heads, K, V)
    assert KVPool.bytes_per_block(cfg, 16, FP8) * 2 == KVPool.bytes_per_block(cfg, 16, torch.bfloat16) == 2 << 20
    pool = KVPool(cfg, 3, 16, FP8, "cpu")
    assert pool.k[0].dtype == FP8 and pool.nbytes == 3 * KVPool.bytes_per_block(cfg, 16, FP8)


@pytest.mark.parametrize("which", ["smollm2", "qwen2.5-coder"])
def test_fp8_cache_logits_stay_close_to_transformers(which):
    """Against transformers' float32 logits: with a float32 cache ours agree to ~1e-6 (test_reference.py); with
    fp8 every cached K/V value is rounded to 3 mantissa bits. Measured (2026-11-30): logits 3-5 % off in norm,
    0.002-0.008 nats of KL, the top token the same at 96-100 % of positions. Bounds at about twice that."""
    path = smollm2_path() if which == "smollm2" else qwen_coder_path()
    llm = load_llm(which)          # the CPU model other tests load too (float32; its own KV pools here)
    model, cfg = llm.model, llm.config
    ids = llm.tokenizer.encode(TEXTS[which], add_special=True)
    with torch.inference_mode():                 # transformers' float32 model, shared with test_reference.py's
        ref = load_transformers(path)[1](torch.tensor([ids])).logits[0].float()
    got = prompt_logits(model, cfg, ids, kv_dtype=FP8)
    rel = ((got - ref).norm() / ref.norm()).item()
    log_p, log_q = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert rel < 0.1 and kl < 0.02 and agree >= 0.9, (which, rel, kl, agree)
    # and the cache really is fp8: a float32 cache is far closer
    assert ((prompt_logits(model, cfg, ids) - ref).norm() / ref.norm()).item() < rel / 100


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
