"""Tensor parallelism on the CPU: ranks in processes of their own over gloo, against the same model on one.

The reference is the unsharded CPU path (itself tested against transformers and gguf-py elsewhere): a sharded
forward computes the same sums in another order (each rank's partial products, then the all-reduce), so greedy
tokens must be the same and logprobs within LOGPROB_BOUND (float32). Each model's ranks are spawned once, in a
module fixture. SmolLM2-135M has 3 KV heads, so it shards 3 ways (TP = 2 must be refused); the random Qwen3-MoE
file (2 KV heads) 2 ways, each expert split by its feed-forward width like the dense one.
"""

import pytest
import torch

from cobatch.cli import main
from cobatch.engine.sampler import SamplingParams
from cobatch.llm import LLM, EngineOptions
from cobatch.model_files import smollm2_path
from cobatch.parallel import launch
from cobatch.testing.gguf_writer import cut_layers, write_random_model

LOGPROB_BOUND = 1e-3       # float32 sums in another order: measured < 2e-5 on both models
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _options(**kw) -> EngineOptions:
    return EngineOptions(device="cpu", ctx=256, max_num_seqs=4, quiet=True, **kw)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp")
    return {"smollm2": (cut_layers(smollm2_path(), tmp / "smollm2-4l.gguf", 4), 3),
            "qwen3moe": (write_random_model(tmp / "qwen3moe.gguf", "qwen3moe-tiny", "q8_0",
                                            tokenizer_from=smollm2_path(), seed=5), 2)}


@pytest.fixture(scope="module", params=["smollm2", "qwen3moe"])
def pair(request, models):
    """(the model on one process, the same model over its ranks)."""
    path, world = models[request.param]
    one = LLM.load(path, _options())
    sharded = launch.load(path, _options(tensor_parallel_size=world))
    yield one, sharded
    sharded.ranks.stop()
    assert all(p.exitcode == 0 for p in sharded.ranks.procs)       # the ranks left when told to


def _prompt_logprobs(llm, ids: list[int], k: int = 5):
    """Every prompt token's (logprob, top-k ids, top-k logprobs) from one prefill."""
    engine = llm.engine
    rid = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k))
    rows = []
    while engine.has_work():
        for out in engine.step():
            if out.request_id == rid and out.prompt_logprobs:
                rows += out.prompt_logprobs
    return rows


def test_greedy_tokens_match_one_process(pair):
    one, sharded = pair
    prompts = [one.encode_prompt(p) for p in PROMPTS]
    # all three together (mixed prefill and decode steps), then one alone
    assert sharded.engine.generate(prompts, GREEDY) == one.engine.generate(prompts, GREEDY)
    assert sharded.engine.generate(prompts[1:2], GREEDY) == one.engine.generate(prompts[1:2], GREEDY)


def test_logprobs_within_bound(pair):
    one, sharded = pair
    ids = one.encode_prompt(PROMPTS[2])
    ref, got = _prompt_logprobs(one, ids), _prompt_logprobs(sharded, ids)
    assert len(ref) == len(got) == len(ids) - 1
    worst = 0.0
    for (tok_r, lp_r, top_r, _), (tok_g, lp_g, top_g, _) in zip(ref, got):
        assert tok_r == tok_g
        worst = max(worst, abs(lp_r - lp_g), *(abs(a[1] - b[1]) for a, b in zip(top_r, top_g)))
        assert [t for t, _ in top_r][:2] == [t for t, _ in top_g][:2]
    assert worst < LOGPROB_BOUND


def test_shard_holds_a_part_of_the_weights(pair):
    one, sharded = pair
    world = sharded.options.tensor_parallel_size
    cfg, shard = one.model.cfg, sharded.model.cfg
    assert (shard.n_heads, shard.n_kv_heads, shard.ffn_dim) == (cfg.n_heads // world, cfg.n_kv_heads // world,
                                                                 cfg.ffn_dim // world)
    assert sharded.model.embed.shape[0] == -(-one.model.embed.shape[0] // world)
    assert sharded.engine.pool.k[0].shape[2] == cfg.n_kv_heads // world
    assert sharded.model.layers[0].qkv.shape[0] * world == one.model.layers[0].qkv.shape[0]


@pytest.mark.parametrize("flags, message", [
    (["-tp", "2"], "does not divide the model's 3 KV heads"),
    (["-tp", "3", "--kv-disk-cache", "/tmp/none"], "--kv-disk-cache is not supported"),
    (["-tp", "3", "--slot-save-path", "/tmp/none"], "--slot-save-path is not supported"),
    (["-tp", "0"], "must be at least 1"),
])
def test_bad_flags_fail_before_loading(flags, message, capsys):
    assert main(["serve", str(smollm2_path()), "--device", "cpu", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("value", ["abc", "-1", "nan"])
def test_a_bad_collective_timeout_is_a_user_error(value, monkeypatch):
    from cobatch.errors import UserError
    from cobatch.parallel.group import timeout_s
    monkeypatch.setenv("COBATCH_TP_TIMEOUT_S", value)
    with pytest.raises(UserError, match=r"\$COBATCH_TP_TIMEOUT_S: a number of seconds"):
        timeout_s()


@pytest.mark.parametrize("quant", ["q8_0", "q4_k"])
def test_shards_cut_from_the_blocks_equal_slices_of_the_dense_weights(quant, tmp_path):
    """Each rank's part, cut from the raw blocks, dequantizes to the same values as that part of the whole matrix
    dequantized. q4_k's 256-value blocks: the down projection's 512 input columns split in two, but o's 256 do not,
    which check_tensor_parallel refuses."""
    from cobatch.config import ModelConfig
    from cobatch.errors import UserError
    from cobatch.loader.gguf import GGUFFile
    from cobatch.parallel.shard import ShardedGGUF, check_tensor_parallel
    path = write_random_model(tmp_path / f"{quant}.gguf", "tiny", quant, tokenizer_from=smollm2_path(), seed=3,
                              n_layers=1)
    gguf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gguf.metadata, set(gguf.tensors))
    world, q, kv, ffn = 2, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim // 2, cfg.ffn_dim // 2
    dense = {n: gguf.quant_weight(f"blk.0.{n}.weight").dequantize() for n in ("attn_k", "attn_output", "ffn_down")}
    for rank in range(world):
        part = ShardedGGUF(gguf, cfg, rank, world)
        assert torch.equal(part.quant_weight("blk.0.attn_k.weight").dequantize(),
                           dense["attn_k"][rank * kv:(rank + 1) * kv])
        assert torch.equal(part.quant_weight("blk.0.ffn_down.weight").dequantize(),
                           dense["ffn_down"][:, rank * ffn:(rank + 1) * ffn])
        if quant == "q8_0":
            assert torch.equal(part.quant_weight("blk.0.attn_output.weight").dequantize(),
                               dense["attn_output"][:, rank * q // 2:(rank + 1) * q // 2])
    if quant == "q4_k":
        with pytest.raises(UserError, match="attn_output.weight .q4_k. would be split into 128 input columns"):
            check_tensor_parallel(cfg, gguf, world)
    else:
        check_tensor_parallel(cfg, gguf, world)


def test_banner_names_each_rank_and_the_collectives():
    from cobatch.config import ModelConfig
    from cobatch.loader.gguf import GGUFFile
    from cobatch.parallel.shard import sharding_banner
    gguf = GGUFFile(smollm2_path())
    cfg = ModelConfig.from_metadata(gguf.metadata, set(gguf.tensors))
    text = sharding_banner(cfg, [(3 << 20, 2 << 20, 100, 1 << 20)] * 3, 16, torch.bfloat16)
    assert "rank 2: weights 3.0 MiB (2.0 MiB quantized), KV 100 blocks x 16 = 1600 tokens (1.0 MiB)" in text
    # 2 all-reduces per layer and one for the embedding, of d_model bf16 values per token row
    assert f"{2 * 30 + 1} per step" in text and f"{61 * 576 * 2 / 1024:.1f} KiB per token row" in text
