"""The granite architecture (IBM Granite 3.x): llama's layout with four multipliers, on the embeddings, q.k, each
sublayer's output before the residual add, and the logits (divided).

transformers reads no granite GGUF, so the reference is built from a llama twin: the same random tensors (our
writer seeds each by its name) in a file that says `llama` and carries no multipliers. transformers loads the twin
as LlamaForCausalLM (undoing llama.cpp's q/k row order itself), and its GraniteForCausalLM, given the twin's config
plus the granite file's multipliers, takes the twin's weights: the independent reference of the granite file.
"""

import os
from dataclasses import replace

import pytest
import torch

from cobatch.errors import UserError
from cobatch.model_files import smollm2_path
from cobatch.models.llama import LlamaModel
from cobatch.testing import gguf_writer
from cobatch.testing.gguf_writer import SHAPES, write_random_model
from model_checks import open_gguf, prompt_logits

REL_ERR_BOUND = 1e-4
IDS = [int(i) for i in torch.randint(0, 49000, (40,), generator=torch.Generator().manual_seed(3))]
SHAPE = SHAPES["granite-tiny"]


def as_stored(value: float) -> float:
    """A multiplier as GGUF stores it: float32."""
    return torch.tensor(value, dtype=torch.float32).item()


def write_with_llama_twin(folder, shape: str, seed: int, **twin_changes) -> dict:
    """The random file of a granite shape and its llama twin: the same tensors by name (our writer seeds each by
    its name), no multipliers, and twin_changes (the MoE's twin drops its experts)."""
    tokenizer = os.environ.get("COBATCH_CUT_MODEL") or smollm2_path()
    twin = replace(SHAPES[shape], arch="llama", embedding_scale=0.0, attention_scale=0.0, residual_scale=0.0,
                   logit_scale=0.0, **twin_changes)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(gguf_writer.SHAPES, f"{shape}-llama-twin", twin)
        return {name: write_random_model(folder / f"{name}.gguf", name_shape, "q8_0", tokenizer_from=tokenizer,
                                         seed=seed)
                for name, name_shape in (("granite", shape), ("llama", f"{shape}-llama-twin"))}


def hf_multipliers(shape) -> dict:
    """A shape's multipliers as transformers' Granite configs name them, as the GGUF stores them (float32)."""
    return dict(embedding_multiplier=as_stored(shape.embedding_scale),
                attention_multiplier=as_stored(shape.attention_scale),
                residual_multiplier=as_stored(shape.residual_scale), logits_scaling=as_stored(shape.logit_scale))


@pytest.fixture(scope="module")
def granite_files(tmp_path_factory):
    return write_with_llama_twin(tmp_path_factory.mktemp("granite"), "granite-tiny", seed=31)


def test_config_reads_the_multipliers(granite_files):
    _, cfg = open_gguf(granite_files["granite"])
    assert (cfg.arch, cfg.rope_neox) == ("granite", False)
    assert (cfg.embed_scale, cfg.attn_scale, cfg.residual_scale, cfg.logit_scale) == (12.0, 0.0078125,
                                                                                       as_stored(0.22), 16.0)
    assert not cfg.embed_scale_in_dtype
    _, twin = open_gguf(granite_files["llama"])
    assert (twin.embed_scale, twin.attn_scale, twin.residual_scale, twin.logit_scale) == (1.0, 0.0, 1.0, 1.0)


@pytest.mark.parametrize("key, field, default", [("residual_scale", "residual_scale", 1.0),
                                                  ("logit_scale", "logit_scale", 1.0),
                                                  ("embedding_scale", "embed_scale", 1.0),
                                                  ("attention.scale", "attn_scale", 0.0)])
def test_a_multiplier_left_out_or_0_is_the_default_and_a_negative_one_is_refused(granite_files, key, field, default):
    """As llama.cpp reads them; attn_scale 0 means head_dim ** -0.5."""
    from cobatch.config import ModelConfig
    f, _ = open_gguf(granite_files["granite"])
    left_out = {k: v for k, v in f.metadata.items() if k != f"granite.{key}"}
    for md in (left_out, {**f.metadata, f"granite.{key}": 0.0}):
        assert getattr(ModelConfig.from_metadata(md, set(f.tensors)), field) == default
    with pytest.raises(UserError, match=key):
        ModelConfig.from_metadata({**f.metadata, f"granite.{key}": -2.0}, set(f.tensors))


def test_granite_matches_transformers(granite_files):
    transformers = pytest.importorskip("transformers")
    path = granite_files["llama"]
    llama = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    config = {k: v for k, v in llama.config.to_dict().items() if k not in ("model_type", "architectures")}
    granite = transformers.GraniteForCausalLM(transformers.GraniteConfig(**config, **hf_multipliers(SHAPE)))
    granite = granite.float().eval()
    granite.load_state_dict(llama.state_dict(), strict=True)
    with torch.inference_mode():
        ref = granite(torch.tensor([IDS])).logits[0].float()
        plain = llama(torch.tensor([IDS])).logits[0].float()
    f, cfg = open_gguf(granite_files["granite"])
    got = prompt_logits(LlamaModel(cfg, f, "cpu", torch.float32, max_positions=128), cfg, IDS)
    assert ((got - ref).norm() / ref.norm()).item() < REL_ERR_BOUND
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert ((plain - ref).norm() / ref.norm()).item() > 0.1       # the multipliers change the logits: they count


def gguf_tensor(path, name: str) -> torch.Tensor:
    """One tensor of a GGUF file as float32, dequantized by gguf-py (not by cobatch's loader)."""
    import gguf
    reader = gguf.GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == name)
    return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()


def test_granitemoe_matches_transformers(tmp_path):
    """granitemoe: granite's multipliers over routed experts (softmax over the top-k logits). The reference's
    attention, norms and embeddings come from a dense llama twin through transformers' GGUF loader, its experts
    and router from the granitemoe file through gguf-py."""
    transformers = pytest.importorskip("transformers")
    moe_shape = SHAPES["granitemoe-tiny"]
    files = write_with_llama_twin(tmp_path, "granitemoe-tiny", seed=32, n_experts=0, n_experts_used=0,
                                  expert_ffn_dim=0)
    path, twin_path = files["granite"], files["llama"]
    llama = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=twin_path.name,
                                                              dtype=torch.float32)
    config = {k: v for k, v in llama.config.to_dict().items()
              if k not in ("model_type", "architectures", "intermediate_size")}
    hf = transformers.GraniteMoeForCausalLM(transformers.GraniteMoeConfig(
        **config, intermediate_size=moe_shape.expert_ffn_dim, num_local_experts=moe_shape.n_experts,
        num_experts_per_tok=moe_shape.n_experts_used, **hf_multipliers(moe_shape))).float().eval()
    state = {k: v for k, v in llama.state_dict().items() if ".mlp." not in k}
    for i in range(moe_shape.n_layers):
        moe = f"model.layers.{i}.block_sparse_moe"
        state[f"{moe}.router.weight"] = gguf_tensor(path, f"blk.{i}.ffn_gate_inp.weight")
        state[f"{moe}.experts.gate_up_proj"] = torch.cat([gguf_tensor(path, f"blk.{i}.ffn_gate_exps.weight"),
                                                          gguf_tensor(path, f"blk.{i}.ffn_up_exps.weight")], dim=1)
        state[f"{moe}.experts.down_proj"] = gguf_tensor(path, f"blk.{i}.ffn_down_exps.weight")
    hf.load_state_dict(state, strict=True)
    with torch.inference_mode():
        ref = hf(torch.tensor([IDS])).logits[0].float()
    f, cfg = open_gguf(path)
    assert (cfg.arch, cfg.n_experts, cfg.n_experts_used, cfg.expert_weights_norm) == ("granitemoe", 8, 2, True)
    got = prompt_logits(LlamaModel(cfg, f, "cpu", torch.float32, max_positions=128), cfg, IDS)
    assert ((got - ref).norm() / ref.norm()).item() < REL_ERR_BOUND
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")
def test_gpu_logits_close_to_cpu(granite_files):
    """The multipliers on the GPU path (f16 activations, the quantized kernels) as on the CPU's."""
    from model_checks import gpu_and_cpu_logits
    got, want = gpu_and_cpu_logits(granite_files["granite"], IDS)
    assert ((got - want).norm() / want.norm()).item() < 1e-2
