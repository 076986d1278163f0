"""Tool calls end to end with Qwen2.5-Coder-0.5B (its chat template supports tools), greedy; and its
fill-in-the-middle through /v1/completions' suffix.

This small model answers a tool request with a bare `{"name": ..., "arguments": ...}` object rather than
inside <tool_call> tags (checked: several prompts, with and without few-shot history); the parser accepts
both, and test_server_parsing covers the tagged form at every split position.
"""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import openai
import pytest

from cobatch.chat_template import ChatTemplate
from model_fixtures import load_llm
from test_server_support import live_server, together

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server():
    with live_server(load_llm("qwen2.5-coder")) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_openai_tool_call_plain_streamed_and_answered(oai):
    kwargs = dict(model="qwen", messages=ASK, tools=[WEATHER_TOOL], max_tokens=40, **GREEDY)
    out, stream = together(lambda: oai.chat.completions.create(**kwargs),
                           lambda: list(oai.chat.completions.create(stream=True, **kwargs)))
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert not choice.message.content

    # Streamed: the name first, then the arguments in several partial deltas.
    deltas, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].index == 0
    pieces = [d.function.arguments for d in deltas[1:]]
    assert len(pieces) > 1 and all(d.index == 0 for d in deltas)
    assert json.loads("".join(pieces)) == {"city": "Paris"}

    # The tool's answer goes back (arguments as OpenAI's JSON string, which the template wants as an
    # object). What the 0.5B model makes of it varies; the conversation must render and run.
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "sunny"}'}]
    answer = oai.chat.completions.create(model="qwen", messages=history, tools=[WEATHER_TOOL], max_tokens=4,
                                         **GREEDY)
    assert answer.usage.prompt_tokens > out.usage.prompt_tokens + 30      # the call and its result are in
    assert answer.usage.prompt_tokens_details.cached_tokens >= 160       # the shared prefix was reused


def test_anthropic_tool_use_plain_and_streamed(server):
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    tool = {"name": "get_weather", "description": "Get the current weather for a city",
            "input_schema": WEATHER_TOOL["function"]["parameters"]}
    kwargs = dict(model="qwen", max_tokens=40, messages=ASK, tools=[tool], extra_body=GREEDY)

    def streamed():
        with claude.messages.stream(**kwargs) as stream:
            return [e.partial_json for e in stream if e.type == "input_json"], stream.get_final_message()

    out, (partial_json, final) = together(lambda: claude.messages.create(**kwargs), streamed)
    assert out.stop_reason == "tool_use"
    (block,) = [b for b in out.content if b.type == "tool_use"]
    assert block.name == "get_weather" and block.input == {"city": "Paris"} and block.id.startswith("toolu_")
    assert final.stop_reason == "tool_use" and len(partial_json) > 1
    assert [b.input for b in final.content if b.type == "tool_use"] == [{"city": "Paris"}]
    counted = claude.messages.count_tokens(model="qwen", messages=ASK, tools=[tool]).input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == counted


TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
SMALL_TALK = [{"role": "user", "content": "Hello, how are you?"}]


def test_tool_choice_required_and_named_are_enforced(oai):
    """Small talk gets a text answer under tool_choice auto; "required" makes it a call (through a grammar
    in the template's <tool_call> format), one only where parallel calls are off, and a named function makes it a
    call of that function."""
    pytest.importorskip("llguidance")
    tools = [WEATHER_TOOL, TIME_TOOL]
    free, forced, named = together(
        lambda: oai.chat.completions.create(model="qwen", messages=SMALL_TALK, tools=tools, max_tokens=12, **GREEDY),
        # greedy, with parallel calls allowed, this model calls both tools (51 tokens)
        lambda: oai.chat.completions.create(model="qwen", messages=SMALL_TALK, tools=tools, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=60, **GREEDY),
        lambda: oai.chat.completions.create(model="qwen", messages=ASK, tools=tools, max_tokens=60, **GREEDY,
                                            tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert free.choices[0].finish_reason != "tool_calls" and free.choices[0].message.content
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert (call.function.name, sorted(args)) in [("get_weather", ["city"]), ("get_time", ["zone"])]

    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and isinstance(json.loads(call.function.arguments)["zone"], str)

    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="qwen", messages=ASK, tool_choice="required", max_tokens=5)
    assert exc.value.body["param"] == "tool_choice"


def test_anthropic_tool_choice_any(server):
    pytest.importorskip("llguidance")
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    tool = {"name": "get_weather", "description": "Get the current weather for a city",
            "input_schema": WEATHER_TOOL["function"]["parameters"]}
    out = claude.messages.create(model="qwen", max_tokens=60, messages=SMALL_TALK, tools=[tool],
                                 tool_choice={"type": "any"}, extra_body=GREEDY)
    assert out.stop_reason == "tool_use"
    (block,) = [b for b in out.content if b.type == "tool_use"]
    assert block.name == "get_weather" and isinstance(block.input["city"], str)


def test_completion_suffix_fills_in_the_middle(oai):
    out = oai.completions.create(model="qwen", prompt="def add(a, b):\n    ", suffix="\n\nprint(add(2, 3))\n",
                                 max_tokens=8, **GREEDY)
    assert out.choices[0].text.startswith("return a + b")
    with pytest.raises(openai.BadRequestError) as exc:
        oai.completions.create(model="qwen", prompt=[1, 2, 3], suffix="x", max_tokens=2)
    assert exc.value.body["param"] == "suffix"


def test_responses_api_function_call_round_trip(oai):
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    kwargs = dict(model="qwen", input="What is the weather in Paris?", tools=[tool], max_output_tokens=40, **GREEDY)
    r, events = together(lambda: oai.responses.create(**kwargs),
                         lambda: list(oai.responses.create(stream=True, **kwargs)))
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and r.status == "completed"

    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == {"city": "Paris"}
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == "".join(pieces)

    follow = oai.responses.create(model="qwen", tools=[tool], max_output_tokens=4, **GREEDY, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 21, "sky": "sunny"}'}])
    assert follow.usage.input_tokens > r.usage.input_tokens + 30        # the call and its result are in the prompt


QWEN3_CODER_TEMPLATE = (Path(__file__).parent / "templates" / "qwen3_coder.jinja").read_text()
FORECAST_TOOL = {"type": "function", "function": {
    "name": "get_forecast", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "required": ["city", "days"], "properties": {
        "city": {"type": "string", "description": "City name"},
        "days": {"type": "integer", "description": "Number of days"}}}}}


def test_qwen3_coder_template_calls_in_xml_with_typed_arguments(server, oai, monkeypatch):
    """Qwen3-Coder's own template (tests/templates/qwen3_coder.jinja) shows the model calls as
    <function=NAME><parameter=KEY>VALUE</parameter>...; a forced call is written so (the grammar follows the
    template), and read back with each value typed by the tool's schema: `days` an integer, not the text "3"."""
    pytest.importorskip("llguidance")
    llm = server.context.llm
    monkeypatch.setattr(llm, "template", ChatTemplate.with_tokenizer(QWEN3_CODER_TEMPLATE, llm.tokenizer))
    ask = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
    kw = dict(model="qwen", messages=ask, tools=[FORECAST_TOOL], tool_choice="required", parallel_tool_calls=False,
              max_tokens=40, **GREEDY)
    out, chunks = together(lambda: oai.chat.completions.create(**kw),
                           lambda: list(oai.chat.completions.create(**kw, stream=True)))
    (call,) = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "get_forecast"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}

    pieces = [d.function.arguments for chunk in chunks for c in chunk.choices for d in c.delta.tool_calls or ()
              if d.function.arguments]
    assert len(pieces) > 2 and "".join(pieces) == call.function.arguments     # the city's text came on its own

    # the call goes back in the history, its arguments the object the template iterates
    history = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = oai.chat.completions.create(model="qwen", messages=history, tools=[FORECAST_TOOL], max_tokens=4, **GREEDY)
    assert answer.usage.prompt_tokens > out.usage.prompt_tokens + 20
