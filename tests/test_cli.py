"""The `cobatch` command end to end, and every bad input ending in one clear line and exit code 2 (in the command's
own process once; the other bad input through its main() in this process)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest

from cobatch.engine.sampler import SamplingParams
from cobatch.model_files import smollm2_path
from model_fixtures import load_llm
from test_server_support import wait_for

SRC = str(Path(__file__).resolve().parents[1] / "src")


def cli_env() -> dict[str, str]:
    """The environment of a `cobatch` process: this tree's package, and torch on as many threads as this test
    process (tests/conftest.py: more than one spins on a busy 2-core machine)."""
    import torch
    return dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OMP_NUM_THREADS=str(torch.get_num_threads()))


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The command in its own process (what a user runs)."""
    return subprocess.run([sys.executable, "-m", "cobatch.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=cli_env(), stdin=subprocess.DEVNULL)


@pytest.fixture
def cli(capsys):
    """The command's main() in this process, its exit code and output as run_cli gives them: for tests of what
    it prints and of its argument checks, without a process start (torch's import alone is most of 5 s)."""
    from cobatch.cli import main

    def run(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as e:         # argparse's own usage errors
            code = e.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["cobatch", *args], code, out, err)
    return run


def assert_clean_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("cobatch: error:")]
    assert len(lines) == 1, proc.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_chat_answers_paris():
    proc = run_cli("chat", "What is the capital of France?", "--temperature", "0", "-n", "24")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout


def test_interactive_chat_keeps_history_and_exits_on_eof():
    proc = subprocess.run([sys.executable, "-m", "cobatch.cli", "chat", "--temperature", "0", "-n", "24"],
                          input="What is the capital of France?\nAnd of Germany?\n", capture_output=True,
                          text=True, timeout=300, env=cli_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout
    assert "Berlin" in proc.stdout      # the second turn only makes sense with the first in the history
    assert proc.stdout.count("> ") >= 2


def test_generate_prints_only_the_continuation(cli):
    proc = run_cli("generate", "--prompt", "The capital of France is", "-n", "8", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "The capital of France is" not in proc.stdout
    assert "Paris" in proc.stdout
    positional = cli("generate", "The capital of France is", "-n", "8", "--temperature", "0")
    assert positional.returncode == 0 and positional.stdout == proc.stdout
    assert_clean_error(cli("generate", "one", "-p", "two"), "one prompt")


def test_generate_takes_llama_clis_samplers(cli):
    """--dry-multiplier: greedy decoding no longer repeats "1, 2, 3, 4" (DRY penalizes the token that extends the
    repeat); the other samplers' flags run (their sampling: tests/test_sampler.py)."""
    prompt = ("generate", "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3,", "-n", "4", "--temperature", "0")
    plain, dry = cli(*prompt), cli(*prompt, "--dry-multiplier", "10")
    assert plain.returncode == dry.returncode == 0, dry.stderr[-2000:]
    assert plain.stdout.startswith(" 4") and not dry.stdout.startswith(" 4")
    others = cli("generate", "Once upon a time", "-n", "6", "--temperature", "1", "--seed", "3", "--typical", "0.9",
                 "--xtc-probability", "0.5", "--mirostat", "2", "--mirostat-ent", "4")
    assert others.returncode == 0 and others.stdout.strip(), others.stderr[-2000:]


def test_generate_with_speculative_decoding_prints_the_same_text(cli):
    prompt = "apple banana cherry dates elderberry fig grape. " * 3 + "apple banana"
    args = ("generate", "--prompt", prompt, "-n", "24", "--temperature", "0")
    plain = cli(*args)
    spec = cli(*args, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}')
    assert plain.returncode == spec.returncode == 0, spec.stderr[-2000:]
    assert spec.stdout == plain.stdout and "cherry" in plain.stdout


def test_inspect_describes_the_file(cli):
    proc = cli("inspect", str(smollm2_path()))
    assert proc.returncode == 0, proc.stderr
    assert "llama" in proc.stdout and "Q4_1" in proc.stdout and "chat template: yes" in proc.stdout


def test_inspect_describes_experts_windows_and_partial_rotary(tmp_path, cli):
    from cobatch.testing.gguf_writer import write_random_model
    for shape, expected in (("qwen2moe-tiny", "experts:       2 of 8 per token, expert ffn 128, shared expert ffn 256"),
                            ("gemma2-tiny", "sliding window 12, one layer in 2 global, scores soft-capped at 0.05"),
                            ("phi4-mini-tiny", "longrope factors  (48 of 64 dims)")):
        path = write_random_model(tmp_path / f"{shape}.gguf", shape, "q8_0", tokenizer_from=smollm2_path())
        proc = cli("inspect", str(path))
        assert proc.returncode == 0, proc.stderr
        assert expected in proc.stdout, proc.stdout


def test_inspect_says_how_experts_decode_on_cuda(tmp_path, cli):
    """q8_0 and q5_1 experts stack for the routed GEMV; in the q4_k file the 128-wide down experts fall back to q5_0
    (K-quants need 256 columns), which it reads too; q2_K experts it does not read (its 128-wide down experts fall
    back to q4_0, which it does)."""
    from cobatch.testing.gguf_writer import write_random_model
    for quant, expected in (("q8_0", "on CUDA: routed on the device, decode in CUDA graphs\n"),
                            ("q4_k", "on CUDA: routed on the device, decode in CUDA graphs\n"),
                            ("q5_1", "on CUDA: routed on the device, decode in CUDA graphs\n"),
                            ("q2_k", "on CUDA: expert by expert, decode eager: gate experts in q2_k (256 rows)\n")):
        path = write_random_model(tmp_path / f"{quant}.gguf", "qwen2moe-tiny", quant, tokenizer_from=smollm2_path())
        proc = cli("inspect", str(path))
        assert proc.returncode == 0, proc.stderr
        assert expected in proc.stdout, proc.stdout


def test_qwen_coder_writes_a_function():
    llm = load_llm("qwen2.5-coder")
    ids = llm.encode_chat([{"role": "user", "content": "Write a Python function that squares a number."}])
    # greedy: "Here's a simple Python function to square a number:\n\n```python\ndef square(" is its first 20
    out = llm.engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=20))[0]
    assert "def " in llm.tokenizer.decode(out)


# --- bad input -----------------------------------------------------------------------------------

def test_missing_model_path(tmp_path):
    """In its own process: the exit code and the one line are what the user's shell sees (the other bad input
    below runs main() in this process)."""
    assert_clean_error(run_cli("generate", "-m", str(tmp_path / "nope.gguf"), "-p", "hi"), "not found")


def test_not_a_gguf_file(tmp_path, cli):
    bad = tmp_path / "model.gguf"
    bad.write_text("this is not a model\n" * 10)
    assert_clean_error(cli("generate", "-m", str(bad), "-p", "hi"), "not a GGUF")


def test_truncated_gguf(tmp_path, cli):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path(), "rb") as f:
        cut.write_bytes(f.read(8 << 20))
    assert_clean_error(cli("generate", "-m", str(cut), "-p", "hi"), "truncated")


def _write_gguf(path: Path, arch: str, tensor_type: gguf.GGMLQuantizationType) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    size = gguf.GGML_QUANT_SIZES[tensor_type]
    raw = np.random.default_rng(0).integers(0, 255, size=(32, 256 // size[0] * size[1]), dtype=np.uint8)
    w.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_architecture(tmp_path, cli):
    path = tmp_path / "mamba.gguf"
    _write_gguf(path, "mamba", gguf.GGMLQuantizationType.Q8_0)
    assert_clean_error(cli("generate", "-m", str(path), "-p", "hi"), "unsupported architecture", "mamba")


def test_unsupported_quant_type(tmp_path, cli):
    path = tmp_path / "iq.gguf"
    _write_gguf(path, "llama", gguf.GGMLQuantizationType.IQ2_XS)
    assert_clean_error(cli("generate", "-m", str(path), "-p", "x"), "IQ2_XS")


def test_empty_prompt(cli):
    """`chat ""` (a script's unset variable) is an error as `generate ""` is, not an interactive chat waiting on
    stdin."""
    assert_clean_error(cli("chat", ""), "prompt is empty")


def test_prompt_longer_than_context(cli):
    assert_clean_error(cli("generate", "--ctx", "16", "-p", "word " * 40), "context")


def test_context_over_the_models_and_an_unknown_device(cli):
    """Not an out-of-memory traceback building a table for 10^8 positions, nor torch's own for a device name."""
    assert_clean_error(cli("generate", "--ctx", "100000000", "-p", "hi"), "over the model's context length (8192)")
    assert_clean_error(cli("generate", "--device", "tpu", "-p", "hi"), "choose auto, cpu or cuda")


def test_serve_port_out_of_range(cli):
    assert_clean_error(cli("serve", "--port", "99999"), "65535")


def test_serve_port_in_use_fails_before_the_model_loads(cli):
    # The default model: the port's error coming before any "loading" line shows the socket is bound first.
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        proc = cli("serve", "--port", str(port))
    assert_clean_error(proc, "cannot listen", str(port))
    assert "cobatch loading" not in proc.stderr


@pytest.mark.parametrize("kind", ["missing", "folder without config.json", "not gguf"])
def test_serve_with_a_model_that_cannot_load_fails_before_it_listens(tmp_path, cli, kind):
    """One line and exit code 2 before the port is bound, not a server that starts, answers 503 and stops."""
    path = {"missing": tmp_path / "nope.gguf", "folder without config.json": tmp_path,
            "not gguf": tmp_path / "notes.txt"}[kind]
    if kind == "not gguf":
        path.write_text("hello")
    proc = cli("serve", str(path), "--port", "0")
    assert_clean_error(proc, {"missing": "not found", "folder without config.json": "no config.json",
                              "not gguf": "bad magic"}[kind])
    assert "Started server process" not in proc.stderr and "cobatch loading" not in proc.stderr


def test_serve_answers_on_the_port_it_prints():
    """`cobatch serve --port 0` end to end: the OS picks a port, the banner names it, the server answers there."""
    proc = subprocess.Popen([sys.executable, "-m", "cobatch.cli", "serve", "--port", "0", "--parallel", "2",
                             "--ctx", "512"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=cli_env())
    try:
        url = None
        for line in proc.stderr:             # blocks until the banner (or EOF if the server died)
            if line.strip().startswith("url:"):
                url = line.split()[1]
                break
        assert url is not None and not url.endswith(":0/v1"), "no banner with a real port"
        # The socket listens already; /health answers 503 until the model is loaded
        wait_for(lambda: httpx.get(url.removesuffix("/v1") + "/health").status_code == 200, 120, "the model")
        models = httpx.get(url + "/models", timeout=120).json()
        assert models["data"][0]["max_model_len"] == 512
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.parametrize("flag,value", [("--temperature", "-1"), ("--top-p", "1.5"), ("-n", "0"), ("--mirostat", "3"),
                                        ("--dry-base", "0.5"), ("--typical", "0")])
def test_bad_sampling_flag(flag, value, cli):
    assert_clean_error(cli("generate", "-p", "hi", flag, value))


def test_chat_template_override(tmp_path, cli):
    """--chat-template replaces the model's template (given as a file or as text); one that does not compile
    is one clear error line."""
    from cobatch.llm import LLM, EngineOptions
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
               "<|im_start|>assistant\nSure! The answer is"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    for given in (str(path), template):
        llm = LLM.load(smollm2_path(), EngineOptions(device="cpu", ctx=256, quiet=True, chat_template=given))
        ids = llm.encode_chat([{"role": "user", "content": "Hi"}])
        assert llm.tokenizer.decode(ids).endswith("<|im_start|>assistant\nSure! The answer is")
    proc = cli("chat", "hello", "-n", "2", "--chat-template", "{% for m in messages %}")
    assert_clean_error(proc, "--chat-template")


def test_serve_renders_every_conversation_with_the_default_template_variables(cli):
    """serve --default-chat-template-kwargs / --chat-template-kwargs (and --reasoning-budget 0): the variables reach
    every conversation the server renders, /apply-template and chat alike, and a request's chat_template_kwargs
    win; --chat-template-file is --chat-template; bad values are one clear line and exit code 2."""
    import httpx
    from cobatch.cli import build_parser
    from cobatch.llm import LLM
    from cobatch.server.app import engine_options
    from cobatch.server.context import ServerOptions
    from test_server_support import live_server
    template = ("{{ 'THINK' if enable_thinking | default(true) else 'PLAIN' }}{{ reasoning_effort | default('') }}"
                "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "<|im_start|>assistant\n")
    for flags in (["--default-chat-template-kwargs", '{"enable_thinking": false}'], ["--reasoning-budget", "0"]):
        args = build_parser().parse_args(["serve", "--device", "cpu", "--ctx", "256", "--chat-template-file",
                                          template, *flags])
        with live_server(LLM.load(smollm2_path(), engine_options(args)), ServerOptions()) as srv:
            messages = [{"role": "user", "content": "Hi"}]
            plain = httpx.post(srv.url + "/apply-template", json={"messages": messages}).json()["prompt"]
            assert plain.startswith("PLAIN<|im_start|>user"), flags
            ids = httpx.post(srv.url + "/tokenize", json={"messages": messages, "chat_template_kwargs": {
                "enable_thinking": True}}).json()["tokens"]
            assert srv.context.llm.tokenizer.decode(ids).startswith("THINK"), flags
            # a request's reasoning effort is the template's reasoning_effort, on the chat and Responses routes
            usage = {effort: httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
                "messages": messages, "max_tokens": 1, **({"reasoning_effort": effort} if effort else {})}).json()[
                "usage"]["prompt_tokens"] for effort in (None, "high")}
            assert usage["high"] > usage[None], flags
            responses = httpx.post(srv.url + "/v1/responses", timeout=120, json={
                "input": "Hi", "max_output_tokens": 1, "reasoning": {"effort": "high"}}).json()
            assert responses["usage"]["input_tokens"] == usage["high"], flags
    for bad in (["--chat-template-kwargs", "{not json"], ["--reasoning-budget", "512"]):
        assert_clean_error(cli("chat", "hello", "-n", "1", *bad), bad[0])


def test_reasoning_format_none_leaves_the_thoughts_in_the_content():
    """A template that opens a <think> block: the reply is reasoning (reasoning_content) by default, and with
    llama.cpp's --reasoning-format none the same text stays in the content."""
    import httpx
    from cobatch.cli import build_parser
    from cobatch.llm import LLM
    from cobatch.server.app import engine_options, server_options
    from test_server_support import live_server
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "<|im_start|>assistant\n<think>\n")
    replies = {}
    for fmt in ("auto", "none"):
        args = build_parser().parse_args(["serve", "--device", "cpu", "--ctx", "256", "--chat-template", template,
                                          "--reasoning-format", fmt])
        with live_server(LLM.load(smollm2_path(), engine_options(args)), server_options(args)) as srv:
            replies[fmt] = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}).json()
    thought = replies["auto"]["choices"][0]["message"]
    plain = replies["none"]["choices"][0]["message"]
    assert thought["reasoning_content"] and not thought["content"]
    assert plain["content"] == thought["reasoning_content"] and "reasoning_content" not in plain


def test_max_logprobs_caps_what_a_request_may_ask(cli):
    """vLLM's --max-logprobs: top_logprobs, logprobs and prompt_logprobs above it are a 400 naming the field; up to
    it they are answered; the flag takes 0-20 (OpenAI's cap), anything else is one clear line and exit code 2."""
    import openai
    from cobatch.cli import build_parser
    from cobatch.llm import LLM, EngineOptions
    from cobatch.server.app import server_options
    from test_server_support import live_server
    args = build_parser().parse_args(["serve", "--max-logprobs", "2", "--accept-any-model"])
    with live_server(LLM.load(smollm2_path(), EngineOptions(device="cpu", ctx=256, quiet=True)),
                     server_options(args)) as srv:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        chat = oai.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                           logprobs=True, top_logprobs=2)
        assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 2
        for call in (lambda: oai.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}],
                                                         max_tokens=1, logprobs=True, top_logprobs=3),
                     lambda: oai.completions.create(model="any", prompt="Hi", max_tokens=1, logprobs=3),
                     lambda: oai.completions.create(model="any", prompt="Hi", max_tokens=1,
                                                    extra_body={"prompt_logprobs": 3})):
            with pytest.raises(openai.BadRequestError) as err:
                call()
            assert err.value.body["param"] in ("top_logprobs", "logprobs", "prompt_logprobs")
    assert_clean_error(cli("serve", "--max-logprobs", "50"), "--max-logprobs")


def test_serve_takes_vllm_and_llama_cpp_option_names():
    from cobatch.cli import build_parser
    ours = build_parser().parse_args(["serve", "--model-name", "m", "--parallel", "4", "--ctx", "2048",
                                      "--max-step-tokens", "1024"])
    for theirs in (["--served-model-name", "m", "--max-num-seqs", "4", "--max-model-len", "2048",
                    "--max-num-batched-tokens", "1024"],
                   ["--alias", "m", "-np", "4", "-c", "2048", "--max-step-tokens", "1024"],
                   ["-a", "m", "--parallel", "4", "--ctx-size", "2048", "--max-step-tokens", "1024"]):
        args = build_parser().parse_args(["serve", *theirs])
        assert (args.model_name, args.parallel, args.ctx, args.max_step_tokens) == \
            (ours.model_name, ours.parallel, ours.ctx, ours.max_step_tokens) == (["m"], 4, 2048, 1024), theirs


def test_serve_takes_llama_cpp_flags_that_copied_commands_carry():
    from cobatch.cli import build_parser
    from cobatch.server.app import _device
    args = build_parser().parse_args(["serve", "-m", "x.gguf", "-ngl", "99", "-t", "4", "--jinja", "-fa", "-c", "4096"])
    assert (args.gpu_layers, args.threads, args.jinja, args.flash_attn, args.ctx) == (99, 4, True, "on", 4096)
    assert _device(args) == "auto"
    assert _device(build_parser().parse_args(["serve", "-ngl", "0"])) == "cpu"
    assert build_parser().parse_args(["serve", "-fa", "off"]).flash_attn == "off"


def test_serve_async_scheduling_flag():
    """Overlapped steps are on unless --no-async-scheduling (vLLM's flag) turns them off."""
    from cobatch.cli import build_parser
    from cobatch.server.app import engine_options
    assert engine_options(build_parser().parse_args(["serve"])).overlap_steps is True
    assert engine_options(build_parser().parse_args(["serve", "--no-async-scheduling"])).overlap_steps is False
    assert engine_options(build_parser().parse_args(["serve", "--async-scheduling"])).overlap_steps is True


def test_serve_takes_more_llama_cpp_flags():
    from cobatch.cli import build_parser
    args = build_parser().parse_args(["serve", "-cb", "--metrics", "--slots", "--no-webui", "--mlock", "--no-mmap",
                                      "-b", "1024", "-ub", "256", "-v", "--props", "--embeddings", "--cache-reuse",
                                      "256", "-dt", "0.1", "--threads-http", "4", "-to", "600"])
    assert (args.max_step_tokens, args.prefill_chunk, args.log_level) == (1024, 256, "debug")
    assert build_parser().parse_args(["serve"]).log_level == "info"
    assert build_parser().parse_args(["serve", "--log-disable"]).log_level == "warning"
    assert (args.webui, build_parser().parse_args(["serve"]).webui) == (False, True)


def test_kv_cache_dtype_takes_vllm_and_llama_cpp_flags():
    """vLLM's --kv-cache-dtype, or llama.cpp's -ctk / -ctv (both the same; q8_0 is cobatch's 8-bit cache, fp8)."""
    from cobatch.cli import build_parser
    from cobatch.llm import kv_cache_dtype_arg
    for command in ("serve", "chat"):
        for flags, want in ((["--kv-cache-dtype", "fp8"], "fp8"), ([], "auto"),
                            (["-ctk", "q8_0", "-ctv", "q8_0"], "fp8"),
                            (["--cache-type-k", "f16", "--cache-type-v", "f16"], "auto"),
                            (["-ctk", "f32", "-ctv", "f32"], "f32")):
            args = build_parser().parse_args([command, *flags])
            assert kv_cache_dtype_arg(args) == want, (command, flags)


def test_bad_kv_cache_dtype_fails_before_the_model_loads(cli):
    assert_clean_error(cli("chat", "hi", "--model", "/nonexistent.gguf", "--kv-cache-dtype", "int4"),
                       "--kv-cache-dtype")


def test_a_gpu_older_than_the_kernels_is_refused_or_passed_over(monkeypatch, capsys):
    """A T4 (compute capability 7.5) compiles neither the GEMV's MMA nor bf16: --device auto runs on the CPU and
    says why in one line, --device cuda is one clear error; an Ampere or later GPU is taken."""
    import torch
    from cobatch.errors import UserError
    from cobatch.llm import activation_dtype, gpu_note, resolve_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (7, 5))
    assert resolve_device("auto") == torch.device("cpu")
    assert "Tesla T4 (compute capability 7.5)" in capsys.readouterr().err
    for name in ("cuda", "cuda:0"):
        with pytest.raises(UserError, match="older than the GPU kernels need.*--device cpu"):
            resolve_device(name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    assert resolve_device("auto") == torch.device("cuda") and resolve_device("cuda:0") == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: type("P", (), {
        "multi_processor_count": 108})())
    assert gpu_note(0) == ("NVIDIA A100 (compute capability 8.0, 108 SMs): the GEMV and attention; past 16 rows, "
                           "dequantize + cuBLAS; an fp8 KV cache as bytes")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    assert gpu_note(0).endswith("(compute capability 9.0, 108 SMs): the GEMV, the mid-batch GEMM and attention")
    assert activation_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert activation_dtype(None, torch.device("cpu")) == torch.float32
    with pytest.raises(UserError, match="unknown dtype"):
        activation_dtype("fp64", torch.device("cpu"))


def test_override_generation_config_gives_the_defaults_and_the_flags_win():
    from cobatch.cli import build_parser
    from cobatch.server.app import sampling_defaults
    args = build_parser().parse_args(["serve", "--override-generation-config",
                                      '{"temperature": 0.6, "top_k": 20, "max_new_tokens": 64}', "--temp", "0.3"])
    assert sampling_defaults(args) == {"temperature": 0.3, "top_k": 20, "max_tokens": 64}


def test_metadata_override_flags_load_or_fail_in_one_line(cli):
    """llama.cpp's --override-kv and rope flags on generate: a bad override, or a context past the file's without a
    scale, is one clear line and exit code 2; with --rope-scale 2 the doubled context loads."""
    assert_clean_error(cli("generate", "hi", "-n", "1", "--device", "cpu", "--override-kv", "llama.x=int:y"),
                       "--override-kv")
    assert_clean_error(cli("generate", "hi", "-n", "1", "--device", "cpu", "--ctx", "16384"), "--ctx")
    proc = cli("generate", "hi", "-n", "1", "--device", "cpu", "--ctx", "16384", "--rope-scale", "2",
               "--temp", "0")
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_generation_config_folder_and_penalty_flags_give_the_defaults(tmp_path):
    """vLLM's --generation-config DIR reads DIR/generation_config.json under the flags; llama.cpp's
    --presence-penalty / --frequency-penalty are defaults too; a folder without the file is one clear line."""
    from cobatch.cli import build_parser
    from cobatch.errors import UserError
    from cobatch.server.app import sampling_defaults
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.9, "do_sample": true}')
    args = build_parser().parse_args(["serve", "--generation-config", str(tmp_path), "--temp", "0.3",
                                      "--presence-penalty", "0.5", "--frequency-penalty", "0.25"])
    assert sampling_defaults(args) == {"temperature": 0.3, "top_p": 0.9, "presence_penalty": 0.5,
                                       "frequency_penalty": 0.25}
    with pytest.raises(UserError, match="--generation-config"):
        sampling_defaults(build_parser().parse_args(["serve", "--generation-config", str(tmp_path / "none")]))


def test_serve_takes_vllm_flags_that_copied_commands_carry():
    import logging

    from cobatch.cli import build_parser
    from cobatch.server.app import configure_logging
    args = build_parser().parse_args([
        "serve", "--model", "x.gguf", "--tensor-parallel-size", "1", "--trust-remote-code", "--enforce-eager",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_r1",
        "--enable-prefix-caching", "--disable-log-requests", "--disable-log-stats", "--uvicorn-log-level", "warning",
        "--enable-chunked-prefill", "--swap-space", "4", "--max-seq-len-to-capture", "8192", "--download-dir", "/d",
        "--load-format", "auto", "--revision", "main", "--distributed-executor-backend", "mp",
        "--disable-custom-all-reduce", "--disable-uvicorn-access-log", "--disable-fastapi-docs", "--root-path",
        "/llm", "--ssl-key-file", "k.pem", "--ssl-cert-file", "c.pem", "--webui", "--block-size", "16",
        "--preemption-mode", "recompute", "--compilation-config", '{"level": 3}', "--guided-decoding-backend",
        "xgrammar", "--enable-reasoning", "--tokenizer-mode", "auto", "--no-context-shift", "--numa", "distribute"])
    assert (args.eager, args.tensor_parallel_size, args.log_level) == (True, 1, "warning")
    assert (args.openapi, args.root_path, args.ssl_keyfile, args.ssl_certfile, args.webui) == (
        False, "/llm", "k.pem", "c.pem", True)
    assert not args.access_log
    requests = logging.getLogger("cobatch.server.requests")
    try:
        configure_logging(args)                # the per-request lines (info) are dropped ...
        assert requests.level == logging.WARNING
        configure_logging(build_parser().parse_args(["serve"]))     # ... unless asked to: the server's level
        assert requests.level == logging.NOTSET
    finally:
        requests.setLevel(logging.NOTSET)


@pytest.mark.parametrize("flags, message", [(["-ngl", "0", "--device", "cuda"], "-ngl 0"),
                                            (["--tensor-parallel-size", "0"], "at least 1"),
                                            (["--temp", "-1"], "temperature"),
                                            (["--top-p", "0"], "top_p"),
                                            (["-n", "0"], "max_tokens"),
                                            (["--override-generation-config", '{"max_length": 9}'], "max_length"),
                                            (["--override-generation-config", "{bad"], "not JSON"),
                                            (["-pp", "4"], "no pipeline parallelism"),
                                            (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
                                            (["--threads", "0"], "--threads"),
                                            (["--speculative-config", "{bad"], "--speculative-config"),
                                            (["--speculative-config",
                                              '{"method": "eagle", "num_speculative_tokens": 2}'], "not supported"),
                                            (["--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype"),
                                            (["-ctk", "q4_0", "-ctv", "q4_0"], "-ctk q4_0"),
                                            (["-ctk", "q8_0"], "one dtype"),
                                            (["-ctk", "q8_0", "-ctv", "q8_0", "--kv-cache-dtype", "f16"],
                                             "contradicts")])
def test_contradicting_or_bad_serve_flags_fail_before_the_model_loads(flags, message, cli):
    proc = cli("serve", "--model", "/nonexistent.gguf", *flags)
    assert_clean_error(proc, message)


def test_gpu_memory_utilization_sizes_the_kv_cache(monkeypatch):
    """vLLM's --gpu-memory-utilization: the KV cache gets that share of the whole GPU less what the loaded
    weights already use; a share they already exceed is a clear error."""
    import torch

    from cobatch.errors import UserError
    from cobatch.llm import EngineOptions, kv_budget_bytes
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 100 * gib))   # 40 GiB in use
    cuda = torch.device("cuda")
    assert kv_budget_bytes(EngineOptions(gpu_memory_utilization=0.9), cuda, 0) == 50 * gib
    assert kv_budget_bytes(EngineOptions(), cuda, 0) == int(60 * gib * 0.85)
    assert kv_budget_bytes(EngineOptions(kv_cache_gb=2.0, gpu_memory_utilization=0.9), cuda, 0) == 2 * gib
    with pytest.raises(UserError, match="no room"):
        kv_budget_bytes(EngineOptions(gpu_memory_utilization=0.3), cuda, 0)
    assert kv_budget_bytes(EngineOptions(), torch.device("cpu"), 5000) == 5000


def test_generate_and_chat_follow_a_grammar_or_json_schema(tmp_path, cli):
    """llama-cli's flag names; each output checked by Python's own parsers, not by llguidance."""
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = cli("generate", "--prompt", "A cat as JSON:", "-n", "60", "--temperature", "0", "--json-schema",
            json.dumps(schema))
    assert r.returncode == 0, r.stderr
    value = json.loads(r.stdout)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    grammar = tmp_path / "yes_no.gbnf"
    grammar.write_text('root ::= ("yes" | "no") "."\n')
    r = cli("chat", "Is Paris in France?", "--temperature", "0", "--grammar-file", str(grammar))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() in ("yes.", "no.")


@pytest.mark.parametrize("flags,message", [
    (["--grammar", "root ::= (("], "invalid grammar"),
    (["--grammar-file", "/nonexistent/g.gbnf"], "cannot read"),
    (["--json-schema", "{not json"], "not valid JSON"),
])
def test_bad_grammar_flags_fail_before_the_model_loads(flags, message, cli):
    r = cli("chat", "hi", *flags)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cobatch: error:") and message in lines[0], r.stderr


def test_running_out_of_gpu_memory_at_load_is_one_clear_line(cli, monkeypatch):
    """torch's out-of-memory error while a model loads (here raised where the prefill graphs are captured) is one
    line saying what must fit the GPU, exit 2, not a traceback: the first sentence of torch's message kept."""
    import torch
    from cobatch import llm

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity "
                                     "of 79.19 GiB of which 1.25 GiB is free.\nIncluding non-PyTorch memory ...")
    monkeypatch.setattr(llm, "_capture_step_graphs", out_of_memory)
    assert_clean_error(cli("generate", "hi", "-n", "1"), "out of GPU memory while loading the model",
                       "Tried to allocate 20.00 GiB", "--kv-cache-gb", "--eager")
    assert "1.25 GiB is free" not in cli("generate", "hi", "-n", "1").stderr
