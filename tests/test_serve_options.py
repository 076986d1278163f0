"""serve's operator knobs: --config YAML, API keys (repeated, file, environment), TLS files, --version,
--chat-template names, -c 0, and /metrics under vLLM's names."""

from __future__ import annotations

import json
import subprocess

import httpx
import openai
import pytest

from cobatch.builtin_templates import BUILTIN_TEMPLATES
from cobatch.chat_template import ChatTemplate
from cobatch.cli import build_parser, main
from cobatch.config_file import expand_config
from cobatch.errors import UserError
from cobatch.server.app import _tls, api_keys
from cobatch.server.context import ServerOptions
from model_fixtures import load_llm
from test_server_support import live_server, metric

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _one_error_line(capsys, *needles: str) -> None:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("cobatch: error:"), err
    for needle in needles:
        assert needle in lines[0], lines[0]


def _serve_args(*argv: str):
    parser = build_parser()
    return parser.parse_args(expand_config(["serve", *argv], parser.serve_parser))


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == "cobatch 0.1.0"


def test_config_file_gives_the_same_flags_and_the_command_line_wins(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("max_num_seqs: 16\nmax-queue: 3\nserved_model_name: [a, b]\naccept_any_model: true\n"
                      "async_scheduling: false\napi_key: [k1, k2]\n")
    args = _serve_args("--config", str(config), "--max-num-seqs", "4")
    assert (args.parallel, args.max_queue, args.model_name) == (4, 3, ["a", "b"])
    assert args.accept_any_model is True and args.async_scheduling is False and args.api_key == ["k1", "k2"]
    # a repeatable flag on the command line replaces the file's list, not adds to it
    args = _serve_args("--config", str(config), "--served-model-name", "c", "--api-key=k3")
    assert (args.model_name, args.api_key, args.parallel) == (["c"], ["k3"], 16)


def test_config_file_mapping_is_the_json_a_flag_takes(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("chat_template_kwargs: {enable_thinking: false}\n")
    assert json.loads(_serve_args("--config", str(config)).chat_template_kwargs) == {"enable_thinking": False}


@pytest.mark.parametrize("text,needle", [("max_num_sequences: 4\n", "max_num_sequences"), ("[1, 2]\n", "mapping"),
                                          ("a: [\n", "not YAML"), (b"port: 1\n\xff\n", "not YAML"),
                                          ("eager: yes please\n", "eager: true or false"),
                                          ("model: [a.gguf, b.gguf]\n", "model: one value, not a list")])
def test_bad_config_file_is_one_error_line(tmp_path, capsys, text, needle):
    config = tmp_path / "bad.yaml"
    config.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert main(["serve", "--config", str(config)]) == 2
    _one_error_line(capsys, needle)


def test_config_is_one_file(tmp_path, capsys):
    config = tmp_path / "serve.yaml"
    config.write_text("max_num_seqs: 2\n")
    assert main(["serve", "--config", str(config), "--config", str(config)]) == 2
    _one_error_line(capsys, "one file, not 2")
    assert main(["serve", "--config="]) == 2
    _one_error_line(capsys, "--config needs a file")


def test_api_keys_from_flags_file_and_environment(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("# ops\nfile-key-1\n\nfile-key-2\n")
    monkeypatch.setenv("COBATCH_API_KEY", "env-key")
    args = _serve_args("--api-key", "a", "--api-key", "b", "--api-key-file", str(keys))
    assert api_keys(args) == ("a", "b", "file-key-1", "file-key-2", "env-key")
    monkeypatch.setenv("COBATCH_API_KEY", "")                   # empty: no key from the environment
    assert api_keys(_serve_args()) == ()
    monkeypatch.setenv("COBATCH_API_KEY", "  ")
    with pytest.raises(UserError, match=r"\$COBATCH_API_KEY holds only spaces"):
        api_keys(_serve_args())


def test_every_key_is_accepted_and_others_are_not():
    with live_server(load_llm("smollm2"), ServerOptions(api_keys=("first", "second"))) as srv:
        for key in ("first", "second"):
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)
            assert client.chat.completions.create(model="m", messages=QUESTION, max_tokens=2).choices
        wrong = openai.OpenAI(base_url=srv.url + "/v1", api_key="firs", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        assert httpx.get(srv.url + "/openapi.json").status_code == 200      # the spec stays open


def test_tls_files_are_checked_before_the_model_loads(tmp_path, capsys):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost"], check=True, capture_output=True)
    assert _tls(_serve_args("--ssl-keyfile", str(key), "--ssl-certfile", str(cert))) == {
        "ssl_keyfile": str(key), "ssl_certfile": str(cert)}
    assert main(["serve", "--ssl-keyfile", str(key)]) == 2
    _one_error_line(capsys, "--ssl-certfile")
    assert main(["serve", "--ssl-keyfile", str(cert), "--ssl-certfile", str(key)]) == 2     # swapped
    _one_error_line(capsys, "cannot load")


def test_chat_template_names_and_a_clear_error(capsys):
    chatml = ChatTemplate(BUILTIN_TEMPLATES["chatml"]).render([{"role": "user", "content": "Hi"}])
    assert chatml == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    llama3 = ChatTemplate(BUILTIN_TEMPLATES["llama3"], bos_token="<|begin_of_text|>").render(
        [{"role": "user", "content": "Hi"}])
    assert llama3 == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                      "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert main(["serve", "--chat-template", "chatm1"]) == 2
    _one_error_line(capsys, "chatm1", "chatml")


def test_ctx_0_is_accepted_and_negative_is_not(capsys):
    assert _serve_args("-c", "0").ctx == 0
    assert main(["generate", "-p", "hi", "--ctx", "-1"]) == 2
    _one_error_line(capsys, "--ctx", "at least 0")


def test_metrics_under_vllm_names():
    options = ServerOptions(model_name="smol", metrics_compat="vllm")
    with live_server(load_llm("smollm2"), options) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=3, temperature=0)
        label = {"model_name": "smol"}
        assert metric(srv.url, "vllm:prompt_tokens_total", label) == out.usage.prompt_tokens
        assert metric(srv.url, "vllm:generation_tokens_total", label) == out.usage.completion_tokens == 3
        assert metric(srv.url, "cobatch_generation_tokens_total") == 3
        assert metric(srv.url, "vllm:time_to_first_token_seconds_count", label) == 1
        assert metric(srv.url, "vllm:inter_token_latency_seconds_count", label) == 2
        text = httpx.get(srv.url + "/metrics").text
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:gpu_cache_usage_perc"):
            assert f'{name}{{model_name="smol"}} 0.0' in text, name
    with live_server(load_llm("smollm2")) as srv:
        assert "vllm:" not in httpx.get(srv.url + "/metrics").text
