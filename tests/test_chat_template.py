"""Chat templates from GGUF metadata, rendered like transformers' apply_chat_template."""

from __future__ import annotations

import json
from pathlib import Path
from datetime import datetime
from typing import Any

import pytest

from cobatch.chat_template import ChatTemplate, ChatTemplateError
from cobatch.tokenizer import Tokenizer

try:  # shares the once-per-session GGUF reads with the tokenizer tests
    from test_tokenizer import RealModel, load_real_model, load_reference_tokenizer
except ImportError:  # tests collected as a package
    from tests.test_tokenizer import RealModel, load_real_model, load_reference_tokenizer


@pytest.fixture(scope="module", params=["smollm2", "qwen_coder"])
def real(request: pytest.FixtureRequest) -> RealModel:
    return load_real_model(request.param)


@pytest.fixture(scope="module")
def reference(real: RealModel) -> Any:
    return load_reference_tokenizer(real.name)


@pytest.fixture(scope="module")
def template(real: RealModel) -> ChatTemplate:
    return ChatTemplate.from_metadata(real.metadata, real.tokenizer)


CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant. Answer in «French» if asked 日本語."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And <b>3+3</b> & 😀?"},
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city, in °C (e.g. Zürich).",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. 東京"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}

TOOL_CONVERSATION = [
    {"role": "system", "content": "You can look up the weather."},
    {"role": "user", "content": "Weather in Zürich and 東京?"},
    {
        "role": "assistant",
        "content": None,  # as OpenAI clients send it alongside tool_calls
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "東京", "unit": "celsius"}},
            },
        ],
    },
    {"role": "tool", "content": '{"temperature": 21}'},
    {"role": "tool", "content": '{"temperature": 30}'},
    {"role": "user", "content": "Thanks, which is warmer?"},
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(
    template: ChatTemplate, reference: Any, add_generation_prompt: bool
) -> None:
    expected = reference.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert template.render(CONVERSATION, add_generation_prompt=add_generation_prompt) == expected
    assert ("<|im_start|>assistant\n" in expected[-30:]) is add_generation_prompt  # the flag matters


def test_default_system_prompt_matches_transformers(template: ChatTemplate, reference: Any) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert template.render(messages) == expected
    assert "system" in expected  # both templates insert their own system turn


def test_tools_match_transformers(template: ChatTemplate, reference: Any, real: RealModel) -> None:
    expected = reference.apply_chat_template(
        TOOL_CONVERSATION[:2], tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True
    )
    assert template.render(TOOL_CONVERSATION[:2], tools=[WEATHER_TOOL]) == expected
    if real.name == "qwen_coder":
        # tojson must leave non-ASCII alone, as HF's filter does.
        assert '"description": "City name, e.g. 東京"' in expected
        assert "<tools>" in expected


def test_tool_calls_and_results_match_transformers(template: ChatTemplate, reference: Any) -> None:
    if "tool_calls" not in template.source:
        pytest.skip("template has no tool support")
    expected = reference.apply_chat_template(
        TOOL_CONVERSATION, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True
    )
    rendered = template.render(TOOL_CONVERSATION, tools=[WEATHER_TOOL])
    assert rendered == expected
    call = '{"name": "get_weather", "arguments": {"city": "東京", "unit": "celsius"}}'
    assert f"<tool_call>\n{call}\n</tool_call>" in rendered
    assert "<tool_response>\n{\"temperature\": 21}\n</tool_response>" in rendered
    assert "None" not in rendered  # content=None was dropped, not printed


def test_null_content_without_tool_calls_renders_as_empty(template: ChatTemplate, reference: Any) -> None:
    # OpenAI clients may send an assistant turn as `content: null`; SmolLM2's template reads content unguarded.
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
                {"role": "user", "content": "Again?"}]
    expected = reference.apply_chat_template([{**m, "content": m["content"] or ""} for m in messages],
                                             tokenize=False, add_generation_prompt=True)
    assert template.render(messages) == expected


def test_null_content_beside_tool_calls_renders_as_empty(template: ChatTemplate, reference: Any) -> None:
    # The turn an OpenAI client sends back after a tool call: content null, its tool calls, then the tool's result.
    # SmolLM2's template reads every message's content unguarded, so the null must be empty text, not dropped.
    assert TOOL_CONVERSATION[2]["content"] is None and TOOL_CONVERSATION[2]["tool_calls"]
    expected = reference.apply_chat_template([{**m, "content": m["content"] or ""} for m in TOOL_CONVERSATION],
                                             tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
    assert template.render(TOOL_CONVERSATION, tools=[WEATHER_TOOL]) == expected


def test_continue_final_message_matches_transformers(template: ChatTemplate, reference: Any) -> None:
    messages = CONVERSATION + [{"role": "assistant", "content": "Bien sûr: "}]
    expected = reference.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    rendered = template.render(messages, add_generation_prompt=False, continue_final_message=True)
    assert rendered == expected
    assert rendered.endswith("Bien sûr: ")


def test_bos_and_eos_tokens_come_from_the_tokenizer(real: RealModel, template: ChatTemplate) -> None:
    tokens = real.metadata["tokenizer.ggml.tokens"]
    assert template.bos_token == tokens[real.metadata["tokenizer.ggml.bos_token_id"]]
    assert template.eos_token == tokens[real.metadata["tokenizer.ggml.eos_token_id"]]


def test_missing_template_is_a_clear_error(real: RealModel) -> None:
    metadata = {k: v for k, v in real.metadata.items() if k != "tokenizer.chat_template"}
    with pytest.raises(ChatTemplateError, match=r"no chat template \(tokenizer.chat_template missing\)"):
        ChatTemplate.from_metadata(metadata, real.tokenizer)


# --- the environment, on small templates; transformers' renderer is the reference ------------------

FEATURES_TEMPLATE = """\
{{ bos_token }}
{% set ns = namespace(count=0) %}
{% for message in messages %}
  {% if message.role == 'skip' %}{% continue %}{% endif %}
  {% set ns.count = ns.count + 1 %}
  {% generation %}[{{ message.role }}] {{ message.content | trim }}{% endgeneration %}
  {% if loop.index > 3 %}{% break %}{% endif %}
{% endfor %}
{{ ns.count }} {{ tools | tojson }}
{{ tools | tojson(indent=2, sort_keys=True) }}
{{ {'b': '<&>', 'a': 'é'} | tojson(separators=(',', ':')) }}
{{ dict(x=1) | tojson }} {{ flavour | default('none') }}
{% if add_generation_prompt %}<assistant>{% endif %}{{ eos_token }}"""

FEATURE_MESSAGES = [
    {"role": "user", "content": "  one  "},
    {"role": "skip", "content": "hidden"},
    {"role": "assistant", "content": "two"},
    {"role": "user", "content": "three"},
    {"role": "assistant", "content": "four"},
    {"role": "user", "content": "five (after break)"},
]


def _transformers_render(source: str, messages: list[dict], **kwargs: Any) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], chat_template=source, **kwargs)
    return rendered[0]


def test_environment_features_match_transformers() -> None:
    tools = [WEATHER_TOOL]
    ours = ChatTemplate(FEATURES_TEMPLATE, bos_token="<s>", eos_token="</s>").render(
        FEATURE_MESSAGES, tools=tools, flavour="vanilla"
    )
    expected = _transformers_render(
        FEATURES_TEMPLATE,
        FEATURE_MESSAGES,
        tools=tools,
        add_generation_prompt=True,
        bos_token="<s>",
        eos_token="</s>",
        flavour="vanilla",
    )
    assert ours == expected
    # Independent of transformers: stdlib json with the same arguments, and no HTML escaping.
    assert json.dumps(tools, indent=2, sort_keys=True, ensure_ascii=False) in ours
    assert '{"b":"<&>","a":"é"}' in ours
    assert "five" not in ours and "hidden" not in ours
    assert ours.startswith("<s>") and ours.endswith("<assistant></s>")


def test_strftime_now() -> None:
    template = ChatTemplate("{{ strftime_now('%Y') }}")
    before = datetime.now().year
    assert int(template.render([])) in (before, before + 1)


def test_raise_exception_becomes_chat_template_error() -> None:
    source = (
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('Conversation roles must be user/assistant, got ' + m.role) }}"
        "{% endif %}{{ m.content }}{% endfor %}"
    )
    template = ChatTemplate(source)
    assert template.render([{"role": "user", "content": "ok"}]) == "ok"
    with pytest.raises(ChatTemplateError) as info:
        template.render([{"role": "tool", "content": "x"}])
    assert str(info.value) == "Conversation roles must be user/assistant, got tool"


def test_template_that_cannot_compile_or_render() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}{{ m.content }}")
    with pytest.raises(ChatTemplateError, match="failed to render"):
        ChatTemplate("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "a"}])


def test_sandbox_blocks_python_internals() -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([])
    with pytest.raises(ChatTemplateError):  # immutable sandbox: the caller's list stays untouched
        ChatTemplate("{{ messages.append(1) }}").render([])


def test_caller_messages_are_not_modified() -> None:
    messages = [{"role": "assistant", "content": None, "reasoning": "hmm"}]
    rendered = ChatTemplate("{{ messages[0].reasoning_content }}|{{ messages[0].content is defined }}").render(messages)
    assert rendered == "hmm|False"
    assert messages == [{"role": "assistant", "content": None, "reasoning": "hmm"}]


def test_from_metadata_uses_the_tokenizer_for_special_tokens() -> None:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁hi"]
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * len(tokens),
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1],
        "tokenizer.chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}",
    }
    template = ChatTemplate.from_metadata(metadata, Tokenizer.from_metadata(metadata))
    assert template.render([{"role": "user", "content": "hi"}]) == "<s>hi</s>"


# The check Mistral's chat templates make on tool-call ids, word for word.
MISTRAL_LIKE = (
    "{%- for message in messages %}"
    "{%- if message.tool_calls is defined %}{%- for tc in message.tool_calls %}"
    "{%- if not tc.id is defined or tc.id|length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "[CALL {{ tc.id }} {{ tc.function.name }}]{%- endfor %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if message.tool_call_id|length != 9 %}{{- raise_exception('bad id') }}{%- endif %}"
    "[RESULT {{ message.tool_call_id }}]"
    "{%- else %}[{{ message.role }}: {{ message.content }}]{%- endif %}{%- endfor %}"
)


def test_tool_call_ids_fit_a_template_that_wants_nine_characters() -> None:
    """Mistral's templates accept only 9-alphanumeric ids; clients send back whatever the server (or OpenAI)
    gave them. A call and its result map to the same short id; a conforming id stays as it is."""
    calls = [{"id": "call_5f1c2e9a8b7d4c3e2f1a0b9c", "type": "function", "function": {"name": "f", "arguments": "{}"}},
             {"id": "AbC123xyz", "type": "function", "function": {"name": "g", "arguments": "{}"}}]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_5f1c2e9a8b7d4c3e2f1a0b9c", "content": "1"},
                {"role": "tool", "tool_call_id": "AbC123xyz", "content": "2"}]
    out = ChatTemplate(MISTRAL_LIKE).render(messages, add_generation_prompt=False)
    short = [part.split()[0] for part in out.split("[CALL ")[1:]]
    assert len(short[0]) == 9 and short[0].isalnum() and short[1] == "AbC123xyz"
    assert f"[RESULT {short[0]}]" in out and "[RESULT AbC123xyz]" in out
    assert messages[2]["tool_call_id"].startswith("call_")          # the caller's messages are left alone
    # A template without that check sees the ids as sent.
    plain = ChatTemplate("{% for m in messages %}{{ m.tool_call_id }}{% endfor %}")
    assert "call_5f1c2e9a8b7d4c3e2f1a0b9c" in plain.render(messages, add_generation_prompt=False)


DEEPSEEK_R1_TEMPLATE = (Path(__file__).parent / "templates" / "deepseek_r1.jinja").read_text()


@pytest.mark.parametrize("conversation", [CONVERSATION, TOOL_CONVERSATION[:3]], ids=["chat", "tool calls"])
def test_deepseek_r1_template_matches_transformers(conversation: list[dict]) -> None:
    """DeepSeek-R1's own template (tests/templates/deepseek_r1.jinja, from its tokenizer_config.json): rendered as
    transformers renders it. The template concatenates a call's arguments as text, so it gets them as JSON text
    where the server passes objects; transformers is given the text, as DeepSeek's template expects."""
    from transformers.utils.chat_template_utils import render_jinja_template
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    ours = ChatTemplate(DEEPSEEK_R1_TEMPLATE, bos_token=bos, eos_token=eos).render(conversation)
    as_text = json.loads(json.dumps(conversation))
    for message in as_text:
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"], ensure_ascii=False)
    [want], _ = render_jinja_template(conversations=[as_text], chat_template=DEEPSEEK_R1_TEMPLATE,
                                      add_generation_prompt=True, bos_token=bos, eos_token=eos)
    assert ours == want and ours.endswith("<｜Assistant｜><think>\n")
    if conversation is not CONVERSATION:
        assert '<｜tool▁sep｜>get_weather\n```json\n{"city": "Zürich"}\n```<｜tool▁call▁end｜>' in ours


def test_default_template_variables_apply_unless_the_call_sets_them() -> None:
    """vLLM's --default-chat-template-kwargs / llama.cpp's --chat-template-kwargs and --reasoning-budget 0: the
    defaults reach every render, a call's own variables win, and the flags parse or fail with one clear error."""
    import argparse
    from cobatch.chat_template import template_kwargs_flags
    from cobatch.errors import UserError
    template = ChatTemplate("{{ 'think' if enable_thinking | default(true) else 'plain' }}:"
                            "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert template.render(CONVERSATION[:1], add_generation_prompt=False).startswith("think:")
    template.defaults = {"enable_thinking": False}
    assert template.render(CONVERSATION[:1], add_generation_prompt=False).startswith("plain:")
    assert template.render(CONVERSATION[:1], add_generation_prompt=False, enable_thinking=True).startswith("think:")

    def flags(**given):
        return template_kwargs_flags(argparse.Namespace(**given))
    assert flags(chat_template_kwargs='{"enable_thinking": false, "x": 1}') == {"enable_thinking": False, "x": 1}
    assert flags(reasoning_budget=0) == {"enable_thinking": False}
    assert flags(reasoning_budget=-1) is None and flags() is None
    for bad in ({"chat_template_kwargs": "{"}, {"chat_template_kwargs": "[1]"},
                {"chat_template_kwargs": '{"messages": []}'}, {"reasoning_budget": 100}):
        with pytest.raises(UserError):
            flags(**bad)
