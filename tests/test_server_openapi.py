"""/openapi.json and /docs, and schemathesis fuzzing every route from the spec: no 5xx, whatever the body."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from cobatch.server.context import ServerOptions
from model_fixtures import load_llm
from test_server_support import live_server

EXAMPLES_PER_ROUTE = 6
# Bodies the fuzzer makes may ask for thousands of tokens; generating them is not what is under test here.
MAX_GENERATED = 3
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict")


@pytest.fixture(scope="module")
def server():
    # Requests that leave their length unset get MAX_GENERATED too (serve's -n), not the rest of the context.
    options = ServerOptions(sampling_defaults={"max_tokens": MAX_GENERATED})
    with live_server(load_llm("smollm2"), options) as srv:
        yield srv


def test_spec_names_every_body_model(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    chat = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    name = chat["$ref"].rsplit("/", 1)[1]
    fields = spec["components"]["schemas"][name]["properties"]
    assert {"messages", "temperature", "max_tokens", "tools"} <= fields.keys()
    messages = spec["paths"]["/v1/messages"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert messages["$ref"] != chat["$ref"]
    posts = [path for path, ops in spec["paths"].items() if "post" in ops and not path.startswith("/slots")]
    assert all("requestBody" in spec["paths"][p]["post"] for p in posts), posts
    docs = httpx.get(server.url + "/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_docs_can_be_turned_off():
    with live_server(load_llm("smollm2"), ServerOptions(openapi=False)) as srv:
        assert httpx.get(srv.url + "/openapi.json").status_code == 404
        assert httpx.get(srv.url + "/docs").status_code == 404


def _bounded(body):
    if isinstance(body, dict):
        for key in LENGTH_FIELDS:
            if isinstance(body.get(key), int) and not isinstance(body[key], bool):
                body[key] = max(0, min(body[key], MAX_GENERATED))
        if isinstance(body.get("n"), int) and not isinstance(body["n"], bool):
            body["n"] = min(body["n"], 2)
    return body


def test_fuzzed_bodies_never_get_a_server_error(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    failures, calls = [], []
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        def check(case):
            case.body = _bounded(case.body)
            response = case.call(base_url=server.url, timeout=30)
            calls.append(case.path)
            if response.status_code >= 500:
                failures.append((case.method, case.path, case.body, response.status_code, response.text[:300]))

        given(operation.as_strategy())(check)()
    assert len(set(calls)) >= 15, sorted(set(calls))        # every route was called
    assert failures == [], failures[:3]
