"""Gemma 2 and Gemma 3 (text): tanh-GELU gating, scaled embeddings, post-sublayer norms, sliding-window local
layers; Gemma 2's soft-capped attention scores and logits; Gemma 3's local rope base and linear rope scaling
on the global layers.

Random models of their layouts, written by our GGUF writer, read by our code and by transformers (the
independent reference). transformers' GGUF mapping does not carry query_pre_attn_scalar, the soft caps or the
per-layer-type rope parameters, so those are passed as config overrides with the values the file holds (or
llama.cpp derives for it).
"""

import dataclasses
import os

import pytest
import torch

from cobatch.config import GEMMA3_LOCAL_ROPE_THETA, ModelConfig
from cobatch.engine.sampler import SamplingParams
from cobatch.testing.gguf_writer import write_random_model
from cobatch.llm import LLM, EngineOptions
from cobatch.model_files import smollm2_path
from cobatch.models.llama import LlamaModel
from model_checks import gpu_and_cpu_logits, open_gguf, prompt_logits, transformers_logits

REL_ERR_BOUND = 1e-4
IDS = [int(i) for i in torch.randint(0, 49000, (40,), generator=torch.Generator().manual_seed(0))]


@pytest.fixture(scope="module")
def gemma_files(tmp_path_factory):
    tokenizer = os.environ.get("COBATCH_CUT_MODEL") or smollm2_path()
    tmp = tmp_path_factory.mktemp("gemma")
    return {arch: write_random_model(tmp / f"{arch}.gguf", f"{arch}-tiny", "q8_0", tokenizer_from=tokenizer, seed=31)
            for arch in ("gemma2", "gemma3")}


@pytest.fixture(scope="module")
def gemma(gemma_files):
    return gemma_files["gemma3"]


def test_config(gemma):
    _, cfg = open_gguf(gemma)
    assert (cfg.arch, cfg.activation, cfg.post_norms, cfg.sliding_window) == ("gemma3", "gelu_tanh", True, 12)
    assert [cfg.layer_window(i) for i in range(6)] == [12, 12, 12, 12, 12, 0]
    assert cfg.embed_scale == pytest.approx(128 ** 0.5) and cfg.attn_scale == pytest.approx(64 ** -0.5)
    assert cfg.rope_scaling["type"] == "linear" and cfg.rope_scaling["factor"] == 8.0


def test_logits_match_transformers(gemma):
    pytest.importorskip("transformers")
    f, cfg = open_gguf(gemma)
    ours = LlamaModel(cfg, f, "cpu", torch.float32, max_positions=128)
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": cfg.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA}}
    ref = transformers_logits(gemma, IDS, query_pre_attn_scalar=cfg.head_dim, rope_parameters=rope)
    got = prompt_logits(ours, cfg, IDS)
    assert ((got - ref).norm() / ref.norm()).item() < REL_ERR_BOUND
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    # The 40-token prompt does exercise the window: without it the logits are far off.
    unwindowed = LlamaModel(dataclasses.replace(cfg, sliding_window=0), f, "cpu", torch.float32, max_positions=128)
    assert ((prompt_logits(unwindowed, cfg, IDS) - ref).norm() / ref.norm()).item() > 100 * REL_ERR_BOUND


def test_incomplete_files_are_user_errors(gemma_files):
    from cobatch.errors import UserError
    f, cfg = open_gguf(gemma_files["gemma3"])
    md = dict(f.metadata)
    del md["gemma3.attention.sliding_window"]
    with pytest.raises(UserError, match="lacks gemma3.attention.sliding_window"):
        ModelConfig.from_metadata(md, set(f.tensors))
    del f.tensors["blk.1.post_ffw_norm.weight"]
    with pytest.raises(UserError, match="no tensor blk.1.post_ffw_norm.weight, which a gemma3 model needs"):
        LlamaModel(cfg, f, "cpu", torch.float32, max_positions=64)


def test_gemma2_config_and_logits_match_transformers(gemma_files):
    path = gemma_files["gemma2"]
    f, cfg = open_gguf(path)
    assert [cfg.layer_window(i) for i in range(4)] == [12, 0, 12, 0]
    assert cfg.attn_softcap == pytest.approx(0.05) and cfg.final_softcap == pytest.approx(0.2)
    pytest.importorskip("transformers")
    ours = LlamaModel(cfg, f, "cpu", torch.float32, max_positions=128)
    # eager attention: some transformers versions drop the score cap in their SDPA path (seen on the H200's)
    ref = transformers_logits(path, IDS, query_pre_attn_scalar=cfg.head_dim, attn_implementation="eager",
                              attn_logit_softcapping=cfg.attn_softcap, final_logit_softcapping=cfg.final_softcap)
    got = prompt_logits(ours, cfg, IDS)
    assert ((got - ref).norm() / ref.norm()).item() < REL_ERR_BOUND
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    # Each Gemma 2 trait changes the logits well beyond the bound: the test would see one missing.
    for trait in ("attn_softcap", "final_softcap", "sliding_window"):
        without = LlamaModel(dataclasses.replace(cfg, **{trait: 0}), f, "cpu", torch.float32, max_positions=128)
        assert ((prompt_logits(without, cfg, IDS) - ref).norm() / ref.norm()).item() > 100 * REL_ERR_BOUND, trait


def test_batched_greedy_equals_each_alone(gemma):
    """Decode steps past the window (local layers drop old keys) batched with other sequences."""
    llm = LLM.load(gemma, EngineOptions(device="cpu", ctx=256, max_num_seqs=4, quiet=True))
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [llm.encode_prompt(p) for p in ("The capital of France is", "def f(x):", "1, 2, 3,")]
    alone = [llm.engine.generate([p], greedy)[0] for p in prompts]
    assert llm.engine.generate(prompts, greedy) == alone and all(len(t) == 16 for t in alone)
    # Decoding token by token gives what prefilling the whole text gives (the window applied the same way).
    f, cfg = open_gguf(gemma)
    ids = prompts[0] + alone[0][:-1]
    teacher = prompt_logits(llm.model, cfg, ids).argmax(-1)[len(prompts[0]) - 1:]
    assert teacher.tolist() == alone[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gpu_logits_close_to_cpu(gemma_files, arch):
    got, want = gpu_and_cpu_logits(gemma_files[arch], IDS)
    assert ((got - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")
def test_gpu_decode_graphs_match_prefill(gemma):
    """Decode through the CUDA graphs (windowed decode attention, 16 steps: past the 12-key window) against
    the prefill kernels on the same text: each decoded token is the prefill's argmax, or a near tie there."""
    gpu = LLM.load(gemma, EngineOptions(device="cuda", dtype="f16", ctx=256, max_num_seqs=4, quiet=True, kv_cache_gb=1))
    assert gpu.engine.runner.graphs is not None
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompt = gpu.encode_prompt("The capital of France is")
    tokens = gpu.engine.generate([prompt], greedy)[0]
    _, cfg = open_gguf(gemma)
    logits = prompt_logits(gpu.model, cfg, prompt + tokens[:-1])[len(prompt) - 1:]
    for step, (tok, row) in enumerate(zip(tokens, logits)):
        top2 = row.topk(2).values
        assert tok == row.argmax().item() or (top2[0] - row[tok]).item() < 0.05, step
