"""DeepSeek (deepseek2: MLA, shared plus routed experts, V2 and V3 routing) against Hugging Face transformers.

Random tiny models from our GGUF writer, in llama.cpp's tensor layout: deepseek2-tiny (V2-Lite's: q straight
from h, softmax routing, weights scaled but not renormalized, the older attn_kv_b tensors) and deepseek-v3-tiny
(q LoRA, sigmoid routing with the correction bias, 4 groups of which 2 are used, weights renormalized, YaRN, the
split attn_k_b / attn_v_b tensors); both have 2 shared experts or 1 and a dense first layer. transformers has no
GGUF loader for deepseek2, so its DeepseekV2 / DeepseekV3 model is built from a config mapped here from the GGUF
metadata, and given the tensors as gguf-py dequantizes them, renamed to transformers' names.
"""

import dataclasses
import os

import numpy as np
import pytest
import torch

from cobatch.config import ModelConfig
from cobatch.engine.kv_cache import KVPool
from cobatch.engine.sampler import SamplingParams
from cobatch.kernels.moe_routing import RouterRule, route_ref
from cobatch.llm import LLM, EngineOptions
from cobatch.loader.gguf import GGUFFile
from cobatch.model_files import smollm2_path
from cobatch.testing.gguf_writer import write_random_model
from cobatch.batch import AttentionMetadata
from conftest import requires_cuda
from model_checks import assert_prefill_graphs_close_to_eager, load_model, open_gguf

# float32 both sides; what is left is the order of sums (absorbed attention against decompressed K/V) and q8_0 /
# q5_0 weights dequantized by two implementations
REL_ERR_BOUND = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deepseek")
    tokenizer = os.environ.get("COBATCH_CUT_MODEL") or smollm2_path()
    return {"v2": write_random_model(tmp / "v2.gguf", "deepseek2-tiny", "q4_k", tokenizer_from=tokenizer, seed=5),
            "v3": write_random_model(tmp / "v3.gguf", "deepseek-v3-tiny", "q8_0", tokenizer_from=tokenizer, seed=6)}


def _hf_config(md: dict, v3: bool):
    """transformers' config of a deepseek2 GGUF, from its metadata keys."""
    import transformers
    a = "deepseek2."
    rope = md[a + "rope.dimension_count"]
    qk_head = md.get(a + "attention.key_length_mla", md[a + "attention.key_length"])
    v_head = md.get(a + "attention.value_length_mla", md[a + "attention.value_length"])
    groups = md.get(a + "expert_group_count", 1)
    rope_parameters = {"rope_type": "default", "rope_theta": md[a + "rope.freq_base"]}
    context = md[a + "context_length"]
    if md.get(a + "rope.scaling.type") == "yarn":
        context = int(md[a + "rope.scaling.factor"] * md[a + "rope.scaling.original_context_length"])
        mscale = md[a + "rope.scaling.yarn_log_multiplier"] / 0.1       # llama.cpp writes 0.1 * mscale_all_dim
        rope_parameters.update(rope_type="yarn", factor=md[a + "rope.scaling.factor"], mscale=mscale,
                               mscale_all_dim=mscale, beta_fast=32.0, beta_slow=1.0,
                               original_max_position_embeddings=md[a + "rope.scaling.original_context_length"])
    common = dict(
        vocab_size=len(md["tokenizer.ggml.tokens"]), hidden_size=md[a + "embedding_length"],
        intermediate_size=md[a + "feed_forward_length"], moe_intermediate_size=md[a + "expert_feed_forward_length"],
        num_hidden_layers=md[a + "block_count"], num_attention_heads=md[a + "attention.head_count"],
        num_key_value_heads=md[a + "attention.head_count"], n_shared_experts=md[a + "expert_shared_count"],
        n_routed_experts=md[a + "expert_count"], num_experts_per_tok=md[a + "expert_used_count"],
        routed_scaling_factor=md[a + "expert_weights_scale"], kv_lora_rank=md[a + "attention.kv_lora_rank"],
        q_lora_rank=md.get(a + "attention.q_lora_rank"), qk_rope_head_dim=rope, qk_nope_head_dim=qk_head - rope,
        v_head_dim=v_head, n_group=groups, topk_group=md.get(a + "expert_group_used_count", 1),
        first_k_dense_replace=md[a + "leading_dense_block_count"], norm_topk_prob=md[a + "expert_weights_norm"],
        rms_norm_eps=md[a + "attention.layer_norm_rms_epsilon"], max_position_embeddings=context,
        rope_parameters=rope_parameters, tie_word_embeddings=False, attn_implementation="eager")
    if v3:
        return transformers.DeepseekV3Config(**common)
    return transformers.DeepseekV2Config(topk_method="group_limited_greedy" if groups > 1 else "greedy", **common)


_RENAME = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
           "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
           "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
           "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
           "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
           "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj"}


def _hf_state_dict(path, cfg) -> dict[str, torch.Tensor]:
    """The GGUF's tensors dequantized by gguf-py, under transformers' names: the experts' gate and up stacked as
    its gate_up_proj, and llama.cpp's split attn_k_b ([H, rank, nope]) / attn_v_b ([H, v, rank]) joined back into
    kv_b_proj ([H (nope + v), rank])."""
    import gguf
    raw = {}
    for t in GGUFFile(path).tensors.values():    # (gguf-py's reader would parse the vocabulary for seconds)
        values = gguf.quants.dequantize(np.asarray(t.data).reshape(-1, t.n_bytes // (t.n_elements // t.shape[0])),
                                        t.tensor_type)
        raw[t.name] = torch.from_numpy(np.array(values, dtype=np.float32).reshape(tuple(reversed(t.shape))))
    out = {"model.embed_tokens.weight": raw.pop("token_embd.weight"),
           "model.norm.weight": raw.pop("output_norm.weight"), "lm_head.weight": raw.pop("output.weight")}
    for i in range(cfg.n_layers):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        if p + "ffn_gate_exps.weight" in raw:
            out[q + "mlp.experts.gate_up_proj"] = torch.cat([raw.pop(p + "ffn_gate_exps.weight"),
                                                             raw.pop(p + "ffn_up_exps.weight")], dim=1)
            out[q + "mlp.experts.down_proj"] = raw.pop(p + "ffn_down_exps.weight")
        if p + "attn_k_b.weight" in raw:
            k_b, v_b = raw.pop(p + "attn_k_b.weight"), raw.pop(p + "attn_v_b.weight")
            out[q + "self_attn.kv_b_proj.weight"] = torch.cat([k_b.transpose(1, 2), v_b], dim=1).flatten(0, 1)
    for name, tensor in raw.items():
        _, layer, kind, suffix = name.split(".")
        hf_name = "mlp.gate.e_score_correction_bias" if kind == "exp_probs_b" else f"{_RENAME[kind]}.{suffix}"
        out[f"model.layers.{layer}.{hf_name}"] = tensor
    return out


@pytest.fixture(scope="module")
def transformers_models(models):
    transformers = pytest.importorskip("transformers")
    out = {}
    for name, path in models.items():
        f = GGUFFile(path)
        cfg = ModelConfig.from_metadata(f.metadata, set(f.tensors))
        hf_cfg = _hf_config(f.metadata, v3=name == "v3")
        model_cls = transformers.DeepseekV3ForCausalLM if name == "v3" else transformers.DeepseekV2ForCausalLM
        hf = model_cls(hf_cfg)
        hf.load_state_dict(_hf_state_dict(path, cfg), strict=True)
        out[name] = hf.eval()
    return out


def test_config_reads_the_deepseek_layout(models):
    v2, v3 = (ModelConfig.from_metadata(GGUFFile(p).metadata, set(GGUFFile(p).tensors)) for p in models.values())
    assert (v2.mla.q_lora_rank, v2.mla.kv_lora_rank, v2.mla.qk_nope_dim, v2.mla.qk_rope_dim, v2.mla.v_head_dim) \
        == (0, 64, 32, 16, 32)          # from key_length / value_length (the attn_kv_b files' keys)
    assert v3.mla.q_lora_rank == 64 and v3.mla.qk_head_dim == 48 and v3.mla.v_head_dim == 32   # from the _mla keys
    assert (v2.expert_gating, v2.expert_weights_norm, v2.expert_weights_scale, v2.expert_groups) == ("softmax", False,
                                                                                                     1.5, 0)
    assert (v3.expert_gating, v3.expert_weights_norm, v3.expert_weights_scale) == ("sigmoid", True, 2.5)
    assert (v3.expert_groups, v3.expert_groups_used, v3.leading_dense_layers) == (4, 2, 1)
    assert v2.shared_expert_ffn_dim == 2 * 128 and v3.shared_expert_ffn_dim == 128
    assert not v3.moe_layer(0) and v3.moe_layer(1) and not v3.rope_neox
    # The cache: one "head" of latent | rope key a layer and no V, 4x fewer values than 4 heads of K (48) and V (32)
    assert v3.kv_cache_heads == (1, 80, 0) and v3.gqa_equivalent_kv_heads == (4, 48, 32)
    assert KVPool.bytes_per_token(v3, torch.bfloat16) == 3 * 80 * 2
    pool = KVPool(v3, 2, 16, torch.float32, "cpu")
    assert pool.v == [] and pool.k[0].shape == (2, 16, 1, 80) and pool.nbytes == 2 * KVPool.bytes_per_block(v3, 16,
                                                                                                          torch.float32)


def _prefill_then_decode(model, cfg, ids: list[int], n_prefill: int) -> torch.Tensor:
    """float32 logits of every position (on the CPU): ids[:n_prefill] in one step, then each next token as a
    decode step, on the model's device and in its dtype."""
    bs, dev = 16, model.device
    blocks = -(-len(ids) // bs)
    pool = KVPool(cfg, blocks, bs, model.dtype, dev)
    table = torch.arange(blocks, dtype=torch.int32, device=dev)[None]
    out = []
    with torch.inference_mode():
        for start, end in [(0, n_prefill)] + [(p, p + 1) for p in range(n_prefill, len(ids))]:
            meta = AttentionMetadata(slot_mapping=torch.arange(start, end, device=dev),
                                     query_start=torch.tensor([0, end - start], dtype=torch.int32, device=dev),
                                     seq_lens=torch.tensor([end], dtype=torch.int32, device=dev), block_tables=table,
                                     max_query_len=end - start, max_seq_len=end)
            hidden = model.forward(torch.tensor(ids[start:end], device=dev), torch.arange(start, end, device=dev),
                                   meta, pool.k, pool.v)
            out.append(model.logits(hidden).float().cpu())
    return torch.cat(out)


def test_config_refuses_groups_that_cannot_route(models):
    """A grouping the router cannot run is the file's error, said in one line: groups that do not divide the
    experts, and more experts a token than its groups hold."""
    from cobatch.errors import UserError
    gguf = GGUFFile(models["v3"])
    md, names = dict(gguf.metadata), set(gguf.tensors)
    a = md["general.architecture"] + "."
    assert ModelConfig.from_metadata(md, names).expert_groups == 4
    for bad, said in (({a + "expert_group_count": 3}, "is not a grouping"),
                      ({a + "expert_group_used_count": 1, a + "expert_used_count": md[a + "expert_count"] // 4 + 1},
                       "the groups hold fewer")):
        with pytest.raises(UserError, match=said):
            ModelConfig.from_metadata({**md, **bad}, names)


@pytest.mark.parametrize("name", ["v2", "v3"])
def test_logits_match_transformers(models, transformers_models, name):
    """Prefill of 40 tokens (every position) and then 3 decode steps on the same cache, against transformers on
    the whole sequence: top-1 identical at every position, relative error below REL_ERR_BOUND."""
    _, cfg, ours = load_model(models[name], max_positions=64)
    ids = [int(i) for i in torch.randint(0, 49000, (43,), generator=torch.Generator().manual_seed(2))]
    with torch.inference_mode():
        ref = transformers_models[name](torch.tensor([ids])).logits[0].float()
    got = _prefill_then_decode(ours, cfg, ids, 40)
    assert ((got - ref).norm() / ref.norm()).item() < REL_ERR_BOUND
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_routing_choices_depend_on_groups_and_bias(models):
    """The V3 file's group limit and correction bias change which experts some rows get (so the comparison with
    transformers covers them), and the weights are renormalized then scaled."""
    _, cfg, model = load_model(models["v3"], max_positions=64)
    moe = model.layers[1].moe
    h = torch.randn(64, cfg.d_model, generator=torch.Generator().manual_seed(3))
    weights, ids = moe.route(h)
    assert torch.allclose(weights.sum(-1), torch.full((64,), 2.5))
    assert moe.rule == RouterRule(cfg.n_experts_used, True, "sigmoid", 4, 2, 2.5, 1e-20)
    _, ungrouped = route_ref(h, moe.router, dataclasses.replace(moe.rule, groups=0, groups_used=0), moe.bias)
    _, unbiased = route_ref(h, moe.router, moe.rule)
    differs = [(a.sort().values != b.sort().values).any(-1).sum().item()
               for a, b in ((ids, ungrouped), (ids, unbiased))]
    assert all(d > 0 for d in differs), differs
    groups = ids // 4      # every row's experts lie in at most 2 of the 4 groups
    assert all(len(set(row)) <= 2 for row in groups.tolist())


def test_batched_greedy_equals_each_alone(models):
    llm = LLM.load(models["v3"], EngineOptions(device="cpu", ctx=128, max_num_seqs=4, quiet=True))
    assert llm.engine.pool.v == [] and llm.engine.pool.k[0].shape[2:] == (1, 80)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [llm.encode_prompt(p) for p in ("The capital of France is", "def f(x):", "1, 2, 3,", "Hello")]
    alone = [llm.engine.generate([p], greedy)[0] for p in prompts]
    assert llm.engine.generate(prompts, greedy) == alone and all(len(t) == 8 for t in alone)


@requires_cuda
@pytest.mark.parametrize("value_kernel", [False, True], ids=["bmm", "value_kernel"])
@pytest.mark.parametrize("name", ["v2", "v3"])
def test_gpu_path_matches_the_cpu_path(models, name, value_kernel, monkeypatch):
    """On CUDA in f16 (the latent write kernel, the MLA decode kernel for the decode steps, the quantized GEMV)
    against the CPU path in float32 on the same file: a typical position's relative error within f16's, and the
    same top-1 at 95 % of the positions or more. f16 may flip a near tie of a random model, of the sigmoid
    router's choice too: the V3 file has a position whose error is 0.11 on the CPU path in f16 as well, where the
    median is 1e-3 (measured). value_kernel: W_UV by kernels/mla_value.py at the decode steps (its switch on)."""
    from cobatch.kernels import mla_value
    monkeypatch.setattr(mla_value, "ENABLED", value_kernel)
    ids = [int(i) for i in torch.randint(0, 49000, (43,), generator=torch.Generator().manual_seed(2))]
    _, cfg, cpu = load_model(models[name], max_positions=64)
    _, _, gpu = load_model(models[name], "cuda", torch.float16, max_positions=64)
    want, got = _prefill_then_decode(cpu, cfg, ids, 40), _prefill_then_decode(gpu, cfg, ids, 40)
    per_position = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert per_position.median().item() < 5e-3 and per_position.max().item() < 0.2, per_position
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.95


@requires_cuda
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("name", ["v2", "v3"])
def test_a_captured_decode_step_computes_what_the_eager_one_does(models, name, kv_cache_dtype):
    """DeepSeek's decode step captured in a CUDA graph (the router's torch code, the experts routed on the device,
    the MLA decode kernel, the latent write) gives the eager step's greedy tokens, for 4 sessions at once; the
    engine captures them (models/deepseek.py: graph_safe, as the experts are routed). The V2 file's down experts
    (128 columns: q4_K falls back to q5_0) are routed as they are. fp8: the latents stored in e4m3, widened by
    the MLA kernels."""
    llm = LLM.load(models[name], EngineOptions(device="cuda", ctx=128, max_num_seqs=4, quiet=True, kv_cache_gb=1,
                                               kv_cache_dtype=kv_cache_dtype))
    eng = llm.engine
    assert (eng.pool.dtype == torch.float8_e4m3fn) == (kv_cache_dtype == "fp8")
    moes = [layer.moe for layer in llm.model.layers if layer.moe is not None]
    assert moes and all(m.routed for m in moes), "experts not routed"
    if name == "v2":
        assert {m.routed_down.fmt_name for m in moes} == {"q5_0"}
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [llm.encode_prompt(p) for p in ("The capital of France is", "def f(x):", "1, 2, 3,", "Hello")]
    graphs = eng.runner.graphs
    assert graphs is not None and llm.model.graph_safe
    eng.runner.graphs = None
    eager = eng.generate(prompts, greedy)
    eng.runner.graphs = graphs
    assert eng.generate(prompts, greedy) == eager and all(len(t) == 8 for t in eager)


@requires_cuda
@pytest.mark.parametrize("name", ["v2", "v3"])
def test_work_beside_the_steps_stream_gives_the_tokens_in_line(models, name, monkeypatch):
    """Decode steps of up to 8 rows run the shared experts and MLA's absorbed query product on a second stream
    (models/side_stream.py): the same greedy tokens as with that work in line, for one session and four."""
    from cobatch.models import side_stream
    llm = LLM.load(models[name], EngineOptions(device="cuda", ctx=128, max_num_seqs=4, quiet=True, kv_cache_gb=1))
    eng = llm.engine
    eng.runner.graphs = eng.runner.step_graphs = None               # eager steps: the switch is read each step
    assert any(layer.moe is not None and layer.moe.shared_beside for layer in llm.model.layers)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [llm.encode_prompt(p) for p in ("The capital of France is", "def f(x):", "1, 2, 3,", "Hello")]
    beside = [eng.generate(prompts[:1], greedy), eng.generate(prompts, greedy)]
    monkeypatch.setattr(side_stream, "SIDE_STREAM", False)
    assert [eng.generate(prompts[:1], greedy), eng.generate(prompts, greedy)] == beside


@requires_cuda
@pytest.mark.parametrize("name", ["v2", "v3"])
def test_prefill_steps_replay_graphs(models, name):
    """DeepSeek's steps with prefill chunks replay graphs (the MLA prefill kernel, the latent write, the experts
    routed on the device, the routed GEMM past ROUTED_MAX_ROWS): a 40-token prompt's hidden states close to the
    eager forward's, and greedy generation of four prompts at once the eager engine's tokens or parting at a tie."""
    llm = LLM.load(models[name], EngineOptions(device="cuda", ctx=128, max_num_seqs=4, quiet=True, kv_cache_gb=1))
    assert llm.engine.runner.step_graphs is not None and llm.model.step_graph_holds(64)
    prompts = [llm.encode_prompt(p) for p in ("The capital of France is", "def f(x):", "1, 2, 3,", "Hello")]
    assert_prefill_graphs_close_to_eager(llm, open_gguf(models[name])[1], prompts)
