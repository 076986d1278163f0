"""Our CPU forward against an independent implementation: Hugging Face transformers loading the same GGUF.

Both dequantize the same blocks to float32, so logits should agree to float32 rounding (we see ~1e-6).
"""

import gc
import json

import pytest
import torch

from cobatch.config import ModelConfig
from cobatch.loader.gguf import GGUFFile
from cobatch.model_files import qwen_coder_path, smollm2_path
from cobatch.models.llama import LlamaModel
from model_checks import prompt_logits, transformers_logits
from model_fixtures import load_transformers

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "def square(x):\n    return",
    "Ünïcödé, emoji 🙂 and numbers 12345 — all in one line.",
]
REL_ERR_BOUND = 1e-4


@pytest.mark.parametrize("which", ["smollm2", "qwen2.5-coder"])
def test_logits_match_transformers(which):
    path = smollm2_path() if which == "smollm2" else qwen_coder_path()
    f = GGUFFile(path)
    cfg = ModelConfig.from_metadata(f.metadata, set(f.tensors))
    ours = LlamaModel(cfg, f, "cpu", torch.float32, max_positions=256)
    tok, hf = load_transformers(path)
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        got = prompt_logits(ours, cfg, ids)
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0].float()
        rel = ((got - ref).norm() / ref.norm()).item()
        assert rel < REL_ERR_BOUND, (prompt, rel)
        assert torch.equal(got.argmax(-1), ref.argmax(-1)), prompt
    del ours
    gc.collect()


FP8_TEXTS = {
    "smollm2": "The history of the Roman Empire spans many centuries. It began when Augustus became the first emperor "
               "in 27 BC and, in the West, ended in 476 AD. During this time, the empire grew to include",
    "qwen2.5-coder": "def quicksort(items):\n    if len(items) <= 1:\n        return items\n    pivot = items[0]\n"
                     "    left = [x for x in items[1:] if x < pivot]\n",
}


@pytest.mark.parametrize("which", ["smollm2", "qwen2.5-coder"])
def test_fp8_cache_logits_stay_close_to_transformers(which):
    """--kv-cache-dtype fp8 rounds every cached K/V value to 3 mantissa bits. Against transformers' float32 logits
    (with a float32 cache ours agree to ~1e-6, above), measured (2026-11-30): logits 3-5 % off in norm, 0.002-0.008
    nats of KL, the top token the same at 96-100 % of positions. Bounds at about twice that."""
    path = smollm2_path() if which == "smollm2" else qwen_coder_path()
    f = GGUFFile(path)
    cfg = ModelConfig.from_metadata(f.metadata, set(f.tensors))
    ours = LlamaModel(cfg, f, "cpu", torch.float32, max_positions=256)
    tok, hf = load_transformers(path)
    ids = tok(FP8_TEXTS[which])["input_ids"]
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    got = prompt_logits(ours, cfg, ids, kv_dtype=torch.float8_e4m3fn)
    rel = ((got - ref).norm() / ref.norm()).item()
    log_p, log_q = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert rel < 0.1 and kl < 0.02 and agree >= 0.9, (which, rel, kl, agree)
    # and the cache really is fp8: a float32 cache is far closer
    assert ((prompt_logits(ours, cfg, ids) - ref).norm() / ref.norm()).item() < rel / 100
    del ours
    gc.collect()


@pytest.mark.parametrize("quant", ["q8_0", "q4_k"])
def test_qwen3_qk_norm_matches_transformers(tmp_path, quant):
    """No small real qwen3 GGUF ships on PyPI: a random one of qwen3's layout (per-head q/k RMSNorm,
    head_dim 128 != d_model / n_heads), written by our GGUF writer, read by both implementations. Its vocabulary
    is SmolLM2's (49k tokens): the layout is the point, and Qwen's 152k made transformers' read of the file most
    of the test's time."""
    from cobatch.testing.gguf_writer import write_random_model
    path = write_random_model(tmp_path / f"qwen3-{quant}.gguf", "qwen3-tiny", quant,
                              tokenizer_from=smollm2_path(), seed=5)
    f = GGUFFile(path)
    cfg = ModelConfig.from_metadata(f.metadata, set(f.tensors))
    assert cfg.arch == "qwen3" and cfg.qk_norm and cfg.head_dim == 128 and cfg.rope_neox
    ours = LlamaModel(cfg, f, "cpu", torch.float32, max_positions=128)
    ids = [int(i) for i in torch.randint(0, 49000, (40,), generator=torch.Generator().manual_seed(0))]
    ref = transformers_logits(path, ids)
    got = prompt_logits(ours, cfg, ids)
    assert ((got - ref).norm() / ref.norm()).item() < REL_ERR_BOUND
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_prompt_logprobs_match_transformers():
    """The engine's prompt logprobs (prefill in 16-token chunks) against transformers' log-softmax of the same
    prompt's logits: each token's logprob given the ones before it, and the top-3 alternatives."""
    from cobatch.engine.sampler import SamplingParams
    from model_fixtures import load_llm
    path = smollm2_path()
    llm = load_llm("smollm2", prefill_chunk=16)
    tok, hf = load_transformers(path)
    ids = tok(PROMPTS[0] + " Berlin. The capital of Italy is Rome, and the capital of Spain is Madrid.")["input_ids"]
    assert len(ids) > 16                                    # two chunks at least
    llm.engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3))
    got = []
    while llm.engine.has_work():
        for out in llm.engine.step():
            got += out.prompt_logprobs or []
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert [t for t, _, _, _ in got] == ids[1:]
    for p, (token, logprob, top, rank) in enumerate(got):
        assert abs(logprob - ref[p, token].item()) < 1e-3, p
        assert rank == 1 + (ref[p] > ref[p, token]).sum().item(), p
        top_lp, top_ids = ref[p].topk(3)
        assert [t for t, _ in top] == top_ids.tolist(), p
        assert max(abs(a - b) for (_, a), b in zip(top, top_lp.tolist())) < 1e-3


def test_embeddings_match_transformers_last_hidden_state():
    """/v1/embeddings' vector (the engine's final-normed hidden state of the last prompt token) against
    transformers' last hidden state of the same prompt, for prompts prefilled alone and in one batch."""
    from cobatch.engine.sampler import SamplingParams
    from model_fixtures import load_llm
    path = smollm2_path()
    llm = load_llm("smollm2", prefill_chunk=16)
    tok, hf = load_transformers(path)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    got = {}
    for ids in prompts:
        llm.engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1, embed=True), request_id=str(ids))
    while llm.engine.has_work():
        for out in llm.engine.step():
            if out.embedding is not None:
                got[out.request_id] = torch.tensor(out.embedding)
    assert len(got) == len(prompts)
    for ids in prompts:
        with torch.inference_mode():
            ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1].float()
        rel = ((got[str(ids)] - ref).norm() / ref.norm()).item()
        assert rel < REL_ERR_BOUND, (ids, rel)


def test_yarn_rope_scaling_matches_transformers(tmp_path):
    """YaRN (Qwen3 / Qwen2.5 GGUFs past their 32k): a random qwen3 with rope.scaling yarn, factor 4 over a
    1024-token original context. transformers' GGUF mapping carries no rope scaling: it is passed as an
    override with the file's values, and without it the logits are far off (the scaling does act)."""
    from cobatch.testing.gguf_writer import YARN_ORIGINAL_CONTEXT, write_random_model
    path = write_random_model(tmp_path / "qwen3-yarn.gguf", "qwen3-yarn-tiny", "q8_0",
                              tokenizer_from=smollm2_path(), seed=6)
    f = GGUFFile(path)
    cfg = ModelConfig.from_metadata(f.metadata, set(f.tensors))
    assert cfg.rope_scaling["type"] == "yarn" and cfg.rope_scaling["original_context"] == YARN_ORIGINAL_CONTEXT
    ours = LlamaModel(cfg, f, "cpu", torch.float32, max_positions=4096)
    ids = [int(i) for i in torch.randint(0, 49000, (40,), generator=torch.Generator().manual_seed(0))]
    got = prompt_logits(ours, cfg, ids)
    rope = {"rope_type": "yarn", "factor": cfg.rope_scaling["factor"], "rope_theta": cfg.rope_theta,
            "original_max_position_embeddings": YARN_ORIGINAL_CONTEXT}
    refs = {True: transformers_logits(path, ids, rope_scaling=rope), False: transformers_logits(path, ids)}
    assert ((got - refs[True]).norm() / refs[True].norm()).item() < REL_ERR_BOUND
    assert torch.equal(got.argmax(-1), refs[True].argmax(-1))
    assert ((got - refs[False]).norm() / refs[False].norm()).item() > 100 * REL_ERR_BOUND


def test_unknown_rope_scaling_is_a_user_error():
    from cobatch.errors import UserError
    md = {"general.architecture": "qwen3", "qwen3.embedding_length": 256, "qwen3.attention.head_count": 4,
          "qwen3.block_count": 2, "qwen3.feed_forward_length": 512, "qwen3.rope.scaling.type": "dynamic",
          "qwen3.rope.scaling.factor": 2.0}
    with pytest.raises(UserError, match="unsupported rope scaling type 'dynamic' .*yarn"):
        ModelConfig.from_metadata(md, set())


def test_smollm2_gguf_and_its_safetensors_give_the_same_logits(tmp_path):
    from safetensors.torch import save_file

    from cobatch.llm import LLM, EngineOptions
    from model_fixtures import load_llm
    tokenizer, model = load_transformers(smollm2_path())      # the GGUF dequantized by transformers (gguf-py)
    # saved by hand: save_pretrained refuses a model read from a GGUF; the tied head is the embedding
    save_file({n: t.contiguous() for n, t in model.state_dict().items() if n != "lm_head.weight"},
              tmp_path / "model.safetensors")
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (tmp_path / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(tmp_path)
    gguf = load_llm("smollm2")
    hf = LLM.load(tmp_path, EngineOptions(device="cpu", ctx=256, max_num_seqs=1, quantization="none", quiet=True))
    text = "The capital of France is Paris. 12345 + 678 = ?"
    ids = gguf.encode_prompt(text)
    assert hf.encode_prompt(text) == ids
    messages = [{"role": "user", "content": "Hi!"}]
    assert hf.encode_chat(messages) == gguf.encode_chat(messages)
    # llama's q/k: the GGUF stores them permuted for adjacent-pair rope, the checkpoint as trained (rotate_half)
    ours = prompt_logits(hf.model, hf.config, ids)
    ref = prompt_logits(gguf.model, gguf.config, ids)
    assert (ours - ref).abs().max() < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
