"""GET /v1/events (the dashboard's feed) without a browser: the API key, the snapshots' counts against a known
workload, a 429 counted once, streams that hang up leaving nothing behind; and --no-webui."""

from __future__ import annotations

import threading

import httpx
import pytest

from cobatch.server.context import ServerOptions
from model_fixtures import load_llm
from test_server_support import RawStream, live_server, metric, wait_for

KEY = "events-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
N_TOKENS = 5


@pytest.fixture(scope="module")
def server():
    # One slot and no queue: a second request while one runs is refused (429).
    with live_server(load_llm("smollm2"), ServerOptions(api_key=KEY, num_slots=1, max_queue=0)) as srv:
        yield srv


def _events(server, n: int = 1, stream: RawStream | None = None) -> list[dict]:
    stream = stream or RawStream(server.url, "/v1/events", None, AUTH)
    return stream.read_events(n)


def _chat(server, **fields) -> httpx.Response:
    body = {"model": "any", "messages": QUESTION, "temperature": 0, **fields}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120)


def test_events_want_the_api_key(server):
    missing = httpx.get(server.url + "/v1/events", timeout=30)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/events", headers={"x-api-key": "wrong"}, timeout=30).status_code == 401
    # the pages themselves hold nothing secret: a browser loads them, then asks its user for the key
    page = httpx.get(server.url + "/", timeout=30)
    assert page.status_code == 200 and "chat.js" in page.text
    assert "script-src" not in page.headers["content-security-policy"]      # default-src 'self' covers scripts
    assert page.headers["content-security-policy"].startswith("default-src 'self'")


def test_snapshot_counts_a_known_workload(server):
    """One request of exactly N_TOKENS tokens on an idle server: one prefill step then N - 1 lone decode steps,
    the prompt's uncached tokens plus N - 1 decode rows; a second request meanwhile gets one 429."""
    stream = RawStream(server.url, "/v1/events", None, AUTH)
    before = stream.read_events(1)[0]
    assert {"slots", "queue", "recent", "last_minute", "totals", "kv_blocks", "prefix_cache"} <= before.keys()
    assert len(before["slots"]) == 1 and before["slots"][0]["state"] == "idle"
    kv = before["kv_blocks"]
    pool = server.context.llm.engine.pool
    assert kv["total"] == pool.num_blocks and kv["block_size"] == pool.block_size
    assert kv["used"] + kv["free"] == kv["total"] and kv["cached"] <= kv["free"]

    running = RawStream(server.url, "/v1/chat/completions",
                        {"messages": QUESTION, "temperature": 0, "max_tokens": 400, "min_tokens": 400,
                         "stream": True}, AUTH)
    running.read_events(2)      # decoding now: the one slot is taken
    refused = _chat(server, max_tokens=2)
    assert refused.status_code == 429
    decoding = wait_for(lambda: next((e for e in stream.read_events(1) if e["slots"][0]["state"] == "decoding"
                                      and e["slots"][0]["tok_s"] is not None), None), what="a decoding slot")
    slot = decoding["slots"][0]
    assert slot["generated_tokens"] >= 2 and slot["tok_s"] > 0 and slot["prefill_progress"] == 1.0
    assert decoding["recent"]["step_ms"] > 0 and decoding["kv_blocks"]["used"] >= 1
    running.hard_close()
    wait_for(lambda: stream.read_events(1)[0]["slots"][0]["state"] == "idle", what="the slot freed")

    start = stream.read_events(1)[0]
    done = _chat(server, max_tokens=N_TOKENS, min_tokens=N_TOKENS)
    usage = done.json()["usage"]
    assert usage["completion_tokens"] == N_TOKENS
    want = start["totals"]["generated_tokens"] + N_TOKENS
    after = wait_for(lambda: next((e for e in stream.read_events(1) if e["totals"]["generated_tokens"] == want),
                                  None), what="the request's tokens counted")
    stream.hard_close()
    now, was = after["totals"], start["totals"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0             # the same prompt as the request before
    assert now["steps"] - was["steps"] == N_TOKENS
    assert now["rows"] - was["rows"] == (usage["prompt_tokens"] - cached) + N_TOKENS - 1
    decode_steps = now["decode_steps"] - was["decode_steps"]
    assert decode_steps == N_TOKENS - 1 and now["batched_steps"] == was["batched_steps"]
    assert sum(now["lone_decode"].values()) - sum(was["lone_decode"].values()) == decode_steps
    minute = after["last_minute"]
    assert minute["decode_steps"] >= decode_steps and minute["batched_fraction"] == 0
    assert after["prefix_cache"]["prompt_tokens"] - start["prefix_cache"]["prompt_tokens"] == usage["prompt_tokens"]
    assert after["prefix_cache"]["hit_tokens"] - start["prefix_cache"]["hit_tokens"] == cached
    # the 429 once, in the snapshot as in /metrics (the error handler counts it; nothing else does)
    assert after["queue"]["rejected_429"] == 1 == metric(server.url, "cobatch_http_errors_total", {"status": "429"},
                                                                  AUTH)


def test_streams_that_hang_up_leave_nothing_behind(server):
    first = RawStream(server.url, "/v1/events", None, AUTH)
    assert first.read_events(1)[0]["viewers"] == 1
    second = RawStream(server.url, "/v1/events", None, AUTH)
    wait_for(lambda: second.read_events(1)[0]["viewers"] == 2, what="two streams open")
    first.hard_close()
    wait_for(lambda: second.read_events(1)[0]["viewers"] == 1, what="the first stream's end noticed")
    second.hard_close()
    wait_for(lambda: server.context.event_streams == 0, what="no stream left")
    # the engine thread lives on (a snapshot's wait that a hang-up cancelled is skipped, not answered)
    assert server.context.worker.alive
    assert _chat(server, max_tokens=2).status_code == 200


def test_an_engine_call_given_up_on_is_skipped(monkeypatch):
    """A /slots view the engine thread cannot give in time (a long step) is a 503, and the engine thread skips the
    call that the route gave up on and serves on. (It once answered it: the InvalidStateError ended the thread.)"""
    from cobatch.server import app
    monkeypatch.setattr(app, "SLOTS_VIEW_TIMEOUT_S", 0.2)
    with live_server(load_llm("smollm2")) as srv:
        worker = srv.context.worker
        release, ran = threading.Event(), []
        blocker = worker.call(lambda: release.wait(30))        # holds the engine thread, as a long step would
        slow = httpx.get(srv.url + "/slots", timeout=30)
        assert slow.status_code == 503 and "did not answer" in slow.json()["error"]["message"]
        given_up = worker.call(lambda: ran.append("given up"))
        assert given_up.cancel()                               # queued behind the blocker: not started yet
        release.set()
        assert blocker.result(30) is True
        assert worker.call(lambda: "served").result(30) == "served" and ran == []
        assert worker.alive and httpx.get(srv.url + "/slots", timeout=30).status_code == 200


def test_no_webui_turns_the_pages_off():
    with live_server(load_llm("smollm2"), ServerOptions(webui=False)) as srv:
        for path in ("/", "/dashboard", "/webui/chat.js"):
            assert httpx.get(srv.url + path, timeout=30).status_code == 404, path
        assert httpx.get(srv.url + "/v1/models", timeout=30).status_code == 200
    with live_server(load_llm("smollm2")) as srv:
        assert httpx.get(srv.url + "/webui/chat.js", timeout=30).headers["content-type"].startswith("text/javascript")
        assert httpx.get(srv.url + "/webui/secrets.txt", timeout=30).status_code == 404
