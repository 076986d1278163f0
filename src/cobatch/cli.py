"""The `cobatch` command: chat, generate, inspect, serve, make-model.

Bad input (a missing file, a prompt too long, an unknown flag value) gets one line on stderr and exit
code 2 -- never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from cobatch.errors import UserError

EXIT_USAGE = 2


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", help="a GGUF file or a Hugging Face checkpoint folder (default: "
                                         "SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default=None, help="activation/KV dtype: f32 | bf16 | f16 (default: bf16 on a GPU, f32 "
                   "on the CPU)")
    _add_quantization_arg(p)
    _add_kv_cache_args(p)
    _add_metadata_override_args(p)
    p.add_argument("--ctx", type=int, default=None, help="context window in tokens")
    p.add_argument("--eager", action="store_true", help="CUDA: run decode steps without CUDA graphs (debugging)")
    _add_chat_template_args(p)
    _add_speculative_arg(p)
    _add_lora_args(p)


def _add_chat_template_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", "--chat-template-file", dest="chat_template", default=None,
                   help="a Jinja chat template (a file, or the template text) to use instead of the model's")
    p.add_argument("--chat-template-kwargs", "--default-chat-template-kwargs", dest="chat_template_kwargs",
                   default=None, metavar="JSON",
                   help="template variables every conversation renders with unless a request sets them, as llama.cpp "
                        "and vLLM take them: e.g. '{\"enable_thinking\": false}'")
    p.add_argument("--reasoning-budget", type=int, default=None,
                   help="llama.cpp's: -1 lets the model think (default), 0 renders conversations with "
                        "enable_thinking false")


def _add_lora_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
                   help="vLLM's: LoRA adapters (PEFT folders or llama.cpp GGUF adapters) requests select by `model`; "
                        "also as JSON, '{\"name\": ..., \"path\": ...}'")
    p.add_argument("--lora", action="append", default=[], metavar="PATH",
                   help="llama.cpp's: a LoRA adapter, named by its file or folder name (repeatable)")
    p.add_argument("--lora-scaled", nargs=2, action="append", default=[], metavar=("PATH", "SCALE"),
                   help="llama.cpp's: a LoRA adapter at a scale (repeatable)")


def _add_quantization_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantization", "-q", default="auto",
                   help="a checkpoint folder's float matrices, quantized once at load: q8_0 (the default for "
                        "bf16/f16/f32 checkpoints and block-wise FP8 ones), q5_k, q5_1, q4_k, q4_1, or none (as "
                        "stored); FP8, NVFP4, 4-bit (W4A16, GPTQ, AWQ) and INT8 checkpoints keep their format unless "
                        "one is named")


def _add_kv_cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-dtype", default=None,
                   help="vLLM's: auto (the activations' dtype, the default) or fp8 (e4m3, one byte a value: twice "
                        "the tokens in the same memory, half the bytes decode attention reads)")
    p.add_argument("-ctk", "--cache-type-k", default=None,
                   help="llama.cpp's: f16, f32, q8_0 (= fp8); default the activations' dtype")
    p.add_argument("-ctv", "--cache-type-v", default=None, help="llama.cpp's: the same types; as -ctk")


def _add_metadata_override_args(p: argparse.ArgumentParser) -> None:
    """llama.cpp's flags that change a GGUF file's metadata at load (loader/metadata_overrides.py)."""
    p.add_argument("--override-kv", action="append", default=None, metavar="KEY=TYPE:VALUE",
                   help="llama.cpp's: set a GGUF metadata key (TYPE int, float, bool or str); may repeat")
    p.add_argument("--rope-freq-base", type=float, default=None, help="llama.cpp's: the rope base (theta)")
    p.add_argument("--rope-scaling", choices=("none", "linear", "yarn"), default=None,
                   help="llama.cpp's: how positions past the trained context are scaled")
    p.add_argument("--rope-scale", type=float, default=None,
                   help="llama.cpp's: stretch the context by this factor (the context length grows with it)")
    p.add_argument("--rope-freq-scale", type=float, default=None,
                   help="llama.cpp's: the same as --rope-scale 1/N")
    for flag, what in (("--yarn-orig-ctx", "the context the model was trained at (default: the file's)"),
                       ("--yarn-beta-fast", "YaRN's high-frequency cut"), ("--yarn-beta-slow", "its low cut"),
                       ("--yarn-attn-factor", "its attention scale")):
        p.add_argument(flag, type=int if flag == "--yarn-orig-ctx" else float, default=None,
                       help=f"llama.cpp's: {what}")


def _add_speculative_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-config", default=None,
                   help='vLLM\'s, speculative decoding by prompt lookup: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 3}\', or by a draft model: '
                        '\'{"model": PATH, "num_speculative_tokens": 4}\' (default: off)')
    p.add_argument("--model-draft", "-md", default=None, metavar="PATH",
                   help="llama.cpp's: a draft model of the same vocabulary for speculative decoding")
    p.add_argument("--draft-max", "--draft", "--draft-n", dest="draft_max", type=int, default=4,
                   help="llama.cpp's: drafts a step with --model-draft (default 4)")


# llama.cpp's samplers beyond temperature, top-k, top-p and min-p (engine/sampler.py, engine/dry.py): its flags, the
# SamplingParams field each sets, and its type (chat and generate take them per run, serve as defaults)
LLAMA_CPP_SAMPLER_FLAGS = ((("--typical", "--typical-p"), "typical_p", float),
                           (("--top-n-sigma",), "top_n_sigma", float),
                           (("--xtc-probability",), "xtc_probability", float),
                           (("--xtc-threshold",), "xtc_threshold", float),
                           (("--dry-multiplier",), "dry_multiplier", float), (("--dry-base",), "dry_base", float),
                           (("--dry-allowed-length",), "dry_allowed_length", int),
                           (("--dry-penalty-last-n",), "dry_penalty_last_n", int),
                           (("--mirostat",), "mirostat", int), (("--mirostat-ent",), "mirostat_tau", float),
                           (("--mirostat-lr",), "mirostat_eta", float),
                           (("--repeat-last-n",), "repeat_last_n", int),
                           (("--dynatemp-range",), "dynatemp_range", float),
                           (("--dynatemp-exp",), "dynatemp_exponent", float))


def _add_sampling_args(p: argparse.ArgumentParser, *, max_tokens: int) -> None:
    p.add_argument("-n", "--max-tokens", type=int, default=max_tokens)
    # unset: a checkpoint's generation_config.json, else _SAMPLING_DEFAULTS
    p.add_argument("--temperature", type=float, default=None, help="default 0.8")
    p.add_argument("--top-k", type=int, default=None, help="default 40")
    p.add_argument("--top-p", type=float, default=None, help="default 0.95")
    p.add_argument("--min-p", type=float, default=None, help="default 0.05")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--repeat-penalty", dest="repetition_penalty", type=float, default=None, help="default 1.0")
    # llama-cli's other samplers (engine/sampler.py, engine/dry.py), off unless given
    for flags, name, kind in LLAMA_CPP_SAMPLER_FLAGS:
        p.add_argument(*flags, dest=name, type=kind, default=None, help=f"{name} (llama-cli's)")
    # Constrained output, with llama-cli's flag names: at most one of these
    constraint = p.add_mutually_exclusive_group()
    constraint.add_argument("--grammar", help="a GBNF (or Lark) grammar the output must follow")
    constraint.add_argument("--grammar-file", help="a file holding such a grammar")
    constraint.add_argument("-j", "--json-schema", help="a JSON schema the output must follow ('{}': any JSON)")
    constraint.add_argument("--json-schema-file", help="a file holding such a schema")


def _read(path: str, flag: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{flag}: cannot read {path}: {e}") from None


def _grammar(args) -> str | None:
    """The grammar of --grammar(-file) / --json-schema(-file), compiled to llguidance's form (None: free text)."""
    from cobatch.engine.grammar import structured_grammar
    if args.grammar is not None or args.grammar_file is not None:
        text = args.grammar if args.grammar is not None else _read(args.grammar_file, "--grammar-file")
        return structured_grammar("grammar", text)
    if args.json_schema is not None or args.json_schema_file is not None:
        text = args.json_schema if args.json_schema is not None else _read(args.json_schema_file, "--json-schema-file")
        return structured_grammar("json", text if text.strip() not in ("", "{}") else '{"type": "object"}')
    return None


_SAMPLING_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.0}


def _sampling(args, model_defaults: dict | None = None, tokenizer=None):
    """The sampling flags; one left unset takes the model's default (generation_config.json), else cobatch's.
    With the tokenizer, DRY's sequence breakers become its tokens that hold one."""
    from cobatch.engine.dry import BreakerIndex
    from cobatch.engine.sampler import SamplingParams, uses_dry
    chosen = {name: getattr(args, name) if getattr(args, name) is not None
              else (model_defaults or {}).get(name, default) for name, default in _SAMPLING_DEFAULTS.items()}
    chosen.update({name: getattr(args, name) for _, name, _ in LLAMA_CPP_SAMPLER_FLAGS
                   if getattr(args, name) is not None})
    from cobatch.loader.lora import adapter_flags
    adapters = adapter_flags(args)
    if len(adapters) > 1:
        raise UserError("chat and generate run through one LoRA adapter (serve takes several)")
    params = SamplingParams(**chosen, seed=args.seed, max_tokens=args.max_tokens, grammar=_grammar(args),
                            adapter=adapters[0][0] if adapters else None)
    try:
        params.validate()
    except ValueError as e:
        raise UserError(str(e)) from None
    if uses_dry(params) and tokenizer is not None:
        params.dry_breaker_ids = BreakerIndex(tokenizer.token_bytes, tokenizer.vocab_size).tokens_holding(
            params.dry_sequence_breakers)
    return params


def _load(args, max_num_seqs: int = 1):
    from cobatch.chat_template import template_kwargs_flags
    from cobatch.engine.speculative import speculative_flags
    from cobatch.llm import LLM, EngineOptions, kv_cache_dtype_arg
    from cobatch.loader.lora import adapter_flags
    from cobatch.loader.metadata_overrides import override_flags
    return LLM.load(args.model, EngineOptions(device=args.device, dtype=args.dtype, ctx=args.ctx,
                                              kv_cache_dtype=kv_cache_dtype_arg(args),
                                              max_num_seqs=max_num_seqs, eager=args.eager,
                                              chat_template=args.chat_template, quantization=args.quantization,
                                              chat_template_kwargs=template_kwargs_flags(args),
                                              speculative=speculative_flags(args),
                                              lora_modules=adapter_flags(args),
                                              metadata_overrides=override_flags(args),
                                              quiet=getattr(args, "quiet", False)))


def _stream(llm, prompt_ids: list[int], params) -> str:
    """Generate and print the continuation as it comes; returns the whole text."""
    engine = llm.engine
    rid = engine.add_request(prompt_ids, params)
    decoder = llm.tokenizer.stream_decoder(skip_special=True)
    pieces = []
    try:
        while engine.has_work():
            for out in engine.step():
                # an end-of-turn token is not printed (a grammar's last token, also finishing with "stop", is)
                if out.request_id == rid and out.new_token is not None and not (
                        out.finish_reason == "stop" and out.new_token in engine.stop_ids):
                    piece = decoder.push(out.new_token)
                    pieces.append(piece)
                    sys.stdout.write(piece)
                    sys.stdout.flush()
    except KeyboardInterrupt:
        engine.abort(rid)
        engine.step()
        raise
    tail = decoder.flush()
    pieces.append(tail)
    sys.stdout.write(tail)
    sys.stdout.flush()
    return "".join(pieces)


def cmd_generate(args) -> int:
    if (args.prompt is None) == (args.prompt_flag is None):
        raise UserError("generate takes one prompt: as its argument or as --prompt")
    args.prompt = args.prompt if args.prompt is not None else args.prompt_flag
    _sampling(args)                   # bad flags fail before the model loads
    llm = _load(args)
    params = _sampling(args, llm.generation_defaults, llm.tokenizer)
    if args.chat:
        ids = llm.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        ids = llm.encode_prompt(args.prompt)
    _stream(llm, ids, params)
    sys.stdout.write("\n")
    return 0


def cmd_chat(args) -> int:
    if args.prompt == "":             # (no prompt at all: the interactive chat)
        raise UserError("prompt is empty")
    _sampling(args)                   # bad flags fail before the model loads
    llm = _load(args)
    params = _sampling(args, llm.generation_defaults, llm.tokenizer)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    if args.prompt:
        messages.append({"role": "user", "content": args.prompt})
        _stream(llm, llm.encode_chat(messages), params)
        sys.stdout.write("\n")
        return 0
    print("cobatch chat: type a message, Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            reply = _stream(llm, llm.encode_chat(messages), params)
        except UserError as e:              # e.g. the conversation outgrew the context
            messages.pop()
            print(f"\ncobatch: {e}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})


def _describe(cfg) -> None:
    """The lines of `cobatch inspect` that a GGUF file and a checkpoint folder share."""
    print(f"name:          {cfg.name}")
    print(f"architecture:  {cfg.arch}")
    print(f"layers:        {cfg.n_layers}   d_model: {cfg.d_model}   ffn: {cfg.ffn_dim}")
    if cfg.mla is not None:
        mla = cfg.mla
        print(f"heads:         {cfg.n_heads}, latent attention (MLA): kv rank {mla.kv_lora_rank}"
              f"{f', q rank {mla.q_lora_rank}' if mla.q_lora_rank else ''}, q/k head {mla.qk_nope_dim} + rope "
              f"{mla.qk_rope_dim}, v head {mla.v_head_dim}")
    else:
        print(f"heads:         {cfg.n_heads} (kv {cfg.n_kv_heads}, head_dim {cfg.head_dim})")
    if cfg.n_experts:
        shared = f", shared expert ffn {cfg.shared_expert_ffn_dim}" if cfg.shared_expert_ffn_dim else ""
        dense = f", the first {cfg.leading_dense_layers} layers dense" if cfg.leading_dense_layers else ""
        print(f"experts:       {cfg.n_experts_used} of {cfg.n_experts} per token, "
              f"expert ffn {cfg.expert_ffn_dim}{shared}{dense}")
        if cfg.mla is not None:
            groups = (f", top {cfg.n_experts_used} within the best {cfg.expert_groups_used} of {cfg.expert_groups} "
                      "groups" if cfg.expert_groups else "")
            print(f"               routed by {cfg.expert_gating}{groups}, weights "
                  f"{'renormalized, ' if cfg.expert_weights_norm else ''}times {cfg.expert_weights_scale:g}")


def _inspect_folder(path: Path) -> int:
    from cobatch.loader.hf import HFCheckpoint
    from cobatch.loader.hf_tokenizer import chat_template_source
    ckpt = HFCheckpoint(path)
    cfg = ckpt.config
    print(f"folder:        {ckpt.path} (Hugging Face checkpoint, {ckpt.model_type})")
    _describe(cfg)
    print(f"vocab:         {cfg.vocab_size}   context: {cfg.context_length}")
    scaling = "  scaling " + cfg.rope_scaling["type"] if cfg.rope_scaling else ""
    print(f"rope:          theta {cfg.rope_theta:g}{scaling}")
    if cfg.sliding_window:
        print(f"attention:     sliding window {cfg.sliding_window}, one layer in {cfg.swa_pattern} global")
    info = ckpt.hf_tensor_info()
    print(f"parameters:    {sum(_prod(shape) for _, _, shape in info) / 1e6:.1f} M (as stored)")
    print(f"weights:       {ckpt.scheme.kind + ' (' + ckpt.scheme.method + ')' if ckpt.scheme else 'float'}; "
          f"float matrices load as {ckpt.quantization} (--quantization)")
    print("tensor types:")
    for dtype, n in Counter(dtype for _, dtype, _ in info).most_common():
        print(f"  {dtype:<8} {n:>5} tensors")
    print(f"chat template: {'yes' if chat_template_source(path) else 'no'}")
    return 0


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def cmd_inspect(args) -> int:
    from cobatch.config import ModelConfig
    from cobatch.loader.gguf import GGUFFile
    from cobatch.model_files import default_model_path
    if args.path and Path(args.path).is_dir():
        return _inspect_folder(Path(args.path))
    f = GGUFFile(args.path or default_model_path())
    cfg = ModelConfig.from_metadata(f.metadata, set(f.tensors))
    md = f.metadata
    print(f"file:          {f.path}")
    _describe(cfg)
    if cfg.n_experts:
        print(f"               on CUDA: {_expert_decode(f, cfg)}")
    print(f"vocab:         {cfg.vocab_size}   context: {cfg.context_length}")
    print(f"rope:          {'neox' if cfg.rope_neox else 'norm'} theta {cfg.rope_theta:g}"
          f"{'  scaling ' + cfg.rope_scaling['type'] if cfg.rope_scaling else ''}"
          f"{'  longrope factors' if 'rope_factors_long.weight' in f.tensors else ''}"
          f"{f'  ({cfg.rope_dim} of {cfg.head_dim} dims)' if cfg.rope_dim != cfg.head_dim else ''}")
    if cfg.sliding_window:
        print(f"attention:     sliding window {cfg.sliding_window}, one layer in {cfg.swa_pattern} global"
              f"{f', scores soft-capped at {cfg.attn_softcap:g}' if cfg.attn_softcap else ''}")
    params = sum(int(t.n_elements) for t in f.tensors.values())
    print(f"parameters:    {params / 1e6:.1f} M")
    counts, sizes = Counter(), Counter()
    for t in f.tensors.values():
        counts[t.tensor_type.name] += 1
        sizes[t.tensor_type.name] += int(t.n_bytes)
    print("tensor types:")
    for name, n in counts.most_common():
        print(f"  {name:<6} {n:>5} tensors  {sizes[name] / 2**20:10.1f} MiB")
    print(f"tokenizer:     {md.get('tokenizer.ggml.model', '?')} (pre: {md.get('tokenizer.ggml.pre', '-')}), "
          f"{len(md.get('tokenizer.ggml.tokens', []))} tokens")
    print(f"chat template: {'yes' if md.get('tokenizer.chat_template') else 'no'}")
    return 0


def _expert_decode(f, cfg) -> str:
    """How the experts decode on CUDA: routed on the device (CUDA graphs) if every layer's expert tensors can be
    stacked for the routed GEMV (kernels/packed_experts.py), else expert by expert (eager), and why."""
    from cobatch.kernels.packed_experts import stackable
    from cobatch.kernels.packed_weight import AS_Q8_0
    blocking, converted = set(), set()
    for i in range(cfg.leading_dense_layers, cfg.n_layers):
        kinds = {x: f.tensors[f"blk.{i}.ffn_{x}_exps.weight"].tensor_type.name.lower() for x in ("gate", "up", "down")}
        if kinds["gate"] != kinds["up"]:
            blocking.add(f"gate {kinds['gate']} and up {kinds['up']} differ")
        for x, rows in (("gate", 2 * cfg.expert_ffn_dim), ("down", cfg.d_model)):
            routed_as = "q8_0" if kinds[x] in AS_Q8_0 else kinds[x]
            if routed_as != kinds[x]:
                converted.add(f"{x} experts {kinds[x]} as {routed_as}")
            if not stackable(routed_as, rows):
                blocking.add(f"{x} experts in {kinds[x]} ({rows} rows)")
    if not blocking:
        note = f" ({'; '.join(sorted(converted))})" if converted else ""
        return "routed on the device, decode in CUDA graphs" + note
    return "expert by expert, decode eager: " + "; ".join(sorted(blocking))


def cmd_make_model(args) -> int:
    from cobatch.testing import gguf_writer
    return gguf_writer.main(args.rest)


def cmd_run_batch(args) -> int:
    from cobatch.server.batch_file import run_batch
    return run_batch(args)


def cmd_serve(args) -> int:
    if getattr(args, "data_parallel_size", 1) != 1:
        from cobatch.parallel import data_parallel
        return data_parallel.serve(args)
    from cobatch.server.app import serve
    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    from cobatch import __version__
    parser = argparse.ArgumentParser(prog="cobatch", description="Batched-decode LLM server for GGUF models and "
                                                                   "Hugging Face checkpoints")
    parser.add_argument("--version", action="version", version=f"cobatch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("chat", help="chat with a model (one answer, or interactive without a prompt)")
    p.add_argument("prompt", nargs="?")
    p.add_argument("--system", help="system message")
    _add_model_args(p)
    _add_sampling_args(p, max_tokens=512)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("generate", help="continue a raw prompt")
    p.add_argument("prompt", nargs="?", help="the prompt (or --prompt)")
    p.add_argument("--prompt", "-p", dest="prompt_flag", metavar="PROMPT", help="the prompt, as llama-cli's -p")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    _add_model_args(p)
    _add_sampling_args(p, max_tokens=128)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("inspect", help="describe a GGUF file or a Hugging Face checkpoint folder")
    p.add_argument("path", nargs="?")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("make-model", help="write a random-weight or layer-cut GGUF (see --help)")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_make_model)

    p = sub.add_parser("serve", help="serve the OpenAI- and Anthropic-compatible HTTP API")
    _add_serve_args(p)
    p.set_defaults(func=cmd_serve)
    parser.serve_parser = p           # for --config, which names serve's flags (run-batch's too)

    p = sub.add_parser("run-batch", help="answer a JSONL file of OpenAI batch requests (vLLM's run-batch)")
    p.add_argument("-i", "--input-file", required=True,
                   help="one request a line: {\"custom_id\", \"method\": \"POST\", \"url\", \"body\"} ('-': stdin)")
    p.add_argument("-o", "--output-file", required=True,
                   help="one answer a line, in the input's order: {\"id\", \"custom_id\", \"response\": "
                        "{\"status_code\", \"request_id\", \"body\"}, \"error\"} ('-': stdout)")
    _add_serve_args(p)
    p.set_defaults(func=cmd_run_batch)
    parser.run_batch_parser = p
    return parser


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    """serve's flags: the model, the engine, the server's options and the requests' defaults (run-batch takes them
    too, its requests answered by the same app)."""
    p.add_argument("model_path", nargs="?", help="a GGUF file or a Hugging Face checkpoint folder (default: "
                                                 "SmolLM2-135M-Instruct)")
    p.add_argument("--model", "-m", help="the same as the positional argument")
    # The names vLLM (--served-model-name, --max-num-seqs, --max-model-len, --max-num-batched-tokens) and llama.cpp's
    # server (--alias, -np, -c/--ctx-size) give these options work too, for users switching over.
    p.add_argument("--model-name", "--alias", "-a", dest="model_name", action="append",
                   help="model id served by /v1/models (default: the file name); repeat it for aliases")
    p.add_argument("--served-model-name", dest="model_name", action="extend", nargs="+",
                   help="vLLM's: one or more names; the first is the id responses carry, requests may give any")
    p.add_argument("--accept-any-model", action="store_true",
                   help="answer requests whatever `model` they name (default: 404 model_not_found for a name "
                        "not served)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--parallel", "-np", "--max-num-seqs", dest="parallel", type=int, default=8,
                   help="slots: requests decoded together in one batched step (default 8)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for a slot before new ones get 429 (default 64)")
    p.add_argument("--ctx", "--max-model-len", "-c", "--ctx-size", dest="ctx", type=int, default=None,
                   help="context window per request, in tokens (0: the model's own; default: that, at most 8192)")
    p.add_argument("--api-key", action="append", default=None,
                   help="require this key (Bearer or x-api-key) on every route but /health, /version, /docs, "
                        "/openapi.json and the web pages' files (the pages ask for it); repeat it for several keys "
                        "(also: $COBATCH_API_KEY)")
    p.add_argument("--api-key-file", default=None, help="a file of accepted keys, one a line")
    p.add_argument("--ssl-keyfile", "--ssl-key-file", dest="ssl_keyfile", default=None,
                   help="TLS private key (PEM); with --ssl-certfile, serve HTTPS (--ssl-key-file: llama.cpp's name)")
    p.add_argument("--ssl-certfile", "--ssl-cert-file", dest="ssl_certfile", default=None,
                   help="TLS certificate chain (PEM)")
    p.add_argument("--root-path", default="",
                   help="vLLM's: the path prefix a proxy serves this server under (ASGI root_path), for the "
                        "links of /docs")
    p.add_argument("--no-docs", "--disable-fastapi-docs", dest="openapi", action="store_false",
                   help="do not serve /openapi.json and /docs (--disable-fastapi-docs: vLLM's name)")
    p.add_argument("--no-webui", dest="webui", action="store_false",
                   help="do not serve the chat page (/) and the dashboard (/dashboard); llama.cpp's name")
    p.add_argument("--webui", dest="webui", action="store_true", default=True,
                   help="llama.cpp's; the chat page and the dashboard are served unless --no-webui")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="vLLM's: every answer carries X-Request-Id, the request's own or a new one")
    p.add_argument("--generation-config", default="auto",
                   help="vLLM's: where requests' unset sampling fields come from after the flags: auto, a "
                        "checkpoint folder's generation_config.json (the default); vllm, none; or a folder's")
    p.add_argument("--metrics-compat", choices=["vllm"], default=None,
                   help="vllm: /metrics also under vLLM's names (vllm:num_requests_running, ...) for its "
                        "dashboards")
    p.add_argument("--config", default=None, help="a YAML file of these flags (max_num_seqs: 16); the command "
                                                  "line wins over it")
    p.add_argument("--allowed-origins", default="*",
                   help="origins browsers may call the API from (CORS), comma-separated or a JSON list; '*' any "
                        "(the default, as vLLM and llama.cpp's server); '' none")
    p.add_argument("--allowed-methods", default="*", help="vLLM's: the methods those origins may use (CORS), as "
                                                          "--allowed-origins (default '*')")
    p.add_argument("--allowed-headers", default="*", help="vLLM's: the request headers they may send (CORS), as "
                                                          "--allowed-origins (default '*')")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default=None, help="activation/KV dtype: f32 | bf16 | f16 (default: bf16 on a GPU, f32 "
                   "on the CPU)")
    _add_quantization_arg(p)
    _add_lora_args(p)
    p.add_argument("--max-loras", type=int, default=0,
                   help="vLLM's: LoRA adapter slots (default: the adapters given, 1 with runtime loading)")
    p.add_argument("--max-lora-rank", type=int, default=0,
                   help="vLLM's: the slots' rank (default: the adapters given, 16 with runtime loading)")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's, which its "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True also turns on)")
    _add_kv_cache_args(p)
    _add_metadata_override_args(p)
    p.add_argument("--slot-save-path", default=None,
                   help="llama.cpp's: the directory of POST /slots/{id}?action=save|restore files (default: refused)")
    p.add_argument("--kv-disk-cache", default=None, metavar="DIR",
                   help="spill prefix-cache KV blocks evicted from the pool to DIR, read them back on a prefix hit; "
                        "they survive a restart on the same model file")
    p.add_argument("--kv-disk-gb", type=float, default=16.0,
                   help="keep --kv-disk-cache under this many GB, oldest files deleted first (default 16)")
    p.add_argument("--kv-cache-gb", type=float, default=None,
                   help="KV pool size in GiB (default: from free memory on CUDA, 1 GiB on CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="CUDA, as vLLM's: weights + KV cache up to this share of the GPU's memory (default: the KV "
                        "cache takes 85 %% of what is free after loading)")
    # llama.cpp server flags that copied commands carry: accepted, and what they mean here
    p.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", dest="gpu_layers", type=int, default=None,
                   help="llama.cpp's: 0 runs on the CPU; any other value, the whole model on the GPU (cobatch does not "
                        "split a model between CPU and GPU)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads for the torch CPU path")
    p.add_argument("--jinja", action="store_true", help="llama.cpp's; chat templates are always rendered with Jinja")
    p.add_argument("-fa", "--flash-attn", nargs="?", const="on", default=None,
                   help="llama.cpp's; attention is always flash attention here")
    for flags, what in ((("-cb", "--cont-batching"), "requests are always batched continuously"),
                        (("--metrics",), "/metrics is always served"), (("--slots",), "/slots is always served"),
                        (("--props",), "GET /props is always served"),
                        (("--embedding", "--embeddings"), "/v1/embeddings is always served"),
                        (("--mlock", "--no-mmap"), "weights are read into memory and repacked at load"),
                        (("--no-context-shift",), "a sequence that fills its context ends there (finish_reason "
                                                  "length); nothing is shifted out"),
                        (("--kv-unified",), "every slot takes its KV blocks from one shared pool"),
                        (("--swa-full",), "sliding-window layers keep the whole context's KV"),
                        (("--offline",), "nothing is downloaded: the model is a local file or folder"),
                        (("--no-perf", "--log-colors"), "without effect here")):
        p.add_argument(*flags, action="store_true", help=f"llama.cpp's; {what}")
    for flags, kind, what in ((("--cache-reuse",), int, "the prefix cache reuses the KV blocks of earlier prompts"),
                              (("-dt", "--defrag-thold"), float, "the paged KV cache does not fragment"),
                              (("--threads-http",), int, "one asyncio loop serves HTTP"),
                              (("-to", "--timeout"), int, "no read or write timeout applies to a request"),
                              (("--numa",), str, "torch places the CPU path's threads")):
        p.add_argument(*flags, type=kind, default=None, help=f"llama.cpp's; {what}")
    p.add_argument("--reasoning-format", choices=("auto", "deepseek", "deepseek-legacy", "none"), default="auto",
                   help="llama.cpp's: none leaves a reply's <think> block in its content; the others give it as "
                        "reasoning_content (Anthropic: thinking blocks), the default")
    p.add_argument("--log-file", default=None, help="llama.cpp's: also append the log to this file")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="llama.cpp's: CUDA, skip the made-up step at load that compiles every kernel variant (the "
                        "first requests then wait for the compiles)")
    p.add_argument("--log-disable", dest="log_level", action="store_const", const="warning", default="info",
                   help="llama.cpp's; only warnings and errors are logged")
    p.add_argument("-v", "--verbose", dest="log_level", action="store_const", const="debug", default="info",
                   help="llama.cpp's; the same as --log-level debug")
    # vLLM flags that copied commands carry: accepted, and what they mean here
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="shard the model over this many GPUs (processes on the CPU), as vLLM's: whole KV heads, a "
                        "slice of the feed-forward and vocabulary per rank; it must divide the KV heads (default 1)")
    p.add_argument("-dp", "--data-parallel-size", type=int, default=1,
                   help="run this many engine replicas (each on its own GPU, or --tensor-parallel-size GPUs) behind "
                        "this one endpoint; a request goes to the replica caching the longest prefix of its prompt, "
                        "else the least loaded (default 1)")
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1,
                   help="vLLM's; cobatch has no pipeline parallelism, so only 1")
    for flags, what in ((("--trust-remote-code",), "cobatch runs no code from a model's files"),
                        (("--enable-prefix-caching",), "the prefix cache is always on"),
                        (("--enable-lora",), "adapters are on whenever --lora-modules names some"),
                        (("--enable-auto-tool-choice",), "tool calls are always parsed when a request declares tools"),
                        (("--disable-log-stats",), "cobatch logs no periodic stats"),
                        (("--enable-chunked-prefill",), "prefill is always chunked (--prefill-chunk)"),
                        (("--enable-log-requests",), "cobatch logs a line per request anyway"),
                        (("--disable-uvicorn-access-log",), "uvicorn's access log is off unless --access-log"),
                        (("--disable-custom-all-reduce",), "tensor parallelism runs torch.distributed's all-reduce"),
                        (("--enable-reasoning",), "a reply's <think> block is always parsed (--reasoning-format)"),
                        (("--disable-frontend-multiprocessing",), "the HTTP side runs on its own thread")):
        p.add_argument(*flags, action="store_true", help=f"vLLM's; {what}")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="vLLM's: logprobs name their tokens \"token_id:ID\" (partial UTF-8 tokens stay apart)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="vLLM's: the most alternatives a request's logprobs, top_logprobs or prompt_logprobs may ask "
                        "for (0-20, default 20)")
    local = "nothing is downloaded: the model is a local file or folder"
    for flag, kind, what in (("--swap-space", float, "a sequence out of KV blocks is recomputed, not swapped out "
                                                     "(--kv-disk-cache spills the prefix cache)"),
                             ("--max-seq-len-to-capture", int, "the decode graphs cover every batch bucket"),
                             ("--download-dir", str, local), ("--load-format", str, local), ("--revision", str, local),
                             ("--distributed-executor-backend", str, "tensor parallelism runs one process a GPU"),
                             ("--block-size", int, "the paged KV cache's blocks are 16 tokens"),
                             ("--preemption-mode", str, "a preempted sequence is recomputed"),
                             ("--compilation-config", str, "decode steps are captured in CUDA graphs (--enforce-eager: "
                                                           "not)"),
                             ("--max-parallel-loading-workers", int, "the weights load in one process"),
                             ("--tokenizer-mode", str, "the model's own tokenizer runs through tokenizers"),
                             ("--chat-template-content-format", str, "messages' content may be a string or a list "
                                                                     "of text parts either way"),
                             ("--guided-decoding-backend", str, "structured output always runs llguidance"),
                             ("--limit-mm-per-prompt", str, "the models served here take text only")):
        p.add_argument(flag, type=kind, default=None, help=f"vLLM's; {what}")
    for flag in ("--tool-call-parser", "--reasoning-parser"):
        p.add_argument(flag, default=None, help="vLLM's; the output's format is recognized whatever it is: Hermes / "
                                                "Qwen <tool_call> tags, Qwen3-Coder's <function=...> parameters, bare "
                                                "JSON calls, Mistral's calls and Phi-4's lists, DeepSeek's call "
                                                "blocks, <think> blocks")
    p.add_argument("--disable-log-requests", action="store_true", help="vLLM's; no log line per request")
    # Sampling defaults for requests that leave a field unset (llama.cpp's server takes its flags the same way)
    for flags, name, kind in ((("--temperature", "--temp"), "temperature", float), (("--top-k",), "top_k", int),
                              (("--top-p",), "top_p", float), (("--min-p",), "min_p", float),
                              *LLAMA_CPP_SAMPLER_FLAGS,
                              (("--repeat-penalty", "--repetition-penalty"), "repetition_penalty", float),
                              (("--presence-penalty",), "presence_penalty", float),
                              (("--frequency-penalty",), "frequency_penalty", float),
                              (("--seed", "-s"), "seed", int),
                              (("-n", "--n-predict", "--max-tokens"), "max_tokens", int)):
        p.add_argument(*flags, dest=f"default_{name}", type=kind, default=None,
                       help=f"default {name} of requests that do not set it")
    p.add_argument("--override-generation-config", default=None,
                   help="vLLM's: the same defaults as JSON, e.g. '{\"temperature\": 0.6, \"max_new_tokens\": 512}' "
                        "(temperature, top_k, top_p, min_p, typical_p, top_n_sigma, xtc_probability, xtc_threshold, "
                        "dry_multiplier, dry_base, dry_allowed_length, dry_penalty_last_n, mirostat, mirostat_tau, "
                        "mirostat_eta, repeat_last_n, dynatemp_range, dynatemp_exponent, repetition_penalty, "
                        "presence_penalty, frequency_penalty, seed, max_new_tokens; "
                        "the flags above win over it)")
    _add_speculative_arg(p)
    p.add_argument("--prefill-chunk", "-ub", "--ubatch-size", dest="prefill_chunk", type=int, default=512,
                   help="most prompt tokens one request prefills per step, so running streams keep going")
    p.add_argument("--max-step-tokens", "--max-num-batched-tokens", "-b", "--batch-size", dest="max_step_tokens",
                   type=int, default=2048, help="token budget of one engine step")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="CUDA: plan and launch each decode step while the previous one runs on the device (default "
                        "on; --no-async-scheduling waits for each step's tokens first)")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="vLLM's: fcfs serves requests in arrival order; priority by each request's `priority` "
                        "(lower first), the least urgent running one giving its KV blocks back when they run out")
    p.add_argument("--eager", "--enforce-eager", dest="eager", action="store_true",
                   help="CUDA: run decode steps without CUDA graphs (debugging)")
    _add_chat_template_args(p)
    p.add_argument("--dense-large-batch", action="store_true",
                   help="CUDA: also keep bf16/f16 weights for steps above the GEMV crossover (more memory, "
                        "faster big batches and prefill)")
    p.add_argument("--max-body-mb", type=float, default=32.0, help="request bodies over this get 413")
    p.add_argument("--graceful-shutdown-s", type=float, default=30,
                   help="on SIGTERM or Ctrl-C, new requests get 503 and running ones get this long to finish; "
                        "then the server exits 0")
    p.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action="store_true", help="uvicorn's access log (a line per request is "
                                                              "logged anyway)")


def main(argv: list[str] | None = None) -> int:
    from cobatch.config_file import expand_config
    from cobatch.model_files import ModelNotFound
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] in (["serve"], ["run-batch"]):
            argv = expand_config(argv, parser.serve_parser if argv[0] == "serve" else parser.run_batch_parser)
    except UserError as e:
        print(f"cobatch: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    args = parser.parse_args(argv)
    args.argv = argv                  # (-dp: the replicas are started with the same flags)
    try:
        for name, low in (("ctx", 0), ("max_tokens", 1)):     # ctx 0: the model's own context
            value = getattr(args, name, None)
            if value is not None and value < low:
                raise UserError(f"--{name.replace('_', '-')} must be at least {low} (got {value})")
        return args.func(args) or 0
    except (UserError, ModelNotFound, ValueError) as e:
        print(f"cobatch: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
