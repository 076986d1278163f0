"""Data parallel on the CPU: `cobatch serve -dp 2` (two replica processes behind the front) through the openai
client, and the front's routing policy on its own."""

import os
import subprocess
import sys
import threading

import httpx
import pytest

from cobatch.model_files import smollm2_path
from cobatch.parallel.data_parallel import _labelled, replica_argv
from cobatch.parallel.prefix_router import PrefixRouter, prompt_block_hashes
from cobatch.engine.kv_cache import chain_hash
from cobatch.testing.gguf_writer import cut_layers
import front_checks
from test_server_support import wait_for

SRC = os.path.join(os.path.dirname(__file__), "..", "src")


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    path = cut_layers(smollm2_path(), tmp_path_factory.mktemp("dp") / "smollm2-2l.gguf", 2)
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "cobatch.cli", "serve", str(path), "-dp", "2", "--device", "cpu",
                             "--port", "0", "--parallel", "2", "--ctx", "512", "--threads", "1",
                             "--served-model-name", "m"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, env=env)
    try:
        url = next(line.split()[1] for line in proc.stderr if line.strip().startswith("url:")).removesuffix("/v1")
        threading.Thread(target=proc.stderr.read, daemon=True).start()     # keep the pipe from filling up
        wait_for(lambda: httpx.get(url + "/health").status_code == 200, 180, "both replicas to load")
        yield url
    finally:
        proc.terminate()
        assert proc.wait(timeout=90) == 0


def test_repeated_prompt_goes_to_the_replica_caching_it(front):
    front_checks.repeated_prompt_goes_to_the_replica_caching_it(front)


def test_concurrent_requests_spread_over_both_replicas(front):
    front_checks.concurrent_requests_spread_over_both_replicas(front)


def test_metrics_and_slots_are_labelled_by_replica(front):
    front_checks.metrics_and_slots_are_labelled_by_replica(front)


def test_router_prefers_the_longest_cached_prefix_then_the_least_loaded():
    router = PrefixRouter(2, block_size=4)
    long = list(range(40))
    assert router.choose(long)[0] == 0                    # nothing cached anywhere: least loaded, lowest index
    router.start(0, prompt_block_hashes(long, 4))
    assert router.choose(long + [99])[0] == 0             # 10 of 10 blocks cached there, though it is busier
    shares_a_little = long[:8] + list(range(100, 132))
    assert router.choose(shares_a_little)[0] == 1         # 2 of 10 blocks: under min_affinity, the least loaded
    router.finish(0)
    assert router.choose(None)[0] == 0                    # no prompt: the least loaded


def test_block_hashes_are_the_prefix_caches():
    ids = list(range(37))
    hashes = prompt_block_hashes(ids, 16)
    assert len(hashes) == 2 and hashes[1] == chain_hash(chain_hash(None, tuple(ids[:16])), tuple(ids[16:32]))


def test_salted_prompts_match_only_their_salts_blocks():
    """A cache_salt's blocks are chained from its root, as the replica's engine chains them (kv_cache.salted_root):
    a salted request is not sent after the unsalted copy of its prompt, but after its own salt's."""
    from cobatch.engine.kv_cache import salted_root
    router = PrefixRouter(2, block_size=4)
    long = list(range(40))
    router.start(0, prompt_block_hashes(long, 4))
    router.start(1, prompt_block_hashes(long, 4, salted_root(None, "tenant")))
    router.start(0, [])                                   # replica 0 the busier, so load alone would pick 1
    assert router.choose(long)[0] == 0
    assert router.choose(long, salted_root(None, "tenant"))[0] == 1
    assert prompt_block_hashes(long, 4, salted_root(None, "other"))[0] not in router.replicas[1].blocks


def test_replica_flags_and_metric_labels():
    argv = ["serve", "m.gguf", "-dp", "2", "--host=0.0.0.0", "--port", "80", "--ssl-keyfile", "k", "--parallel", "4"]
    assert replica_argv(argv, 9000) == ["serve", "m.gguf", "--parallel", "4", "--host", "127.0.0.1", "--port", "9000"]
    seen: set = set()
    assert _labelled("# TYPE a counter\na 1\nb{x=\"y\"} 2\nc{} 3", 1, seen) == [
        "# TYPE a counter", 'a{replica="1"} 1', 'b{replica="1",x="y"} 2', 'c{replica="1"} 3']
