"""LLM: one loaded model with its tokenizer, chat template, KV pool and engine.

The object the CLI, the server and the benchmarks share: `LLM.load(path)` and go.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from cobatch.builtin_templates import template_source
from cobatch.chat_template import CHAT_TEMPLATE_KEY, ChatTemplate, ChatTemplateError
from cobatch.config import ModelConfig
from cobatch.engine.disk_cache import DiskPrefixCache
from cobatch.engine.draft_model import DraftModel
from cobatch.engine.drafts import PREDICTION_SPEC, DraftModelSpec, NgramSpec
from cobatch.engine.engine import Engine
from cobatch.engine.grammar import Grammars
from cobatch.engine.kv_cache import KVPool
from cobatch.engine.kv_store import model_identity
from cobatch.engine.runner import ModelRunner
from cobatch.engine.speculative import step_rows_with_drafts
from cobatch.errors import UserError
from cobatch.loader.gguf import GGUFFile
from cobatch.loader.hf import HFCheckpoint, generation_defaults, is_checkpoint_folder
from cobatch.loader.hf_tokenizer import chat_template_source, tokenizer_from_folder
from cobatch.loader.lora import load_adapter
from cobatch.loader.metadata_overrides import apply_overrides
from cobatch.model_files import default_model_path
from cobatch.models.linear import resident_bytes
from cobatch.models.registry import Model, model_class
from cobatch.parallel.group import TensorParallelGroup
from cobatch.parallel.shard import ShardedGGUF, check_tensor_parallel, shard_config, sharding_banner
from cobatch.parallel.steps import ParallelDecodeGraphs, ParallelModel, StepLink
from cobatch.tokenizer import Tokenizer

CPU_KV_BUDGET_BYTES = 1 << 30
MAX_LORAS, MAX_LORA_RANK = 256, 512      # (vLLM's largest --max-lora-rank choice is 512)


@dataclass(slots=True)
class EngineOptions:
    device: str = "auto"               # "auto" | "cpu" | "cuda"
    dtype: str | None = None           # activations (and KV): f32 on CPU, bf16 on CUDA by default
    kv_cache_dtype: str = "auto"       # vLLM's names: auto (= dtype), fp8 / fp8_e4m3 (1 byte a value), bf16, ...
    ctx: int | None = None             # context window per sequence (default: the model's, at most 8192;
                                       # 0: the model's)
    max_num_seqs: int = 8              # sessions decoded together (--parallel)
    kv_cache_gb: float | None = None   # KV pool size; default: from free memory (CUDA) or 1 GiB (CPU)
    gpu_memory_utilization: float | None = None   # CUDA, vLLM's knob: weights + KV up to this share of the GPU
    block_size: int = 16
    prefill_chunk: int = 512
    max_step_tokens: int = 2048
    eager: bool = False                # CUDA: no decode-step graphs (slower; for debugging)
    dense_large_batch: bool = False    # CUDA: also keep bf16/f16 weights for batches above the GEMV crossover
    chat_template: str | None = None   # a Jinja chat template (text, or the path of a file) replacing the model's
    # template variables every conversation renders with unless a request sets them (e.g. {"enable_thinking": False})
    chat_template_kwargs: dict | None = None
    # speculative decoding (engine/speculative.py): prompt lookup, or a draft model; None: off
    speculative: NgramSpec | DraftModelSpec | None = None
    overlap_steps: bool = True         # CUDA: plan and launch decode step n + 1 while step n runs (engine.py)
    scheduling_policy: str = "fcfs"    # "fcfs" or "priority": requests' priority orders them (engine/scheduler.py)
    kv_disk_cache: str | None = None   # a directory for prefix-cache blocks evicted from the pool
                                       # (engine/disk_cache.py)
    kv_disk_gb: float = 16.0           # ... kept under this size
    quantization: str = "auto"         # a checkpoint folder's float matrices: q8_0 (auto), q4_k, q4_1, none
    tensor_parallel_size: int = 1      # ranks the model is sharded over (cobatch.parallel; launch.load spawns them)
    # LoRA adapters requests may select by name (models/lora.py): (name, PEFT folder or GGUF adapter, scale)
    lora_modules: tuple[tuple[str, str, float], ...] = ()
    max_loras: int = 0                 # adapter slots (default: the start-up adapters, or 1 with runtime_lora)
    max_lora_rank: int = 0             # their rank (default: the start-up adapters', or 16 with runtime_lora)
    runtime_lora: bool = False         # adapters may be loaded and unloaded while serving (vLLM's endpoints)
    # a GGUF file's metadata changed at load (loader/metadata_overrides.py: --override-kv, the rope flags)
    metadata_overrides: tuple[tuple[str, Any], ...] = ()
    warmup: bool = True                # CUDA: run one made-up mixed step at load, so no request waits on a compile
    quiet: bool = False


def _open_model(path: Path, quantization: str, device: torch.device, overrides: tuple[tuple[str, Any], ...] = ()
                ) -> tuple[GGUFFile | HFCheckpoint, ModelConfig, Tokenizer, str | None]:
    """(weights, config, tokenizer, the model's chat template) of a GGUF file (its metadata changed by
    `overrides`) or a checkpoint folder."""
    if is_checkpoint_folder(path):
        if overrides:
            raise UserError("--override-kv and the rope flags change a GGUF file's metadata; a checkpoint folder's "
                            "config.json is changed in the folder")
        weights = HFCheckpoint(path, quantization, device)
        return (weights, weights.config, tokenizer_from_folder(path, weights.config.vocab_size),
                chat_template_source(path))
    if quantization not in ("auto", None):
        raise UserError(f"--quantization {quantization}: a GGUF file is already quantized (the flag is for "
                        "checkpoint folders)")
    gguf = GGUFFile(path)
    apply_overrides(gguf.metadata, overrides)
    cfg = ModelConfig.from_metadata(gguf.metadata, set(gguf.tensors))
    gguf.check_tensor_types()
    return gguf, cfg, Tokenizer.from_metadata(gguf.metadata), gguf.metadata.get(CHAT_TEMPLATE_KEY) or None


def _chat_template(override: str | None, model_template: str | None, tokenizer: Tokenizer) -> ChatTemplate | None:
    """The --chat-template override (a file's path, or the template itself), else the model's own, else None."""
    try:
        if override is None:
            return ChatTemplate.with_tokenizer(model_template, tokenizer) if model_template else None
    except ChatTemplateError:
        return None
    try:
        return ChatTemplate.with_tokenizer(template_source(override), tokenizer)
    except ChatTemplateError as exc:
        raise UserError(f"--chat-template: {exc}") from None


# The GPU kernels' oldest target: the GEMV's mma.sync m16n8k16 and bf16 arithmetic (a T4, 7.5, compiles neither)
MIN_CAPABILITY = (8, 0)


def _too_old(index: int) -> str | None:
    """Why GPU `index` cannot run the kernels, or None."""
    capability = torch.cuda.get_device_capability(index)
    if capability >= MIN_CAPABILITY:
        return None
    return (f"{torch.cuda.get_device_name(index)} (compute capability {capability[0]}.{capability[1]}) is older than "
            f"the GPU kernels need ({MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}, Ampere)")


def gpu_note(index: int) -> str:
    """What runs on GPU `index`, for the start-up lines: Hopper's own kernels or the common ones (docs/models.md)."""
    capability = torch.cuda.get_device_capability(index)
    kernels = ("the GEMV, the mid-batch GEMM and attention" if capability[0] == 9
               else "the GEMV and attention; past 16 rows, dequantize + cuBLAS")
    fp8 = "" if capability >= (8, 9) else "; an fp8 KV cache as bytes"
    return (f"{torch.cuda.get_device_name(index)} (compute capability {capability[0]}.{capability[1]}, "
            f"{torch.cuda.get_device_properties(index).multi_processor_count} SMs): {kernels}{fp8}")


def resolve_device(name: str) -> torch.device:
    """--device: auto (a GPU the kernels run on, else the CPU), cpu, cuda or cuda:N; anything else, a GPU that is
    not there or is too old is a UserError."""
    if name == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        why = _too_old(torch.cuda.current_device())
        if why:
            print(f"cobatch: {why}: running on the CPU", file=sys.stderr)
            return torch.device("cpu")
        return torch.device("cuda")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {name}: choose auto, cpu or cuda (cuda:N for the N-th GPU)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda asked for, but no CUDA GPU is available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UserError(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s)")
    if device.type == "cuda" and (why := _too_old(device.index if device.index is not None
                                                  else torch.cuda.current_device())):
        raise UserError(f"--device {name}: {why}; --device cpu runs on the CPU")
    return device


_DTYPES = {"f32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "f16": torch.float16, "float16": torch.float16}


def activation_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """--dtype (None: bf16 on a GPU, f32 on the CPU)."""
    if name and name not in _DTYPES:
        raise UserError(f"unknown dtype {name!r} (choose from f32, bf16, f16)")
    return _DTYPES[name] if name else (torch.bfloat16 if device.type == "cuda" else torch.float32)


# vLLM's --kv-cache-dtype fp8 is e4m3 with a scale of 1: values keep 3 mantissa bits and saturate at +-448
_KV_DTYPES = {**_DTYPES, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def kv_cache_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The KV pool's dtype for --kv-cache-dtype `name` with activations in `dtype`."""
    if name == "auto":
        return dtype
    if name not in _KV_DTYPES:
        raise UserError(f"unknown --kv-cache-dtype {name!r} (choose from auto, fp8, fp8_e4m3, bf16, f16, f32)")
    return _KV_DTYPES[name]


# llama.cpp's -ctk / -ctv types: its default f16 means "as the activations" here; its 8-bit q8_0 maps to the 8-bit
# cache cobatch has (fp8 e4m3, not q8_0's blocks of 32 with a scale each)
_LLAMA_CPP_CACHE_TYPES = {"f16": "auto", "bf16": "auto", "f32": "f32", "q8_0": "fp8"}


def kv_cache_dtype_flag(kv_cache_dtype: str | None, cache_type_k: str | None, cache_type_v: str | None) -> str:
    """--kv-cache-dtype (vLLM) or llama.cpp's -ctk / -ctv, as one --kv-cache-dtype name."""
    if cache_type_k is None and cache_type_v is None:
        return kv_cache_dtype or "auto"
    k, v = cache_type_k or "f16", cache_type_v or "f16"        # llama.cpp's default for the one not given
    for flag, value in (("-ctk", k), ("-ctv", v)):
        if value not in _LLAMA_CPP_CACHE_TYPES:
            raise UserError(f"{flag} {value}: cobatch's KV cache types are {', '.join(_LLAMA_CPP_CACHE_TYPES)} "
                            "(q8_0 is stored as fp8 e4m3)")
    if _LLAMA_CPP_CACHE_TYPES[k] != _LLAMA_CPP_CACHE_TYPES[v]:
        raise UserError(f"-ctk {k} -ctv {v}: cobatch stores K and V in one dtype; give both the same type")
    if kv_cache_dtype is not None and _KV_DTYPES.get(kv_cache_dtype, kv_cache_dtype) != _KV_DTYPES.get(
            _LLAMA_CPP_CACHE_TYPES[k], _LLAMA_CPP_CACHE_TYPES[k]):
        raise UserError(f"--kv-cache-dtype {kv_cache_dtype} contradicts -ctk/-ctv {k}")
    return _LLAMA_CPP_CACHE_TYPES[k]


def kv_cache_dtype_arg(args) -> str:
    """The parsed --kv-cache-dtype, -ctk and -ctv flags (chat, generate and serve) as one --kv-cache-dtype name."""
    name = kv_cache_dtype_flag(args.kv_cache_dtype, args.cache_type_k, args.cache_type_v)
    kv_cache_dtype(name, torch.float32)       # an unknown name fails with the other flags, before any file is read
    return name


def _graph_rows(options: EngineOptions, model_limit: int | None, device: torch.device) -> int:
    """Rows the decode graphs hold: a token per session and its drafts, up to the rows the scheduler lets a step
    with drafts have (any request may bring drafts: its predicted output)."""
    rows = options.max_num_seqs
    spec = options.speculative or PREDICTION_SPEC
    with_drafts = min(rows * (1 + spec.num_tokens), options.max_step_tokens)
    rows = max(rows, min(with_drafts, step_rows_with_drafts(device) or with_drafts))
    return min(rows, model_limit or rows)


@contextlib.contextmanager
def _gpu_memory_as_user_error():
    """Out of GPU memory while loading: one line of what must fit, the CLI's exit 2, not a traceback."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        what = str(e).split(". GPU")[0].splitlines()[0]         # torch's first sentence: what it tried to allocate
        raise UserError(f"out of GPU memory while loading the model ({what}): the weights, the KV cache "
                        "(--kv-cache-gb, or --gpu-memory-utilization) and the CUDA graphs (--parallel, "
                        "--prefill-chunk; none with --eager) must fit the GPU together") from None


class LLM:
    def __init__(self, path: Path, weights: GGUFFile | HFCheckpoint, cfg: ModelConfig, tokenizer: Tokenizer,
                 template: ChatTemplate | None, model: Model, engine: Engine, options: EngineOptions):
        self.path, self.weights, self.config, self.tokenizer = path, weights, cfg, tokenizer
        self.template, self.model, self.engine, self.options = template, model, engine, options
        self.kv_identity = ""      # what saved KV state must match (engine/kv_store.model_identity); set by load()
        # sampling defaults of requests that leave a field unset: a checkpoint's generation_config.json
        self.generation_defaults = generation_defaults(path) if isinstance(weights, HFCheckpoint) else {}
        self.ranks = None          # tensor parallel: the other ranks' processes (parallel/launch.Ranks)

    @classmethod
    @_gpu_memory_as_user_error()
    def load(cls, path: str | Path | None = None, options: EngineOptions | None = None,
             tp: TensorParallelGroup | None = None, link: StepLink | None = None) -> "LLM":
        """Load a model for serving. With tensor parallelism this process is rank 0 of the group `tp` (the other
        ranks load theirs through load_rank and follow `link`): cobatch.parallel.launch.load sets that up."""
        options = options or EngineOptions()
        if options.tensor_parallel_size != (tp.world if tp else 1):
            raise ValueError("tensor_parallel_size > 1: load through cobatch.parallel.launch.load")
        if tp is not None and options.kv_disk_cache:
            raise UserError("--kv-disk-cache is not supported with --tensor-parallel-size > 1 (rank 0 alone would "
                            "write and read its own KV shard)")
        path = Path(path) if path else default_model_path()
        w = _open(path, options, tp)
        template = _chat_template(options.chat_template, w.model_template, w.tokenizer)
        if template is not None and options.chat_template_kwargs:
            template.defaults = dict(options.chat_template_kwargs)
        _load_weights(w, options, tp, rank0=True)
        cfg, device, model, pool, ctx, tokenizer = w.cfg, w.device, w.model, w.pool, w.ctx, w.tokenizer
        runner = ModelRunner(model if tp is None else ParallelModel(model, link), pool, device, tokenizer.stop_ids)
        identity = model_identity(path, pool, getattr(w.weights, "quantization", ""))
        spill = None
        if options.kv_disk_cache:
            if options.kv_disk_gb <= 0:
                raise UserError(f"--kv-disk-gb must be positive (got {options.kv_disk_gb})")
            spill = DiskPrefixCache(options.kv_disk_cache, int(options.kv_disk_gb * (1 << 30)), pool, identity)
        runner.graphs = _capture_graphs(w, options, link)
        runner.step_graphs = _capture_step_graphs(w, options, runner.graphs)
        engine = Engine(runner, tokenizer.stop_ids, max_context=ctx, max_num_seqs=options.max_num_seqs,
                        max_step_tokens=options.max_step_tokens, prefill_chunk=options.prefill_chunk,
                        grammars=Grammars(tokenizer, cfg.vocab_size), speculative=options.speculative,
                        # On the CPU a launch computes the step before it returns: planning ahead would only
                        # hold each step's tokens back until the next one is computed.
                        overlap=options.overlap_steps and device.type == "cuda", drafter=w.drafter,
                        scheduling_policy=options.scheduling_policy)
        if device.type == "cuda" and options.warmup:
            _warm_up(engine, cfg.vocab_size, options.prefill_chunk, ctx)
        engine.blocks.spill = spill          # after the warm-up: its made-up prompts are not worth a file
        llm = cls(path, w.weights, cfg, tokenizer, template, model, engine, options)
        llm.kv_identity = identity
        return llm

    # --- prompts ---------------------------------------------------------------------------------
    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt: tokenized with the model's BOS/EOS conventions."""
        return self.tokenizer.encode(text, add_special=True)

    def encode_infill(self, prefix: str, suffix: str, extra_files: list[tuple[str, str]] = (),
                      middle: str = "") -> list[int]:
        """A fill-in-the-middle prompt (prefix-suffix-middle order, as llama.cpp's /infill builds it): the
        model writes what goes between `prefix` and `suffix`, continuing `middle`. `extra_files` (filename, text)
        are repository context before it: after the repository-name token and each behind a file separator
        where the vocabulary has those tokens (Qwen2.5-Coder, StarCoder 2), else as text snippets."""
        tok = self.tokenizer
        if tok.fim_ids is None:
            raise UserError("this model's vocabulary has no fill-in-the-middle tokens (suffix is not supported)")
        pre, suf, mid = tok.fim_ids
        context: list[int] = []
        if extra_files and tok.fim_repo_ids is not None:
            repo, sep = tok.fim_repo_ids
            context = [repo] + tok.encode("myproject\n", add_special=False)
            for filename, text in extra_files:
                context += [sep] + tok.encode(f"{filename}\n{text}", add_special=False)
            context += [sep] + tok.encode("filename\n", add_special=False)     # the file being edited
        elif extra_files:
            context = tok.encode("".join(f"\n\n--- snippet ---\n\n{text}" for _, text in extra_files),
                                 add_special=False)
        ids = context + [pre] + tok.encode(prefix, add_special=False) + [suf] + tok.encode(suffix, add_special=False)
        ids += [mid] + tok.encode(middle, add_special=False)
        return ([tok.bos_id] if tok.add_bos and tok.bos_id is not None else []) + ids

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None, **template_kwargs) -> list[int]:
        if self.template is None:
            raise UserError("this model has no chat template (tokenizer.chat_template is missing); "
                            "use raw generation instead")
        text = self.template.render(messages, tools=tools, add_generation_prompt=True, **template_kwargs)
        ids = self.tokenizer.encode(text, add_special=False)
        bos = self.tokenizer.bos_id
        # The template normally writes BOS itself; add it only where the model wants one and it is absent.
        if self.tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids


@dataclass(slots=True)
class _Weights:
    """What every rank loads: the file or folder, its config and tokenizer, this rank's model (shard) and KV pool."""
    path: Path
    weights: GGUFFile | HFCheckpoint
    cfg: ModelConfig             # the whole model's (the shard's is model.cfg)
    tokenizer: Tokenizer
    model_template: str | None   # the model's own chat template
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    ctx: int
    model: Model | None = None
    pool: KVPool | None = None
    drafter: DraftModel | None = None    # speculative decoding's draft model and its own KV pool


def _open(path: Path, options: EngineOptions, tp: TensorParallelGroup | None) -> _Weights:
    """The file and its config, the options checked against them: nothing loaded yet."""
    device = resolve_device(options.device) if tp is None else tp.device
    dtype = activation_dtype(options.dtype, device)
    kv_dtype = kv_cache_dtype(options.kv_cache_dtype, dtype)     # a bad name fails before the model loads
    weights, cfg, tokenizer, model_template = _open_model(path, options.quantization, device,
                                                          options.metadata_overrides)
    # 0: the model's own context (llama.cpp's -c 0); unset: that, at most 8192
    ctx = cfg.context_length if options.ctx == 0 else options.ctx or min(cfg.context_length, 8192)
    if ctx < 2:
        raise UserError(f"--ctx must be at least 2 (got {ctx})")
    if ctx > cfg.context_length:         # past what it was trained on, and its tables sized by it (vLLM refuses too)
        raise UserError(f"--ctx {ctx} is over the model's context length ({cfg.context_length}); 0 takes it")
    if tp is not None:
        if not isinstance(weights, GGUFFile) or cfg.mla is not None:
            what = "a checkpoint folder" if not isinstance(weights, GGUFFile) else cfg.arch
            raise UserError("--tensor-parallel-size > 1 shards GGUF files of the llama and MoE families; "
                            f"{path.name} is {what}")
        check_tensor_parallel(cfg, weights, tp.world)
    return _Weights(path, weights, cfg, tokenizer, model_template, device, dtype, kv_dtype, ctx)


def _load_weights(w: _Weights, options: EngineOptions, tp: TensorParallelGroup | None, rank0: bool) -> None:
    """The model (this rank's shard under tensor parallelism) and its KV pool, into w. Every rank of a group runs
    this in the same order: its collectives (the pool's size, the banner's figures) pair up."""
    path, cfg, device, dtype, ctx = w.path, w.cfg, w.device, w.dtype, w.ctx
    model_cfg, source = cfg, w.weights
    if tp is not None:
        model_cfg, source = shard_config(cfg, tp.world), ShardedGGUF(w.weights, cfg, tp.rank, tp.world)
        tp.vocab_rows, tp.vocab_per_rank = source.vocab_rows, source.vocab_per_rank
    adapter_args = _adapters(options, cfg, tp, device)
    with tqdm(total=cfg.n_layers, desc=f"loading {path.name}", unit="layer", delay=1.0,
              disable=options.quiet or not rank0, file=sys.stderr) as bar:
        model = model_class(model_cfg)(model_cfg, source, device, dtype, max_positions=ctx, progress=bar.update,
                                       keep_dense=options.dense_large_batch, **adapter_args)
    if tp is not None:
        model.tp, model.vocab_rows = tp, tp.vocab_rows
    held = resident_bytes(model)
    if not options.quiet and tp is None:
        copies = (f"{held['bf16_copies'] / 2**30:.2f} GiB of dequantized copies (--dense-large-batch)"
                  if held["bf16_copies"] else "no dequantized copies")
        if device.type == "cpu":       # the reference path: every matrix dequantized once, to the model's dtype
            copies = f"dequantized to {str(dtype).removeprefix('torch.')} on the CPU"
        print(f"weights: {sum(held.values()) / 2**30:.2f} GiB resident on {device} "
              f"({held['quantized'] / 2**30:.2f} GiB quantized, {held['dense'] / 2**30:.2f} GiB dense, {copies})",
              file=sys.stderr)
        if device.type == "cuda":
            print(f"GPU: {gpu_note(device.index if device.index is not None else torch.cuda.current_device())}",
                  file=sys.stderr)
    draft = _load_draft(options, w, tp) if isinstance(options.speculative, DraftModelSpec) else None
    pool = _make_pool(model_cfg, options, ctx, w.kv_dtype, device, agree=tp.min_over_ranks if tp else None,
                      quiet=options.quiet or tp is not None, beside=draft.cfg if draft else None)
    if draft is not None:       # as many tokens as the target's pool: every sequence can draft
        draft_pool = KVPool(draft.cfg, pool.num_blocks, options.block_size, w.kv_dtype, device)
        graphs = None
        if device.type == "cuda" and not options.eager and draft.graph_safe:    # one decode row a sequence
            from cobatch.engine.cuda_graphs import DecodeGraphs
            graphs = DecodeGraphs(draft, draft_pool, options.max_num_seqs, ctx, quiet=options.quiet)
        w.drafter = DraftModel(draft, draft_pool, target_vocab=model.vocab_rows, graphs=graphs)
    if tp is not None:
        ranks = tp.gather_objects((sum(held.values()), held["quantized"], pool.num_blocks, pool.nbytes))
        if rank0 and not options.quiet:
            print(sharding_banner(cfg, ranks, options.block_size, dtype), file=sys.stderr)
    w.model, w.pool = model, pool


def _adapters(options: EngineOptions, cfg: ModelConfig, tp: TensorParallelGroup | None, device: torch.device
              ) -> dict:
    """The model's LoRA keyword arguments: the adapters read from disk, the room for more, and the most rows a step
    may have."""
    if not options.lora_modules and not options.runtime_lora:
        if options.max_loras or options.max_lora_rank:
            raise UserError("--max-loras and --max-lora-rank size LoRA adapters' slots: give adapters "
                            "(--lora-modules) or allow runtime loading")
        return {}
    for flag, value, most in (("--max-loras", options.max_loras, MAX_LORAS),
                              ("--max-lora-rank", options.max_lora_rank, MAX_LORA_RANK)):
        if not 0 <= value <= most:
            raise UserError(f"{flag} must be between 1 and {most} (got {value})")
    if tp is not None:
        raise UserError("LoRA adapters are not supported with --tensor-parallel-size > 1")
    names = [name for name, _, _ in options.lora_modules]
    if len(set(names)) != len(names):
        raise UserError(f"two LoRA adapters share a name ({', '.join(names)}): give each its own (NAME=PATH)")
    adapters = [load_adapter(path, cfg, name, scale) for name, path, scale in options.lora_modules]
    if options.max_loras and options.max_loras < len(adapters):
        raise UserError(f"--max-loras {options.max_loras} is fewer slots than the {len(adapters)} adapters given")
    too_big = next((a for a in adapters if options.max_lora_rank and a.rank > options.max_lora_rank), None)
    if too_big is not None:
        raise UserError(f"LoRA adapter {too_big.name} has rank {too_big.rank}, over --max-lora-rank "
                        f"{options.max_lora_rank}")
    runtime = options.runtime_lora
    slots = options.max_loras or max(len(adapters), 1 if runtime else 0)
    rank = options.max_lora_rank or max([16 if runtime else 0] + [a.rank for a in adapters])
    _check_slot_memory(cfg, slots, rank, runtime, device)
    rows = max(options.max_step_tokens, options.prefill_chunk, _graph_rows(options, None, device))
    if not options.quiet and adapters:
        print(f"LoRA adapters: {', '.join(f'{a.name} (rank {a.rank}, {len(a.pairs)} projections)' for a in adapters)}",
              file=sys.stderr)
    return {"adapters": adapters, "adapter_rows": rows, "adapter_slots": slots, "adapter_rank": rank,
            "runtime_adapters": runtime}


def _check_slot_memory(cfg: ModelConfig, slots: int, rank: int, runtime: bool, device: torch.device) -> None:
    """Refuse adapter slots that would not fit in the device's free memory (an upper bound: every projection holds
    slots, in float32), before allocating them."""
    d, q, kv, ff = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    # each projection's parts x (its input + its output) columns a slot's rank: q|k|v, o, gate|up, down
    widths = 3 * (d + q + 2 * kv) + (q + d) + (0 if cfg.n_experts else 2 * (d + 2 * ff) + (ff + d))
    need = 4 * cfg.n_layers * slots * rank * widths
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > 0.5 * free:
        raise UserError(f"LoRA adapter slots ({slots} of rank {rank}) need up to {need / 2**30:.1f} GiB, over half "
                        f"the {free / 2**30:.1f} GiB free: lower --max-loras or --max-lora-rank")


def _load_draft(options: EngineOptions, w: _Weights, tp: TensorParallelGroup | None) -> Model:
    """The draft model of --speculative-config / --model-draft, checked to share the target's vocabulary."""
    if tp is not None:
        raise UserError("a draft model is not supported with --tensor-parallel-size > 1")
    path = Path(options.speculative.model)
    weights, cfg, tokenizer, _ = _open_model(path, "auto", w.device)
    mine, theirs = w.tokenizer, tokenizer
    if mine.vocab_size != theirs.vocab_size or any(mine.token_bytes(i) != theirs.token_bytes(i)
                                                  for i in range(mine.vocab_size)):
        raise UserError(f"draft model {path.name}: its vocabulary ({theirs.vocab_size} tokens) is not the model's "
                        f"({mine.vocab_size}); a draft model must share the tokenizer")
    model = model_class(cfg)(cfg, weights, w.device, w.dtype, max_positions=w.ctx)
    if not options.quiet:
        print(f"draft model: {path.name} ({cfg.arch}, {cfg.n_layers} layers), {options.speculative.num_tokens} drafts "
              f"a step", file=sys.stderr)
    return model


# Steps with prefill chunks replay graphs too (engine/cuda_graphs.StepGraphs): a 128-token prefill of the random
# Llama-3-8B q8_0 took 5.8 ms replayed against 25.2 ms eagerly, the host launching (bench/results/prefill_host.json).
# COBATCH_STEP_GRAPHS=0 runs them eagerly.
STEP_GRAPHS = os.environ.get("COBATCH_STEP_GRAPHS", "1") == "1"


def _capture_step_graphs(w: _Weights, options: EngineOptions, decode_graphs):
    """The prefill steps' graphs (engine/cuda_graphs.StepGraphs), in the decode graphs' memory pool: where those
    were captured, on one device, for a model that holds some (models/llama.py's step_graph_holds)."""
    model = w.model
    if decode_graphs is None or not STEP_GRAPHS or model.tp is not None or not hasattr(model, "step_graph_holds"):
        return None
    from cobatch.engine.cuda_graphs import StepGraphs, step_graph_rows
    # A chunk beside decode rows: the scheduler cuts a long prompt so that the step fits prefill_chunk rows.
    rows = min(options.prefill_chunk, options.max_step_tokens)
    if not step_graph_rows(model, rows):
        return None
    return StepGraphs(model, w.pool, rows, options.max_num_seqs, w.ctx, options.quiet, mempool=decode_graphs.mempool)


def _capture_graphs(w: _Weights, options: EngineOptions, link: StepLink | None):
    """The decode graphs on CUDA (None elsewhere, with --eager, or for experts the device cannot route); under
    tensor parallelism every rank captures the same ones over its raw model (rank 0's then broadcast each step)."""
    model = w.model
    if w.device.type != "cuda" or options.eager or not model.graph_safe:
        return None
    rows = _graph_rows(options, model.graph_max_rows, w.device)
    quiet = options.quiet or (model.tp is not None and link is None)
    if model.tp is None:
        from cobatch.engine.cuda_graphs import DecodeGraphs
        return DecodeGraphs(model, w.pool, rows, w.ctx, quiet)
    return ParallelDecodeGraphs(model, w.pool, rows, w.ctx, quiet, link=link)


def load_rank(path: str | Path, options: EngineOptions, tp: TensorParallelGroup):
    """A tensor-parallel rank > 0: its shard, KV pool and decode graphs, for parallel.steps.follow_steps."""
    w = _open(Path(path), options, tp)
    _load_weights(w, options, tp, rank0=False)
    return w.model, w.pool, _capture_graphs(w, options, None)


def _warm_up(engine: Engine, vocab: int, chunk: int, ctx: int) -> None:
    """Run a multi-chunk prefill next to a decoding session once, at start.

    Kernels compile (and buffers grow) on first use of a shape class; without this the first long prompt
    a server sees stalls every running stream for over a second (H200: 1.35 s, bench/results/serve-* at 5a66009^).
    """
    from cobatch.engine.sampler import SamplingParams
    n_long = min(2 * chunk + 17, ctx - 8)
    long = [(i * 7919 + 11) % vocab for i in range(n_long)]
    short = [(i * 31 + 7) % vocab for i in range(9)]
    engine.generate([short, long], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.generate([short[:5]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))


def kv_budget_bytes(options: EngineOptions, device: torch.device, all_slots_full: int) -> int:
    """Bytes for the KV pool: --kv-cache-gb; on CUDA, --gpu-memory-utilization of the whole GPU less what is in
    use already (the weights, after loading), else 85 % of the free memory; on the CPU, enough for every slot's
    full context (all_slots_full) up to 1 GiB."""
    if options.kv_cache_gb is not None:
        return int(options.kv_cache_gb * (1 << 30))
    if device.type != "cuda":
        return min(CPU_KV_BUDGET_BYTES, all_slots_full)
    free, total = torch.cuda.mem_get_info(device)
    if options.gpu_memory_utilization is None:
        return int(free * 0.85)
    budget = int(options.gpu_memory_utilization * total) - (total - free)
    if budget <= 0:
        raise UserError(f"--gpu-memory-utilization {options.gpu_memory_utilization} leaves no room for the KV cache: "
                        f"{(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB are in use after loading the model")
    return budget


def kv_bytes_note(cfg: ModelConfig, dtype: torch.dtype) -> str:
    """MLA's KV bytes per token against what full K and V heads would take (printed at load)."""
    latent = KVPool.bytes_per_token(cfg, dtype)
    full = KVPool.bytes_per_token(cfg, dtype, gqa_equivalent=True)
    return (f"{latent} bytes (the latent: {cfg.mla.latent_dim} values a layer), against {full} with full K and V "
            f"heads ({cfg.n_heads} x ({cfg.mla.qk_head_dim} + {cfg.mla.v_head_dim}) a layer): {full / latent:.1f}x "
            "fewer")


def _make_pool(cfg: ModelConfig, options: EngineOptions, ctx: int, dtype: torch.dtype,
               device: torch.device, agree=None, quiet: bool = False, beside: ModelConfig | None = None) -> KVPool:
    """agree: under tensor parallelism, the smallest of every rank's block count (rank 0 plans for all). beside: a
    draft model's config, whose pool of as many blocks shares the budget."""
    per_block = KVPool.bytes_per_block(cfg, options.block_size, dtype)
    if beside is not None:
        per_block += KVPool.bytes_per_block(beside, options.block_size, dtype)
    budget = kv_budget_bytes(options, device, per_block * -(-ctx // options.block_size) * options.max_num_seqs)
    num_blocks = budget // per_block
    min_blocks = -(-ctx // options.block_size)
    if num_blocks < min_blocks:
        num_blocks = min_blocks if options.kv_cache_gb is None else num_blocks
    if agree is not None:
        num_blocks = agree(num_blocks)
    if num_blocks < 1:
        raise UserError(f"KV cache budget too small: one block needs {per_block} bytes")
    pool = KVPool(cfg, num_blocks, options.block_size, dtype, device)
    if not quiet:
        print(f"KV cache: {num_blocks} blocks x {options.block_size} tokens = {num_blocks * options.block_size} "
              f"tokens, {pool.nbytes / 2**20:.0f} MiB ({dtype}, {device})", file=sys.stderr)
        if cfg.mla is not None:
            print(f"KV per token: {kv_bytes_note(cfg, dtype)}", file=sys.stderr)
    return pool
