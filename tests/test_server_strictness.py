"""What the server refuses rather than silently ignores: unknown models, unimplemented sampling fields; and a
final assistant message, continued rather than closed."""

from __future__ import annotations

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
        "mirostat": 0})
    assert out.choices[0].finish_reason == "length"
    r = httpx.post(server.url + "/completion", json={"prompt": "Hi", "n_predict": 2, "use_beam_search": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"


def test_a_field_one_endpoint_implements_is_refused_by_the_others(server):
    """vLLM's prompt_logprobs is the OpenAI routes' (tests/test_server.py), llama.cpp's typical_p, XTC, DRY and
    mirostat its own and the OpenAI routes' (tests/test_sampler.py, tests/test_dry.py); llama.cpp's /completion
    refuses the first, Anthropic's /v1/messages all of them, rather than ignore them."""
    messages = ("/v1/messages", {"model": "smol", "messages": QUESTION, "max_tokens": 2})
    for (path, body), extra in ((("/completion", {"prompt": "Hi", "n_predict": 2}), {"prompt_logprobs": 1}),
                                (messages, {"prompt_logprobs": 1}), (messages, {"typical_p": 0.5}),
                                (messages, {"xtc_probability": 0.5}), (messages, {"dry_multiplier": 0.8}),
                                (messages, {"mirostat": 2})):
        r = httpx.post(server.url + path, json={**body, **extra})
        (name, _), = extra.items()
        assert r.status_code == 400 and name in r.text, (path, name)


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
