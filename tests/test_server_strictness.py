"""What the server refuses rather than silently ignores: unknown models, unimplemented sampling fields; a final
assistant message, continued rather than closed; and malformed bodies, answered with a 4xx, never a 500."""

from __future__ import annotations

import copy
import json
import random

import anthropic
import httpx
import openai
import pytest

from cobatch.server.context import ServerOptions
from model_fixtures import load_llm
from test_server_support import live_server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    options = ServerOptions(model_name="smol", model_aliases=("gpt-4o-mini",), accept_any_model=False)
    with live_server(load_llm("smollm2"), options) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_unknown_model_is_404_and_aliases_are_served(server, oai):
    assert [m.id for m in oai.models.list().data] == ["smol", "gpt-4o-mini"]
    with pytest.raises(openai.NotFoundError) as err:
        oai.chat.completions.create(model="llama-3-70b", messages=QUESTION, max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="claude-opus", messages=QUESTION, max_tokens=2)
    assert err.value.body["error"]["type"] == "not_found_error" and "claude-opus" in err.value.body["error"]["message"]
    for name in ("smol", "gpt-4o-mini"):
        assert oai.chat.completions.create(model=name, messages=QUESTION, max_tokens=2).choices
    assert claude.messages.create(model="gpt-4o-mini", messages=QUESTION, max_tokens=2).content
    assert oai.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"


@pytest.mark.parametrize("extra", [{"use_beam_search": True}, {"mirostat_mode": 2}])
def test_unimplemented_field_is_400_naming_it(oai, extra):
    (name, _), = extra.items()
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="smol", messages=QUESTION, max_tokens=2, extra_body=extra)
    assert err.value.body["param"] == name and name in err.value.body["message"]


def test_neutral_values_are_documented_no_ops(server, oai):
    out = oai.chat.completions.create(model="smol", messages=QUESTION, max_tokens=2, extra_body={
        "typical_p": 1.0, "use_beam_search": False, "dry_multiplier": 0, "dry_base": 1.75, "xtc_probability": 0,
        "mirostat": 0, "dynatemp_range": 0, "dynatemp_exponent": 1.0})
    assert out.choices[0].finish_reason == "length"
    r = httpx.post(server.url + "/completion", json={"prompt": "Hi", "n_predict": 2, "use_beam_search": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"
    # a sampler's parameter with the sampler off passes where the sampler is not implemented
    r = httpx.post(server.url + "/v1/messages", json={"model": "smol", "messages": QUESTION, "max_tokens": 2,
                                                      "dynatemp_range": 0, "dynatemp_exponent": 2.0})
    assert r.status_code == 200, r.text


def test_a_field_one_endpoint_implements_is_refused_by_the_others(server):
    """vLLM's prompt_logprobs is the OpenAI routes' (tests/test_server.py), llama.cpp's typical_p, XTC, DRY,
    mirostat and dynatemp its own and the OpenAI routes' (tests/test_sampler.py, tests/test_dry.py); llama.cpp's /completion
    refuses the first, Anthropic's /v1/messages all of them, rather than ignore them."""
    messages = ("/v1/messages", {"model": "smol", "messages": QUESTION, "max_tokens": 2})
    for (path, body), extra in ((("/completion", {"prompt": "Hi", "n_predict": 2}), {"prompt_logprobs": 1}),
                                (messages, {"prompt_logprobs": 1}), (messages, {"typical_p": 0.5}),
                                (messages, {"xtc_probability": 0.5}), (messages, {"dry_multiplier": 0.8}),
                                (messages, {"mirostat": 2}), (messages, {"dynatemp_range": 0.5})):
        r = httpx.post(server.url + path, json={**body, **extra})
        (name, _), = extra.items()
        assert r.status_code == 400 and name in r.text, (path, name)


def test_fields_that_contradict_the_request_are_400_naming_them(server):
    """stream_options without stream (as vLLM refuses it), a tool without a name, and a tool_choice forcing a call
    with no tools, on count_tokens as on /v1/messages: each a 400 in its protocol's error shape."""
    tool = {"type": "function", "function": {"name": "", "parameters": {"type": "object"}}}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for path, body, param in (
                ("/v1/chat/completions", {"messages": QUESTION, "stream_options": {"include_usage": True}},
                 "stream_options"),
                ("/v1/completions", {"prompt": "hi", "stream": False, "stream_options": {"include_usage": True}},
                 "stream_options"),
                ("/v1/chat/completions", {"messages": QUESTION, "tools": [tool], "tool_choice": "required"}, None)):
            r = client.post(path, json={"model": "smol", "max_tokens": 2, **body})
            assert r.status_code == 400, (path, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and (param is None or error["param"] == param), error
        forced = {"type": "tool", "name": "lookup"}
        for path in ("/v1/messages/count_tokens", "/v1/messages"):
            for extra in ({"tool_choice": forced}, {"tools": [{"name": "", "input_schema": {"type": "object"}}]}):
                r = client.post(path, json={"model": "smol", "max_tokens": 2, "messages": QUESTION, **extra})
                assert r.status_code == 400, (path, extra, r.text)
                assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
        # the same requests, set right, are answered
        assert client.post("/v1/messages/count_tokens", json={"model": "smol", "messages": QUESTION}).json()[
            "input_tokens"] > 0
        assert client.post("/v1/completions", json={"model": "smol", "prompt": "hi", "max_tokens": 2, "stream": True,
                                                    "stream_options": {"include_usage": True}}).status_code == 200


def test_audio_output_is_refused_and_text_output_accepted(oai):
    for extra in ({"modalities": ["text", "audio"]}, {"audio": {"voice": "alloy", "format": "wav"}}):
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model="smol", messages=QUESTION, max_tokens=2, extra_body=extra)
        (name, _), = extra.items()
        assert err.value.body["param"].startswith(name), err.value.body
    out = oai.chat.completions.create(model="smol", messages=QUESTION, max_tokens=2, modalities=["text"])
    assert out.choices[0].message.content


def test_a_final_assistant_message_is_continued(server, oai):
    system = {"role": "system", "content": "You are terse."}
    start = "The capital of France is"
    chat = oai.chat.completions.create(model="smol", max_tokens=6, temperature=0, messages=[
        system, *QUESTION, {"role": "assistant", "content": start}])
    # The same prompt written out in SmolLM2's ChatML, the assistant's turn left open
    raw = (f"<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n{QUESTION[0]['content']}<|im_end|>\n"
           f"<|im_start|>assistant\n{start}")
    completion = oai.completions.create(model="smol", prompt=raw, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == completion.choices[0].text
    assert "Paris" in chat.choices[0].message.content
    assert chat.usage.prompt_tokens == completion.usage.prompt_tokens


def test_continue_final_message_needs_an_assistant_message(oai):
    for extra in ({"continue_final_message": True}, {"add_generation_prompt": False}):
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model="smol", messages=QUESTION, max_tokens=2, extra_body=extra)
        assert err.value.body["param"] == next(iter(extra))


# --- malformed bodies: a 4xx with an error body, never a 500 -----------------------------------------------

FUZZ_MESSAGES = [{"role": "user", "content": "hi"}]
FUZZ_BODIES = {     # a valid body per endpoint, whose fields the fuzz swaps for junk
    "/v1/chat/completions": {"model": "smol", "messages": FUZZ_MESSAGES, "max_tokens": 2, "temperature": 0.5,
                             "top_p": 0.9, "logprobs": True, "top_logprobs": 2, "stop": ["\n"], "seed": 1,
                             "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                             "response_format": {"type": "json_object"}, "logit_bias": {"5": 1.0}},
    "/v1/completions": {"model": "smol", "prompt": "hello", "max_tokens": 2, "echo": True, "logprobs": 2},
    "/v1/messages": {"model": "smol", "messages": FUZZ_MESSAGES, "max_tokens": 2, "system": "be brief", "top_k": 5,
                     "stop_sequences": ["x"], "tools": [{"name": "f", "input_schema": {"type": "object"}}]},
    "/v1/messages/count_tokens": {"model": "smol", "messages": FUZZ_MESSAGES},
    "/v1/responses": {"model": "smol", "input": "hello", "max_output_tokens": 16, "instructions": "brief"},
    "/completion": {"prompt": "hello", "n_predict": 2, "temperature": 0.5, "grammar": 'root ::= "a"', "n_probs": 2},
    "/tokenize": {"content": "hello", "with_pieces": True},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/apply-template": {"messages": FUZZ_MESSAGES},
    "/infill": {"input_prefix": "def f(", "input_suffix": ")", "n_predict": 2},
    "/v1/embeddings": {"model": "smol", "input": ["hello"]},
}
FUZZ_JUNK = [None, True, 0, -1, 2 ** 31, 2 ** 63, -2 ** 63, 1e308, 0.5, "", "x", "NaN", [], [None], [1, "a"], {},
             {"a": 1}, "\u0000", "é" * 3000, [[1]], {"type": None}, [{"role": None}], [{"role": "user"}],
             [{"role": "tool", "content": "x"}], [{"role": "assistant", "tool_calls": [{"id": 1, "function": None}]}],
             float("nan"), float("inf"), 10 ** 30]
FUZZ_FIELDS = ["stream", "n", "logprobs", "top_logprobs", "stop", "seed", "temperature", "messages",
               "prompt", "tool_choice", "response_format", "stream_options", "min_p", "top_k", "grammar", "json_schema",
               "n_probs", "id_slot", "lora", "metadata", "parallel_tool_calls", "logit_bias", "input", "content"]


# The fields that bound a generation keep their small values: without them a valid request may run to the end of
# the context (llama.cpp's n_predict -1), which is no error, only slow.
FUZZ_LIMITS = ("max_tokens", "n_predict", "max_output_tokens")


def _fuzzed(rng: random.Random, valid: dict):
    body = copy.deepcopy(valid)
    for _ in range(rng.randint(1, 3)):
        op = rng.random()
        if op < 0.55:
            body[rng.choice(list(body))] = copy.deepcopy(rng.choice(FUZZ_JUNK))
        elif op < 0.7 and body:
            del body[rng.choice(list(body))]
        elif op < 0.95:
            body[rng.choice(FUZZ_FIELDS)] = copy.deepcopy(rng.choice(FUZZ_JUNK))
        else:
            return copy.deepcopy(rng.choice(FUZZ_JUNK))       # not an object at all
        if not body:
            break
    body.update({key: valid[key] for key in FUZZ_LIMITS if key in valid})
    return body


def test_malformed_bodies_get_a_4xx_with_an_error_body_never_a_500(server):
    """Valid bodies with fields swapped for junk (wrong types, huge and NaN numbers, broken messages), fields
    dropped, or no object at all, on every generating and tokenizing route (fixed seed): each answer is a success
    or a 4xx whose body is an OpenAI- or Anthropic-style error, and the server still answers afterwards."""
    rng = random.Random(7)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(80):
            path = rng.choice(list(FUZZ_BODIES))
            body = _fuzzed(rng, FUZZ_BODIES[path])
            if rng.random() < 0.05:
                r = client.post(path, content=rng.choice([b"{", b"", b"null", b"\xff\xfe", b'{"messages": ']),
                                headers={"Content-Type": "application/json"})
            else:
                r = client.post(path, content=json.dumps(body, allow_nan=True),
                                headers={"Content-Type": "application/json"})
            assert r.status_code < 500, (path, body, r.text[:300])
            if r.status_code >= 400:
                error = r.json()
                assert "error" in error, (path, body, error)
        assert client.get("/health").json()["status"] == "ok"
