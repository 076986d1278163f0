"""What a routing front over two replicas must do, whatever carries its requests: `cobatch serve -dp 2`
(tests/test_data_parallel.py) and the Ray Serve deployment (tests/test_ray_serve.py) run the same checks. The
served model is named "m"."""

from __future__ import annotations

import httpx
import openai

STORY = ("{} is the name of a lighthouse keeper: write one sentence about how she counts ships at night, "
         "collects shells by day, and keeps a logbook of every storm that passes the rocky northern cape.")


def _chat(client, name: str, **kw):
    return client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": STORY.format(name)}], max_tokens=4, temperature=0, **kw)


def repeated_prompt_goes_to_the_replica_caching_it(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    first, again = _chat(client, "Ada"), _chat(client, "Ada")
    assert first.headers["x-cobatch-replica"] == again.headers["x-cobatch-replica"]
    usage = again.parse().usage
    assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 16     # all but the last block


def concurrent_requests_spread_over_both_replicas(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    replicas = []
    with client.chat.completions.with_streaming_response.create(
            model="m", messages=[{"role": "user", "content": STORY.format("Bo")}], max_tokens=8, temperature=0,
            stream=True) as a:
        chunks = a.iter_lines()
        next(chunks)            # a is in flight at its replica ...
        replicas.append(a.headers["x-cobatch-replica"])
        with client.chat.completions.with_streaming_response.create(
                model="m", messages=[{"role": "user", "content": STORY.format("Cy")}], max_tokens=8,
                temperature=0, stream=True) as b:      # ... so b goes to the other one
            replicas.append(b.headers["x-cobatch-replica"])
            assert any("[DONE]" in line for line in b.iter_lines())
        assert any("[DONE]" in line for line in chunks)
    assert sorted(replicas) == ["0", "1"]


def metrics_and_slots_are_labelled_by_replica(url: str) -> None:
    text = httpx.get(url + "/metrics").text
    assert 'replica="0"' in text and 'replica="1"' in text
    assert 'cobatch_router_requests_total{replica="0",reason="prefix"}' in text
    view = httpx.get(url + "/slots").json()
    assert {s["replica"] for s in view["slots"]} == {0, 1} and len(view["replicas"]) == 2
