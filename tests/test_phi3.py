"""The phi3 architecture (Phi-3, Phi-3.5, Phi-4): fused q|k|v and gate|up tensors, partial rotary, LongRoPE.

Random models of its layouts, written by our GGUF writer, read by our code and by Hugging Face transformers
(the independent reference). transformers' GGUF config mapping for phi3 carries no rope scaling, so the
LongRoPE parameters are handed to it as a config override with the values the file holds.
"""

import os

import pytest
import torch

from cobatch.testing.gguf_writer import LONGROPE_ORIGINAL_CONTEXT, longrope_attn_factor, write_random_model
from cobatch.model_files import smollm2_path
from cobatch.models.llama import LlamaModel
from model_checks import gpu_and_cpu_logits, open_gguf, prompt_logits, transformers_logits

REL_ERR_BOUND = 1e-4
IDS = [int(i) for i in torch.randint(0, 49000, (40,), generator=torch.Generator().manual_seed(0))]


@pytest.fixture(scope="module")
def phi_models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("phi")
    tokenizer = os.environ.get("COBATCH_CUT_MODEL") or smollm2_path()
    return {"phi3": write_random_model(tmp / "phi3.gguf", "phi3-tiny", "q8_0", tokenizer_from=tokenizer, seed=21),
            "phi4-mini": write_random_model(tmp / "phi4-mini.gguf", "phi4-mini-tiny", "q4_k", tokenizer_from=tokenizer,
                                            seed=22)}


def test_config(phi_models):
    _, phi3 = open_gguf(phi_models["phi3"])
    assert (phi3.arch, phi3.rope_neox, phi3.rope_dim, phi3.rope_attn_factor) == ("phi3", True, 64, 1.0)
    _, phi4 = open_gguf(phi_models["phi4-mini"])
    assert (phi4.rope_dim, phi4.head_dim, phi4.rope_original_context) == (48, 64, LONGROPE_ORIGINAL_CONTEXT)
    assert phi4.rope_attn_factor == pytest.approx(longrope_attn_factor(16384), rel=1e-6) and phi4.rope_attn_factor > 1


def test_phi3_matches_transformers(phi_models):
    pytest.importorskip("transformers")
    path = phi_models["phi3"]
    f, cfg = open_gguf(path)
    ours = LlamaModel(cfg, f, "cpu", torch.float32, max_positions=128)
    ref = transformers_logits(path, IDS)
    got = prompt_logits(ours, cfg, IDS)
    assert ((got - ref).norm() / ref.norm()).item() < REL_ERR_BOUND
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("context", [LONGROPE_ORIGINAL_CONTEXT, 4 * LONGROPE_ORIGINAL_CONTEXT])
def test_longrope_matches_transformers(phi_models, context):
    """At the original context the short factors rotate, past it the long ones (chosen by the context the
    model runs with, as llama.cpp does). transformers picks by the current sequence length instead, so for
    the long case it is given the long factors as its short ones: both then rotate by the long factors."""
    pytest.importorskip("transformers")
    path = phi_models["phi4-mini"]
    f, cfg = open_gguf(path)
    ours = LlamaModel(cfg, f, "cpu", torch.float32, max_positions=context)
    long = f.float_tensor("rope_factors_long.weight").tolist()
    short = f.float_tensor("rope_factors_short.weight").tolist()
    rope = {"rope_type": "longrope", "short_factor": long if context > cfg.rope_original_context else short,
            "long_factor": long, "attention_factor": cfg.rope_attn_factor, "rope_theta": cfg.rope_theta,
            "original_max_position_embeddings": cfg.rope_original_context,
            "partial_rotary_factor": cfg.rope_dim / cfg.head_dim}
    ref = transformers_logits(path, IDS, rope_scaling=rope, original_max_position_embeddings=cfg.rope_original_context)
    got = prompt_logits(ours, cfg, IDS)
    assert ((got - ref).norm() / ref.norm()).item() < REL_ERR_BOUND
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")
@pytest.mark.parametrize("name", ["phi3", "phi4-mini"])
def test_gpu_logits_close_to_cpu(phi_models, name):
    got, want = gpu_and_cpu_logits(phi_models[name], IDS)
    assert ((got - want).norm() / want.norm()).item() < 1e-2
