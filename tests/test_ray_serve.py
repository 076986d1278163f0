"""cobatch on Ray Serve (cobatch.deploy.ray) with a local Ray instance on the CPU: two SmolLM2 engines (the model cut
to 2 layers) behind the front, through the openai client: the checks `cobatch serve -dp 2` passes (front_checks),
a plain chat answer, and the builder's one-line errors for flags the engines cannot take."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading

import openai
import pytest

from cobatch.errors import UserError
from cobatch.model_files import smollm2_path
from cobatch.testing.gguf_writer import cut_layers

import front_checks

pytest.importorskip("ray", reason="Ray Serve is an optional extra (pip install 'cobatch[ray]')")
from cobatch.deploy.ray import app_builder  # noqa: E402

SRC = os.path.join(os.path.dirname(__file__), "..", "src")


# The Ray instance runs in a child process of its own, not in the test worker: Ray's processes, threads and
# signal handlers stay out of the other tests' way, and its end is the child's.
CHILD = r"""
import socket, sys
import ray
from ray import serve
from cobatch.deploy.ray import app_builder
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
         object_store_memory=100 * 2**20)
serve.start(http_options={"host": "127.0.0.1", "port": port})
serve.run(app_builder({"replicas": 2, "flags": sys.argv[1]}), name="cobatch", route_prefix="/")
print(f"ready http://127.0.0.1:{port}", flush=True)
sys.stdin.read()                    # until the test closes it
serve.shutdown()
ray.shutdown()
"""


@pytest.fixture(scope="module")
def ray_front(tmp_path_factory):
    path = cut_layers(smollm2_path(), tmp_path_factory.mktemp("ray") / "smollm2-2l.gguf", 2)
    flags = f"--model {path} --device cpu --parallel 2 --ctx 512 --threads 1 --served-model-name m"
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, flags], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        # serve.run returns once every replica is up (its model loaded); one that Ray cannot place would wait
        # for ever, so the wait is bounded here
        lines = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
        line = lines.get(timeout=240)
        assert line.startswith("ready "), line
        yield line.split()[1]
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def test_a_chat_through_the_front_is_answered(ray_front):
    client = openai.OpenAI(base_url=ray_front + "/v1", api_key="none")
    answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Say hi."}],
                                            max_tokens=5, temperature=0)
    assert answer.choices[0].message.content and answer.usage.completion_tokens == 5


def test_repeated_prompt_goes_to_the_replica_caching_it(ray_front):
    front_checks.repeated_prompt_goes_to_the_replica_caching_it(ray_front)


def test_concurrent_requests_spread_over_both_replicas(ray_front):
    front_checks.concurrent_requests_spread_over_both_replicas(ray_front)


def test_metrics_and_slots_are_labelled_by_replica(ray_front):
    front_checks.metrics_and_slots_are_labelled_by_replica(ray_front)


def test_a_bad_request_gets_the_engines_own_error(ray_front):
    client = openai.OpenAI(base_url=ray_front + "/v1", api_key="none")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=[], max_tokens=5)
    assert caught.value.status_code == 400 and caught.value.body["message"]


@pytest.mark.parametrize("args, said", [({"replicas": 0}, "at least 1"), ({"replicas": "two"}, "whole number"),
                                        ({"flags": "--port 9000"}, "Ray Serve's to set"),
                                        ({"flags": "--no-such-flag"}, "unrecognized arguments")])
def test_the_builder_refuses_what_it_cannot_run_in_one_line(args, said):
    with pytest.raises(UserError, match=said):
        app_builder(args)
