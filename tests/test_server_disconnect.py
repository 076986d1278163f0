"""Clients that hang up: the request is aborted, its slot and KV freed, and nobody else notices.

The ds4 disconnect harness (#530): open a stream, read a few chunks, hard-close the socket; more rounds
than there are slots (a leaked slot would make a later round wait forever); a peer stream runs through
all of it and must come out exactly as it does alone.
"""

from __future__ import annotations

import threading

import openai
import pytest

from model_fixtures import load_llm
from test_server_support import RawStream, all_slots_idle, live_server, metric, wait_for

PEER = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
LONG = {"max_tokens": 400, "ignore_eos": True, "stream": True}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server():
    with live_server(load_llm("smollm2")) as srv:
        yield srv


def _running_ids(worker) -> set[str]:
    ids = set()
    for slot in worker.slots:
        request = slot.request       # read once: the engine thread may clear it meanwhile
        if request is not None:
            ids.add(request.id)
    return ids


def _engine_idle(server) -> bool:
    engine = server.context.worker.engine
    return not engine.seqs and engine.blocks.num_used == 0


def test_disconnect_mid_decode_frees_the_slot_and_spares_the_peer(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    peer_kwargs = dict(model="any", messages=PEER, max_tokens=80, **GREEDY)
    alone = client.chat.completions.create(**peer_kwargs).choices[0].message.content

    peer_result: dict = {}

    def run_peer() -> None:
        stream = client.chat.completions.create(stream=True, **peer_kwargs)
        peer_result["text"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    url, worker = server.url, server.context.worker
    aborts_before = metric(url, "cobatch_requests_total", {"api": "chat", "finish_reason": "abort"})
    peer = threading.Thread(target=run_peer)
    peer.start()
    wait_for(lambda: len(_running_ids(worker)) == 1, what="the peer to be running")
    rounds = worker.num_slots + 2
    steps_to_free = []
    for i in range(rounds):
        before = _running_ids(worker)
        stream = RawStream(url, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": f"Count to one hundred, round {i}."}], **LONG})
        assert len(stream.read_events(4)) == 4          # role chunk + 3 content chunks: mid-decode
        (mine,) = _running_ids(worker) - before
        steps_at_close = worker.steps
        stream.hard_close()
        wait_for(lambda: mine not in _running_ids(worker), what="the slot to free")
        steps_to_free.append(worker.steps - steps_at_close)
    peer.join(timeout=300)
    assert peer_result.get("text") == alone

    # A new request still completes, and everything is free again.
    assert client.chat.completions.create(model="any", messages=PEER, max_tokens=4).choices[0].message.content
    wait_for(lambda: all_slots_idle(url), what="all slots idle")
    wait_for(lambda: _engine_idle(server), what="no sequence or KV block left in the engine")
    assert metric(url, "cobatch_requests_total", {"api": "chat", "finish_reason": "abort"}) == aborts_before + rounds
    # The abort is taken before the next step: only the step in flight when the client left runs on.
    assert max(steps_to_free) <= 2, steps_to_free     # (2: the hang-up itself took longer than a step)
    print("engine steps from hang-up to free slot:", steps_to_free)


def test_disconnect_mid_prefill(server):
    url = server.url
    ttft_before = metric(url, "cobatch_time_to_first_token_seconds_count")
    aborts_before = metric(url, "cobatch_requests_total", {"api": "completions", "finish_reason": "abort"})
    long_prompt = " ".join(f"word{i}" for i in range(250))      # two 512-token prefill chunks
    assert 600 < len(load_llm("smollm2").encode_prompt(long_prompt)) < 1000
    worker = server.context.worker
    stream = RawStream(url, "/v1/completions", {"prompt": long_prompt, **LONG})
    # Hang up once the request holds a slot and is prefilling (closing before the server has read the
    # request would only test the kernel dropping it).
    wait_for(lambda: any(s.request is not None and s.generated == 0 for s in worker.slots), what="prefill")
    stream.hard_close()
    wait_for(lambda: metric(url, "cobatch_requests_total", {"api": "completions", "finish_reason": "abort"})
             == aborts_before + 1, what="the abort to be counted")
    wait_for(lambda: all_slots_idle(url), what="all slots idle")
    wait_for(lambda: _engine_idle(server), what="no sequence or KV block left in the engine")
    assert metric(url, "cobatch_time_to_first_token_seconds_count") == ttft_before   # no token was produced


@pytest.mark.parametrize("api, n, stream", [("chat", 1, False), ("chat", 3, False), ("chat", 3, True),
                                            ("responses", 1, True), ("responses", 1, False)])
def test_disconnect_aborts_every_choice(server, api, n, stream):
    """The client hangs up mid-decode, waiting for a plain answer or streaming it, with n choices: every
    choice is aborted and its slot freed."""
    url, worker = server.url, server.context.worker
    aborted = {"api": api, "finish_reason": "abort"}
    aborts_before = metric(url, "cobatch_requests_total", aborted)
    if api == "chat":
        raw = RawStream(url, "/v1/chat/completions", {"messages": PEER, "n": n, **LONG, "stream": stream})
    else:
        raw = RawStream(url, "/v1/responses", {"input": PEER, "max_output_tokens": 400, "stream": stream})
    wait_for(lambda: sum(s.request is not None and s.generated > 2 for s in worker.slots) == n,
             what="the choices to be decoding")
    raw.hard_close()
    wait_for(lambda: metric(url, "cobatch_requests_total", aborted) == aborts_before + n,
             what="the aborts to be counted")
    wait_for(lambda: all_slots_idle(url), what="all slots idle")
    wait_for(lambda: _engine_idle(server), what="no sequence or KV block left in the engine")
