"""The server's lifecycle: 503 while the model loads, 503 while draining, exit status 0 after SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import anthropic
import httpx
import openai
import pytest

from cobatch.server.app import create_app
from cobatch.server.http_thread import ServerThread
from cobatch.server.lifecycle import DrainingServer, Lifecycle, LoadingApp
from model_fixtures import load_llm
from test_cli import SRC, assert_clean_error, run_cli
from test_server_support import wait_for

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _clients(url: str):
    return (openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60),
            anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60))


def test_503_while_the_model_loads_then_ready():
    released = threading.Event()
    lifecycle = Lifecycle("loading")

    def load():
        released.wait(60)
        return load_llm("smollm2")

    holder = {}
    app = LoadingApp(load, lambda llm: create_app(llm, lifecycle=lifecycle), lifecycle,
                     on_failure=lambda: setattr(holder["thread"].server, "should_exit", True))
    with ServerThread(app) as thread:
        holder["thread"] = thread
        oai, claude = _clients(thread.url)
        health = httpx.get(thread.url + "/health")
        assert (health.status_code, health.json()) == (503, {"status": "loading"})
        with pytest.raises(openai.APIStatusError) as err:
            oai.chat.completions.create(model="m", messages=QUESTION, max_tokens=2)
        assert err.value.status_code == 503 and "loading" in err.value.body["message"]
        with pytest.raises(anthropic.APIStatusError) as err:
            claude.messages.create(model="m", messages=QUESTION, max_tokens=2)
        assert err.value.status_code == 503
        assert err.value.body["type"] == "error" and "loading" in err.value.body["error"]["message"]

        released.set()
        wait_for(lambda: httpx.get(thread.url + "/health").status_code == 200, 120, "the model to load")
        out = oai.chat.completions.create(model="m", messages=QUESTION, max_tokens=8, temperature=0)
        assert "Paris" in out.choices[0].message.content


def test_a_failed_load_stops_the_server_with_one_error_line(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    assert_clean_error(run_cli("serve", "--port", "0", "--model", str(bad)), "broken.gguf")


def test_drain_turns_new_requests_away_and_finishes_those_in_flight():
    lifecycle = Lifecycle("ready")
    app = create_app(load_llm("smollm2"), lifecycle=lifecycle)
    with ServerThread(app, make_server=lambda cfg: DrainingServer(cfg, lifecycle, grace_s=60)) as thread:
        oai, claude = _clients(thread.url)
        stream = oai.chat.completions.create(model="m", messages=QUESTION, max_tokens=24, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
        first = next(iter(stream))
        assert first.choices[0].delta.role == "assistant"
        assert lifecycle.in_flight == 1
        thread.server.begin_drain()

        health = httpx.get(thread.url + "/health")
        assert (health.status_code, health.json()) == (503, {"status": "draining"})
        with pytest.raises(openai.APIStatusError) as err:
            oai.completions.create(model="m", prompt="Hi", max_tokens=2)
        assert err.value.status_code == 503 and "shutting down" in err.value.body["message"]
        with pytest.raises(anthropic.APIStatusError) as err:
            claude.messages.create(model="m", messages=QUESTION, max_tokens=2)
        assert err.value.status_code == 503 and err.value.body["error"]["type"] == "overloaded_error"

        chunks = list(stream)        # the stream in flight runs to its end
        assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 24
        thread.thread.join(30)
        assert not thread.thread.is_alive(), "the server did not stop after the drain"


@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_serve_exits_0_after_a_signal_with_a_stream_in_flight(sig, tmp_path):
    """... and with llama.cpp's --log-file, its log lines in that file too."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log_file = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "cobatch.cli", "serve", "--port", "0", "--parallel", "2",
                             "--ctx", "512", "--threads", "1", "--graceful-shutdown-s", "60",
                             "--served-model-name", "m", "--log-file", str(log_file)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        url = next(line.split()[1] for line in proc.stderr if line.strip().startswith("url:")).removesuffix("/v1")
        threading.Thread(target=proc.stderr.read, daemon=True).start()     # keep the pipe from filling up
        wait_for(lambda: httpx.get(url + "/health").status_code == 200, 120, "the model to load")
        oai, _ = _clients(url)
        stream = oai.chat.completions.create(model="m", messages=QUESTION, max_tokens=16, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        proc.send_signal(sig)
        chunks = list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert proc.wait(timeout=60) == 0
        assert "chat" in log_file.read_text()             # the stream's request line, as on stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
