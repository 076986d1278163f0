"""Streaming text pieces of the server, without a server: stop strings, UTF-8, reasoning and tool calls.

Every case is fed whole and split at every pair of positions: the result must never depend on where the
chunk boundaries fall.
"""

from __future__ import annotations

import itertools

import pytest

from cobatch.server.output_events import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallStart
from cobatch.server.output_parser import OutputParser
from cobatch.server.tool_call_readers import match_tool_header
from cobatch.server.stream import StopStringFilter, TextStream
from model_fixtures import load_llm


def _splits(text: str):
    """text cut into three pieces at every pair of positions."""
    for i, j in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        yield [text[:i], text[i:j], text[j:]]


# --- stop strings ------------------------------------------------------------------------------------

def _filter(pieces: list[str], stops: list[str]) -> tuple[list[str], str | None]:
    f = StopStringFilter(stops)
    out = [f.push(p) for p in pieces] + [f.flush()]
    return out, f.matched


@pytest.mark.parametrize("text,stops,expected,matched", [
    ("Hello world. Goodbye.", ["world"], "Hello ", "world"),
    ("Hello world. Goodbye.", ["Good", "o w"], "Hell", "o w"),          # the earliest stop wins
    ("no stop in here", ["STOP"], "no stop in here", None),
    ("ends with a partial ST", ["STOP"], "ends with a partial ST", None),  # held back, then flushed
    ("aaab", ["aab"], "a", "aab"),                                          # overlapping prefixes
    ("café ☕ end", ["☕"], "café ", "☕"),
])
def test_stop_strings_never_leak_whatever_the_split(text, stops, expected, matched):
    for pieces in _splits(text):
        out, hit = _filter(pieces, stops)
        assert "".join(out) == expected and hit == matched, pieces
        if matched:
            assert not any(matched in piece for piece in out)


def test_text_stream_keeps_multibyte_characters_whole():
    tok = load_llm("smollm2").tokenizer
    text = "naïve café — 😀 日本語 ok"
    ids = tok.encode(text, add_special=False)
    assert any(_not_utf8(tok.token_bytes(t)) for t in ids)      # some tokens are parts of a character
    stream = TextStream(tok, stops=["日本"])
    chunks = [stream.push(t) for t in ids] + [stream.finish()]
    assert "".join(chunks) == "naïve café — 😀 " and stream.stop_matched == "日本"
    assert not any("\ufffd" in c for c in chunks)


def test_text_stream_keeps_the_special_tokens_it_is_asked_to():
    """Tool-call markers that are control tokens (Mistral's [TOOL_CALLS]) reach the output parser; other special
    tokens stay out of the text, and a marker the vocabulary does not hold as one token is not looked for."""
    tok = load_llm("smollm2").tokenizer
    (end,) = tok.encode("<|im_end|>", add_special=False)
    assert tok.is_special(end)
    assert tok.special_ids(["<|im_end|>", "[TOOL_CALLS]", "hello"]) == {end}
    ids = tok.encode("Hi<|im_end|><|im_start|>", add_special=False)
    plain = TextStream(tok)
    assert "".join(plain.push(i) for i in ids) + plain.finish() == "Hi"
    kept = TextStream(tok, keep_special={end})
    assert "".join(kept.push(i) for i in ids) + kept.finish() == "Hi<|im_end|>"


def _not_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


# --- reasoning and tool calls ------------------------------------------------------------------------

def _parse(pieces: list[str], **kwargs) -> tuple[str, str, list[tuple[str, str]]]:
    parser = OutputParser(**kwargs)
    events = [e for p in pieces for e in parser.push(p)] + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ToolCallStart):
            assert e.index not in calls, "a call starts once"
            calls[e.index] = [e.name, ""]
        elif isinstance(e, ToolCallArgsDelta):
            calls[e.index][1] += e.text
    return content, reasoning, [tuple(calls[i]) for i in sorted(calls)]


WEATHER = ["get_weather"]
XML_SCHEMA = {"type": "object", "properties": {
    "s": {"type": "string"}, "n": {"type": "integer"}, "b": {"type": "boolean"}, "o": {"type": "object"},
    "x": {"type": "number"}, "a": {"type": "array"}, "i": {"type": ["integer", "null"]}}}
XML_TOOLS = {"tool_names": ["f", "g"], "tool_schemas": {"f": XML_SCHEMA, "g": {"type": "object"}}}
DS_BLOCK, DS_BLOCK_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
PARSE_CASES = [
    ("plain text", "Hello world", {}, ("Hello world", "", [])),
    ("leading space kept", " Paris.", {}, (" Paris.", "", [])),
    ("think block", "<think>hmm\nok</think>\n\nThe answer", {}, ("The answer", "hmm\nok", [])),
    ("think off", "<think>x</think>y", {"reasoning": False}, ("<think>x</think>y", "", [])),
    ("prompt opened think", "hmm</think>answer", {"start_in_reasoning": True}, ("answer", "hmm", [])),
    ("unclosed think", "<think>abc", {}, ("", "abc", [])),
    ("think only at the start", "a < b <think> c", {}, ("a < b <think> c", "", [])),
    ("Magistral's think block", "[THINK]hmm[/THINK]\nThe answer", {}, ("The answer", "hmm", [])),
    ("Magistral's think off", "[THINK]x[/THINK]y", {"reasoning": False}, ("[THINK]x[/THINK]y", "", [])),
    ("a block ends only at its own closing", "<think>a[/THINK]b</think>c", {}, ("c", "a[/THINK]b", [])),
    ("tagged call after text",
     'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris", "n": {"x": [1,2]}}}\n</tool_call>',
     {"tool_names": WEATHER}, ("Sure.", "", [("get_weather", '{"city": "Pa\\"ris", "n": {"x": [1,2]}}')])),
    ("two tagged calls, keys in any order",
     '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"arguments": {"q": 1}, "name": "b"}</tool_call>',
     {"tool_names": ["a", "b"]}, ("", "", [("a", "{}"), ("b", '{"q": 1}')])),
    ("arguments as a JSON string", '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>',
     {"tool_names": ["a"]}, ("", "", [("a", '{"x": 1}')])),
    ("cut off mid-arguments", '<tool_call>{"name": "a", "arguments": {"x": 1', {"tool_names": ["a"]},
     ("", "", [("a", '{"x": 1')])),
    ("unparsable tagged call is text", "use <tool_ca and <tool_call>{bad json</tool_call> end",
     {"tool_names": ["x"]}, ("use <tool_ca and<tool_call>{bad json</tool_call> end", "", [])),
    ("tags without tools are text", '<tool_call>{"name": "a", "arguments": {}}</tool_call>', {},
     ('<tool_call>{"name": "a", "arguments": {}}</tool_call>', "", [])),
    ("bare call", '{"name": "get_weather", "arguments": {"city": "Berlin"}}', {"tool_names": WEATHER},
     ("", "", [("get_weather", '{"city": "Berlin"}')])),
    ("fenced bare call", '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
     {"tool_names": WEATHER}, ("", "", [("get_weather", '{\n    "city": "Paris"\n  }')])),
    ("two fenced bare calls",
     '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\n'
     '```json\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n```',
     {"tool_names": WEATHER}, ("", "", [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')])),
    ("bare JSON naming an undeclared tool is text", '{"name": "other", "arguments": {"city": "Berlin"}}',
     {"tool_names": WEATHER}, ('{"name": "other", "arguments": {"city": "Berlin"}}', "", [])),
    ("other JSON is text", '{"a": 1}', {"tool_names": WEATHER}, ('{"a": 1}', "", [])),
    ("code fence is text", "```python\nprint(1)\n```", {"tool_names": WEATHER}, ("```python\nprint(1)\n```", "", [])),
    ("think then call", '<think>need weather</think>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}',
     {"tool_names": WEATHER}, ("", "need weather", [("get_weather", '{"city": "Oslo"}')])),
    ("bare list of calls (Mistral, Phi-4-mini)",
     '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]',
     {"tool_names": WEATHER}, ("", "", [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')])),
    ("bare list, Llama's parameters, then text",
     '[ {"name": "get_weather", "parameters": {"city": "Oslo"}} ]\nDone.',
     {"tool_names": WEATHER}, ("Done.", "", [("get_weather", '{"city": "Oslo"}')])),
    ("list of other JSON is text", '[1, 2, {"name": "get_weather"}]', {"tool_names": WEATHER},
     ('[1, 2, {"name": "get_weather"}]', "", [])),
    ("list without tools is text", '[{"name": "get_weather", "arguments": {}}]', {},
     ('[{"name": "get_weather", "arguments": {}}]', "", [])),
    ("list breaking off after a call", '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, oops',
     {"tool_names": WEATHER}, (", oops", "", [("get_weather", '{"city": "Oslo"}')])),
    # DeepSeek V3 / R1 (the type, then the name on its line, the arguments fenced) and V3.1 (name, arguments)
    ("DeepSeek R1: think, text, a call",
     '<think>hm</think>Ok.' + DS_BLOCK + DS_CALL + 'function' + DS_SEP + 'f\n```json\n{"x": "`"}\n```' + DS_END
     + DS_BLOCK_END, {"tool_names": ["f"]}, ("Ok.", "hm", [("f", '{"x": "`"}')])),
    ("DeepSeek V3.1: name, then arguments", DS_BLOCK + DS_CALL + 'a' + DS_SEP + '{"x": 1}' + DS_END + DS_BLOCK_END,
     {"tool_names": ["a"]}, ("", "", [("a", '{"x": 1}')])),
    ("DeepSeek: cut off mid-arguments", DS_BLOCK + DS_CALL + 'function' + DS_SEP + 'a\n```json\n{"x": 1',
     {"tool_names": ["a"]}, ("", "", [("a", '{"x": 1')])),
    ("DeepSeek markers without tools are text", DS_CALL + 'a' + DS_SEP + '{}' + DS_END, {},
     (DS_CALL + 'a' + DS_SEP + '{}' + DS_END, "", [])),
    # Qwen3-Coder: parameters as raw text, typed by the declared schema
    ("XML call after text", 'Ok.\n<tool_call>\n<function=f>\n<parameter=s>\na "b"\nc\n</parameter>\n'
     '<parameter=n>\n 42 \n</parameter>\n</function>\n</tool_call>', XML_TOOLS,
     ("Ok.", "", [("f", '{"s": "a \\"b\\"\\nc", "n": 42}')])),
    ("XML values of every kind", '<tool_call><function=f><parameter=b>True</parameter><parameter=o>{\'k\': None}'
     '</parameter><parameter=x>1.5</parameter><parameter=a>[1, "2"]</parameter><parameter=i>null</parameter>'
     '</function></tool_call>', XML_TOOLS,
     ("", "", [("f", '{"b": true, "o": {"k": null}, "x": 1.5, "a": [1, "2"], "i": null}')])),
    ("XML value not of its kind stays text", '<function=f><parameter=n>\nmany\n</parameter></function>', XML_TOOLS,
     ("", "", [("f", '{"n": "many"}')])),
    ("XML parameter the schema does not declare is text", '<function=f><parameter=q>\n7\n</parameter></function>',
     XML_TOOLS, ("", "", [("f", '{"q": "7"}')])),
    ("XML closing tags left out", '<function=f>\n<parameter=s>\nx\n<parameter=n>\n1\n</function> Done.', XML_TOOLS,
     ("Done.", "", [("f", '{"s": "x", "n": 1}')])),
    ("XML two calls, no parameters", '<tool_call>\n<function=f>\n</function>\n</tool_call>\n<tool_call>\n'
     '<function=g>\n</function>\n</tool_call>', XML_TOOLS, ("", "", [("f", "{}"), ("g", "{}")])),
    ("XML cut off inside a string", '<tool_call>\n<function=f>\n<parameter=s>\nhalf\n</para', XML_TOOLS,
     ("", "", [("f", '{"s": "half"}')])),
    ("Llama 3.1: JSON arguments", 'Sure. <function=f>{"s": "<x>", "n": 1}</function>', XML_TOOLS,
     ("Sure.", "", [("f", '{"s": "<x>", "n": 1}')])),
    ("no XML call: a name on two lines", 'a <function=f\ng> b', XML_TOOLS, ("a <function=f\ng> b", "", [])),
    ("XML markers without tools are text", '<function=f></function>', {}, ('<function=f></function>', "", [])),
    # Mistral's v11 tokenizers on: [TOOL_CALLS]NAME[ARGS]{...} (control tokens the text keeps when tools are declared)
    ("Mistral v11: text, then two calls", 'Checking.[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{"q": [1, "]}"]}',
     {"tool_names": ["a", "b"]}, ("Checking.", "", [("a", "{}"), ("b", '{"q": [1, "]}"]}')])),
    ("Mistral: a call id", '[TOOL_CALLS]a[CALL_ID]x1Y2z3W4v[ARGS]{"x": 1} ', {"tool_names": ["a"]},
     ("", "", [("a", '{"x": 1}')])),
    ("Mistral: its older list", '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}]', {"tool_names": ["a"]},
     ("", "", [("a", '{"x": 1}')])),
    ("Mistral: cut off mid-arguments", '[TOOL_CALLS]a[ARGS]{"x": [1', {"tool_names": ["a"]},
     ("", "", [("a", '{"x": [1')])),
    ("Mistral: a marker and no call", '[TOOL_CALLS]no arguments here', {"tool_names": ["a"]},
     ("no arguments here", "", [])),
]


@pytest.mark.parametrize("name,text,kwargs,expected", PARSE_CASES, ids=[c[0] for c in PARSE_CASES])
def test_output_parser_whatever_the_split(name, text, kwargs, expected):
    for pieces in _splits(text):
        assert _parse(pieces, **kwargs) == expected, pieces
    assert _parse(list(text), **kwargs) == expected      # one character at a time


def test_tool_arguments_stream_before_the_call_ends():
    parser = OutputParser(tool_names=WEATHER)
    events = parser.push('<tool_call>{"name": "get_weather", "arguments": {"ci')
    assert events == [ToolCallStart(0, "get_weather"), ToolCallArgsDelta(0, '{"ci')]
    assert parser.push('ty": "Rome"}') == [ToolCallArgsDelta(0, 'ty": "Rome"}')]
    assert parser.push("}\n</tool_call>") + parser.finish() == []
    assert parser.num_tool_calls == 1


def test_deepseek_v3_two_calls_then_text_whatever_the_cut():
    """Cut in two at every position (the three-piece cuts of PARSE_CASES take seconds on this length)."""
    text = (DS_BLOCK + DS_CALL + 'function' + DS_SEP + 'a\n```json\n{}\n```' + DS_END + '\n' + DS_CALL + 'function'
            + DS_SEP + 'b\n```json\n[1]\n```' + DS_END + DS_BLOCK_END + ' Done.')
    for cut in range(len(text) + 1):
        assert _parse([text[:cut], text[cut:]], tool_names=["a", "b"]) == ("Done.", "", [("a", "{}"), ("b", "[1]")])
    assert _parse(list(text), tool_names=["a", "b"]) == ("Done.", "", [("a", "{}"), ("b", "[1]")])


def test_deepseek_tool_arguments_stream_before_the_call_ends():
    parser = OutputParser(tool_names=WEATHER)
    assert parser.push(DS_BLOCK + DS_CALL + "function" + DS_SEP + "get_weather\n```json\n") == [
        ToolCallStart(0, "get_weather")]
    assert parser.push('{"city": "Rome"}\n``') == [ToolCallArgsDelta(0, '{"city": "Rome"}')]    # the fence held
    assert parser.push("`" + DS_END + DS_BLOCK_END) + parser.finish() == []
    assert parser.num_tool_calls == 1


def test_xml_string_parameter_streams_before_it_ends():
    """A string's text goes out as it comes, less a newline or the start of a closing tag that may end it; a typed
    value waits for its end."""
    parser = OutputParser(**XML_TOOLS)
    assert parser.push("<tool_call>\n<function=f>\n<parameter=s>\nline 1\n") == [
        ToolCallStart(0, "f"), ToolCallArgsDelta(0, '{"s": "line 1')]
    assert parser.push('"2"\n</param') == [ToolCallArgsDelta(0, '\\n\\"2\\"')]
    assert parser.push("eter>\n<parameter=n>\n12") == [ToolCallArgsDelta(0, '"')]
    assert parser.push("3\n</parameter>\n</function>\n</tool_call>") == [ToolCallArgsDelta(0, ', "n": 123}')]
    assert parser.finish() == [] and parser.num_tool_calls == 1


def test_xml_call_and_text_whatever_the_cut():
    text = ('I will look.\n\n<tool_call>\n<function=f>\n<parameter=s>\n<div>\n  x\n</div>\n</parameter>\n'
            '<parameter=b>\nfalse\n</parameter>\n</function>\n</tool_call>')
    want = ("I will look.", "", [("f", '{"s": "<div>\\n  x\\n</div>", "b": false}')])
    for cut in range(len(text) + 1):
        assert _parse([text[:cut], text[cut:]], **XML_TOOLS) == want, cut
    assert _parse(list(text), **XML_TOOLS) == want


def test_tool_header_matching():
    assert match_tool_header('{"name": "f", "arguments": {')[:2] == ("ok", "f")
    assert match_tool_header(' {\n "name" : "f" , "parameters" : [')[:2] == ("ok", "f")
    for prefix in ("", "{", '{"na', '{"name": "f', '{"name": "f", "arg', '{"name": "f", "arguments": '):
        assert match_tool_header(prefix)[0] == "partial", prefix
    for other in ('{"x"', "[", '{"name": 3', '{"name": "f"}'):
        assert match_tool_header(other)[0] == "no", other
