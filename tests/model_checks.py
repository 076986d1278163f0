"""Shared by the model tests: open a GGUF, run one prompt's prefill, compare the CUDA path with the CPU one or
with Hugging Face transformers reading the same file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cobatch.batch import AttentionMetadata
from cobatch.config import ModelConfig
from cobatch.engine.kv_cache import KVPool
from cobatch.loader.gguf import GGUFFile
from cobatch.models.llama import LlamaModel
from cobatch.models.registry import model_class


def open_gguf(path) -> tuple[GGUFFile, ModelConfig]:
    f = GGUFFile(path)
    return f, ModelConfig.from_metadata(f.metadata, set(f.tensors))


def load_model(path, device="cpu", dtype=torch.float32, max_positions: int = 128):
    f, cfg = open_gguf(path)
    return f, cfg, model_class(cfg)(cfg, f, device, dtype, max_positions=max_positions)


def prompt_logits(model: LlamaModel, cfg: ModelConfig, ids: list[int], kv_dtype=None) -> torch.Tensor:
    """float32 logits of every position of one prompt, prefilled in one step on the model's device (CPU out);
    the KV cache in kv_dtype (default: the model's dtype)."""
    dev, n, bs = model.device, len(ids), 16
    blocks = -(-n // bs)
    pool = KVPool(cfg, blocks, bs, kv_dtype or model.dtype, dev)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=dev), query_start=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=dev)[None], max_query_len=n, max_seq_len=n)
    with torch.inference_mode():
        hidden = model.forward(torch.tensor(ids, device=dev), torch.arange(n, device=dev), meta, pool.k, pool.v)
        return model.logits(hidden).float().cpu()


def gpu_and_cpu_logits(path, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(f16 CUDA logits, f32 CPU logits) of the same file and prompt."""
    _, cfg, cpu = load_model(path)
    _, _, gpu = load_model(path, "cuda", torch.float16)
    return prompt_logits(gpu, cfg, ids), prompt_logits(cpu, cfg, ids)


def transformers_float_model(folder):
    """transformers' float32 model of a checkpoint folder, with its eager attention: the exact reference whatever
    the installed version's default (Gemma-2's logit softcapping and sliding window are not in every other path).
    The GPU machine's transformers 5.17 put its tiny Gemma-2 folders 2-6e-3 from ours with the default attention;
    whether eager closes that was not yet run there."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def transformers_logits(path, ids: list[int], **config) -> torch.Tensor:
    """float32 logits of one prompt from transformers loading the same GGUF (the independent reference; skips
    without transformers). `config` overrides what its GGUF mapping does not carry."""
    transformers = pytest.importorskip("transformers")
    path = Path(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                           **config)
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def assert_same_or_tie(ref_logits, prompt, want, got, tol):
    """Token lists equal, or they first differ where the reference scores both choices within tol."""
    i = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), None)
    if i is None:
        assert len(want) == len(got)
        return None
    logits = ref_logits(prompt + want[:i])[-1]
    gap = (logits[want[i]] - logits[got[i]]).abs().item()
    assert gap <= tol, f"diverged at step {i} with a reference margin of {gap:.4f} (> {tol}): not a tie"
    return i, gap


def step_hidden(llm, prompts: list[list[int]], graphs=None) -> torch.Tensor:
    """The final hidden states of one prefill step of these prompts (each from position 0) on an engine's device:
    eager, or replayed from `graphs` (engine/cuda_graphs.StepGraphs)."""
    from cobatch.engine.runner import step_metadata
    bs, dev = llm.engine.pool.block_size, llm.engine.runner.device
    tables = [llm.engine.blocks.allocate(-(-len(p) // bs)) for p in prompts]
    ids = [t for p in prompts for t in p]
    pos = [i for p in prompts for i in range(len(p))]
    slots = [table[i // bs] * bs + i % bs for p, table in zip(prompts, tables) for i in range(len(p))]
    starts = [0]
    for p in prompts:
        starts.append(starts[-1] + len(p))
    lens = [len(p) for p in prompts]
    try:
        with torch.inference_mode():
            if graphs is not None:
                return graphs.run(ids, pos, slots, lens, starts, tables).clone()
            meta = step_metadata(slots, starts, lens, tables, dev)
            return llm.model.forward(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta,
                                     llm.engine.pool.k, llm.engine.pool.v).clone()
    finally:
        for table in tables:
            llm.engine.blocks.release(table)


def generate_with_and_without_step_graphs(llm, prompts: list[list[int]], params) -> tuple[list, list, list[int]]:
    """(tokens with the engine's prefill graphs, tokens with its prefill steps eager, the rows of each replayed
    step) of the same prompts, arriving together."""
    runner = llm.engine.runner
    graphs = runner.step_graphs
    replays = []

    def counted(*args):
        replays.append(len(args[0]))
        return type(graphs).run(graphs, *args)

    graphs.run = counted
    try:
        graphed = llm.engine.generate(prompts, params)
    finally:
        del graphs.run
    runner.step_graphs = None
    try:
        eager = llm.engine.generate(prompts, params)
    finally:
        runner.step_graphs = graphs
    return graphed, eager, replays


def assert_prefill_graphs_close_to_eager(llm, cfg: ModelConfig, prompts: list[list[int]], tol: float = 0.05):
    """A model whose engine captured prefill graphs: a 40-token prompt's hidden states replayed from the (64, 1)
    graph close to the eager forward's (its kernels may be another row count's), and greedy generation of the
    prompts at once replaying the prefill step, the eager engine's tokens or parting at a tie (within tol)."""
    from cobatch.engine.sampler import SamplingParams
    graphs = llm.engine.runner.step_graphs
    assert graphs is not None and graphs.bucket_for(40, 1) == (64, 1)
    ids = [int(i) for i in torch.randint(0, 49000, (40,), generator=torch.Generator().manual_seed(5))]
    got, want = step_hidden(llm, [ids], graphs).float(), step_hidden(llm, [ids]).float()
    assert torch.isfinite(got).all() and ((got - want).norm() / want.norm()).item() < 2e-2
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    graphed, eager, replays = generate_with_and_without_step_graphs(llm, prompts, greedy)
    assert replays and sum(replays) >= sum(len(p) for p in prompts)      # every prompt row in a graph's step
    for p, want_ids, got_ids in zip(prompts, eager, graphed):
        assert_same_or_tie(lambda ids: prompt_logits(llm.model, cfg, ids), p, want_ids, got_ids, tol)
