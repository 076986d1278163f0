"""Constrained decoding (engine/grammar.py): the token mask, and JSON output from the real SmolLM2 weights."""

from __future__ import annotations

import json
import re

import pytest
import torch

from cobatch.engine import grammar
from cobatch.engine.grammar import GrammarError, apply_token_masks, json_grammar, schema_from_response_format
from cobatch.engine.sampler import SamplingParams
from cobatch.errors import UserError
from model_fixtures import load_llm

pytest.importorskip("llguidance")

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer"},
                         "role": {"enum": ["admin", "user", "guest"]}}}
QUESTION = [{"role": "user", "content": "Describe a user of a web site as JSON: name, age and role."}]


def conforms_to_person(value) -> bool:
    """PERSON checked by hand (an independent reading of the schema, not llguidance's)."""
    return (isinstance(value, dict) and set(value) == {"name", "age", "role"}
            and isinstance(value["name"], str) and len(value["name"]) <= 12
            and isinstance(value["age"], int) and not isinstance(value["age"], bool)
            and value["role"] in ("admin", "user", "guest"))


def test_token_masks_set_exactly_the_left_out_logits_to_minus_inf():
    gen = torch.Generator().manual_seed(0)
    vocab = 70                                  # not a multiple of 32: the last word is partial
    logits = torch.randn(3, vocab, generator=gen)
    masks = [torch.randint(-2**31, 2**31 - 1, (3,), dtype=torch.int32, generator=gen), None,
             torch.zeros(3, dtype=torch.int32)]
    masks[2][1] = 1 << 5                        # row 2 allows token 37 only
    out = apply_token_masks(logits, masks)
    for row, mask in enumerate(masks):
        for t in range(vocab):
            allowed = mask is None or (int(mask[t // 32]) >> (t % 32)) & 1
            assert out[row, t].item() == (logits[row, t].item() if allowed else float("-inf")), (row, t)
    assert apply_token_masks(logits, [None, None, None]) is logits


def test_response_format_parsing():
    assert schema_from_response_format({"type": "text"}) == (False, None)
    assert schema_from_response_format({"type": "json_object"}) == (True, None)
    assert schema_from_response_format({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}) \
        == (True, PERSON)
    for bad in ({"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 3}}, {"type": "yaml"}):
        with pytest.raises(ValueError):
            schema_from_response_format(bad)


@pytest.fixture(scope="module")
def smol():
    return load_llm("smollm2")


def test_greedy_and_sampled_output_follows_the_schema(smol):
    ids = smol.encode_chat(QUESTION)
    g = json_grammar(PERSON)
    params = [SamplingParams(temperature=0, max_tokens=80, grammar=g)]
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=80, grammar=g) for s in range(4)]
    seq_ids = [smol.engine.add_request(ids, p) for p in params]
    outputs = {i: [] for i in seq_ids}
    reasons = {}
    while smol.engine.has_work():
        for o in smol.engine.step():
            if o.new_token is not None:
                outputs[o.request_id].append(o.new_token)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    for i in seq_ids:
        text = smol.tokenizer.decode(outputs[i])
        assert conforms_to_person(json.loads(text)), text
        assert reasons[i] == "stop" and not any(t in smol.tokenizer.stop_ids for t in outputs[i])


def test_json_object_mode_gives_an_object(smol):
    ids = smol.encode_chat([{"role": "user", "content": "List three colors."}])
    out = smol.engine.generate([ids], SamplingParams(temperature=0, max_tokens=60, grammar=json_grammar(None)))[0]
    assert isinstance(json.loads(smol.tokenizer.decode(out)), dict)


def test_bad_schema_and_missing_library_are_user_errors(smol, monkeypatch):
    with pytest.raises(GrammarError):
        smol.engine.grammars.check(json_grammar({"type": "frobnicate"}))
    ids = smol.encode_chat(QUESTION)
    with pytest.raises(UserError):
        smol.engine.add_request(ids, SamplingParams(grammar="this is not a grammar ::= ???"))
    assert not smol.engine.has_work()
    monkeypatch.setattr(grammar, "llguidance", None)
    with pytest.raises(GrammarError, match="llguidance"):
        json_grammar(None)


def test_a_checked_grammar_is_not_compiled_again_on_the_engine_thread(smol, monkeypatch):
    """The server compiles in a worker thread (check); the engine's matcher() must only copy that."""
    import llguidance
    g = json_grammar({"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]})
    compiled = []
    real = llguidance.LLMatcher

    def counting(*args, **kwargs):
        compiled.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLMatcher", counting)
    grammars = grammar.Grammars(smol.tokenizer, smol.config.vocab_size)
    grammars.check(g)
    first, second = grammars.matcher(g), grammars.matcher(g)
    assert compiled == [g]
    first.accept(smol.tokenizer.encode("{", add_special=False)[0])
    assert not torch.equal(first.allowed(), second.allowed())     # copies advance independently


def test_parallel_masks_equal_one_at_a_time(smol):
    from cobatch.engine.grammar import allowed_masks
    grammars = grammar.Grammars(smol.tokenizer, smol.config.vocab_size)
    matchers = [grammars.matcher(json_grammar(PERSON)), grammars.matcher(json_grammar(None)),
                grammars.matcher(json_grammar(PERSON))]
    for token in smol.tokenizer.encode('{"name', add_special=False):
        matchers[2].accept(token)
    together = allowed_masks(matchers)
    assert [torch.equal(together[i], m.allowed()) for i, m in enumerate(matchers)] == [True] * 3
    assert not torch.equal(together[0], together[2])


def test_structured_grammars_compile_and_bad_ones_are_user_errors(smol):
    for kind, value in (("json", PERSON), ("json", json.dumps(PERSON)), ("regex", r"[0-9]{4}"),
                        ("choice", ["yes", 'a "quoted" answer']), ("grammar", 'root ::= "a" | "b"'),
                        ("grammar", 'start: "a" | "b"')):                   # GBNF and Lark
        smol.engine.grammars.check(grammar.structured_grammar(kind, value))
    for kind, value in (("json", "{"), ("json", [1]), ("choice", []), ("choice", ["a", 2]), ("choice", [""]),
                        ("regex", ""), ("regex", 5), ("grammar", "root ::= (("), ("yaml", "x")):
        with pytest.raises(GrammarError):
            grammar.structured_grammar(kind, value)
    with pytest.raises(GrammarError):            # a regex fails when compiled against the vocabulary
        smol.engine.grammars.check(grammar.structured_grammar("regex", "(("))


def test_choice_and_regex_outputs_from_the_real_weights(smol):
    """Each output checked with Python's re, not with llguidance; sampled rows too stay inside."""
    ids = smol.encode_chat([{"role": "user", "content": "Name a French city and a year."}])
    choices = ["Paris", "Lyon", "a city I do not know"]
    regex = r"[A-Z][a-z]+, [0-9]{4}"
    for kind, value, ok in (("choice", choices, lambda t: t in choices),
                            ("regex", regex, lambda t: re.fullmatch(regex, t) is not None)):
        g = grammar.structured_grammar(kind, value)
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=30, grammar=g) for s in range(3)]
        for out in smol.engine.generate([ids] * len(params), params):
            text = smol.tokenizer.decode(out)
            assert ok(text), (kind, text)


def _accepts(grammars, source: str, tokenizer, text: str) -> bool:
    matcher = grammars.matcher(source)._matcher
    return matcher.consume_tokens(tokenizer.encode(text, add_special=False)) and matcher.is_accepting()


def test_forced_xml_call_takes_the_schema_and_nothing_else(smol):
    """tool_choice "required" under a template that shows Qwen3-Coder's calls: each parameter's value as its
    kind is written, the required ones present, and a string holding no closing tag of its own."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": ["s"],
            "properties": {"s": {"type": "string"}, "n": {"type": "integer"}, "u": {"enum": ["c", "f"]},
                           "o": {"type": "object", "properties": {"x": {"type": "number"}}}}}}}
    source = grammar.forced_tool_call_grammar([tool], "xml", parallel=False)

    def call(*members: str) -> str:
        return "<tool_call>\n<function=f>\n" + "".join(members) + "</function>\n</tool_call>"

    def member(key: str, value: str) -> str:
        return f"<parameter={key}>\n{value}\n</parameter>\n"

    def accepts(text: str) -> bool:
        return _accepts(smol.engine.grammars, source, smol.tokenizer, text)

    assert accepts(call(member("s", "two\nlines <b>"), member("n", "-12"), member("u", "c"), member("o", '{"x": 1.5}')))
    assert accepts(call(member("s", "")))
    assert not accepts(call(member("n", "1")))                                  # s is required
    assert not accepts(call(member("s", "a"), member("n", "1.5")))              # n is an integer
    assert not accepts(call(member("s", "a"), member("u", "k")))                # u is one of its enum
    assert not accepts(call(member("s", "a\n</parameter>\nb")))                 # the value's end, inside it
    assert not accepts(call(member("s", "a"), member("s", "b")))                # each parameter once
