"""Constrained decoding: a grammar (a JSON schema, a regex, a list of choices, GBNF or Lark) limits which tokens a
request may sample.

llguidance, the grammar engine vLLM and llama.cpp use for this, keeps one matcher per request. Before a
row is sampled its matcher gives the allowed tokens as a bitmask (a few hundred microseconds on the host,
while the GPU runs the step's forward pass); the sampler sets every other logit to -inf, so greedy and
sampled rows alike stay inside the grammar, and an end-of-turn token is allowed only where the grammar may
end. After the step the matcher consumes the token; once the grammar is complete the request finishes.

llguidance is an optional dependency: without it, a request with a grammar is refused with a clear error.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from cobatch.errors import UserError
from cobatch.tokenizer import Tokenizer

try:
    import llguidance
except ImportError:  # pragma: no cover - exercised only where llguidance is not installed
    llguidance = None


class GrammarError(UserError):
    """The grammar (e.g. a JSON schema) cannot be compiled, or constrained decoding is unavailable."""


JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_grammar(schema: dict[str, Any] | None) -> str:
    """A grammar for the JSON text of a value matching `schema`; None: any JSON object (OpenAI's json_object).
    Separators are fixed (", " and ": ", as json.dumps writes them, no other whitespace): free whitespace lets
    small models wander into endless newlines."""
    if llguidance is None:
        raise GrammarError("constrained decoding (response_format) needs the llguidance package")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"} if schema is None else schema,
                                                             defaults=JSON_LAYOUT)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from None


# vLLM's structured outputs: its `structured_outputs` keys (and the older guided_* fields) -> llguidance formats
STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def structured_grammar(kind: str, value: Any) -> str:
    """A grammar from one of vLLM's structured outputs: `json` (a schema, or its JSON text), `regex` (Rust regex
    syntax, as vLLM's llguidance backend takes it), `choice` (a list of strings: the output is one of them) or
    `grammar` (GBNF as llama.cpp writes it, or Lark). JSON keeps json_grammar's fixed separators. A regex or
    grammar that is invalid fails when compiled (Grammars.check), with llguidance's message."""
    if llguidance is None:
        raise GrammarError("constrained decoding (structured outputs) needs the llguidance package")
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise GrammarError("a JSON schema must be an object")
        return json_grammar(value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise GrammarError("choice must be a non-empty list of non-empty strings")
        value = json.dumps(value)
    elif kind not in STRUCTURED_KINDS or not isinstance(value, str) or not value.strip():
        raise GrammarError(f"{kind} must be a non-empty string")
    try:
        return llguidance.grammar_from(STRUCTURED_KINDS[kind], value)
    except ValueError as exc:
        raise GrammarError(f"invalid {kind}: {exc}") from None


# A JSON schema's type names, and the other names tool definitions use for them, by the kind of value they take
_KINDS = {**dict.fromkeys(("string", "str", "text", "varchar", "char", "enum"), "string"),
          **dict.fromkeys(("integer", "int", "long", "short"), "integer"),
          **dict.fromkeys(("number", "float", "double", "num", "decimal"), "number"),
          **dict.fromkeys(("boolean", "bool", "binary"), "boolean"),
          **dict.fromkeys(("object", "dict", "array", "arr", "list"), "json")}


def parameter_kind(schema) -> str:
    """"string", "integer", "number", "boolean" or "json" (any other JSON value): the kind of value a tool's parameter
    takes by its JSON schema, where a call writes it as text (Qwen3-Coder's XML); a string where it declares no type."""
    if not isinstance(schema, Mapping):
        return "string"
    declared = schema.get("type")
    if isinstance(declared, list):       # ["integer", "null"]: the type that is not null
        declared = next((t for t in declared if t != "null"), None)
    if isinstance(declared, str):
        return _KINDS.get(declared.lower(), "string")
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return parameter_kind(schema[key][0])
    return "string"


# How a call is written: the bare JSON object, the JSON object inside <tool_call> tags (Qwen2.5, Hermes), or
# Qwen3-Coder's <tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>
TOOL_CALL_STYLES = ("json", "tagged", "xml")


def forced_tool_call_grammar(tools: list[dict[str, Any]], style: str, parallel: bool) -> str:
    """A grammar under which the output is a call of one of `tools` (OpenAI function dicts): tool_choice
    "required" (Anthropic "any") or a named tool, in one of TOOL_CALL_STYLES, written the way
    server/output_parser.py reads calls back. `parallel`: one call or more."""
    assert style in TOOL_CALL_STYLES, style
    if llguidance is None:
        raise GrammarError("tool_choice 'required' (constrained decoding) needs the llguidance package")
    if style == "xml":
        rules = [_xml_call_rule(f"call{i}", t["function"]) for i, t in enumerate(tools)]
        call = " | ".join(f"call{i}" for i in range(len(tools)))
        one = f'"<tool_call>\\n" ({call}) "\\n</tool_call>"'
        start = f"start: {one}" + (f' ("\\n" {one})*' if parallel else "")
        return llguidance.LLMatcher.grammar_from_lark("\n".join([start, *rules, _XML_TEXT_RULE]))
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t["function"]["name"]},
                             "arguments": t["function"].get("parameters") or {"type": "object"}}} for t in tools]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_LAYOUT}
    one = '"<tool_call>\\n" call "\\n</tool_call>"' if style == "tagged" else "call"
    start = f"start: {one}" + (f' ("\\n" {one})*' if parallel else "")
    return llguidance.LLMatcher.grammar_from_lark(f"{start}\ncall: %json {json.dumps(schema)}")


# A string parameter's text and its end, as one lexeme (a greedy lexer could not tell where text that may hold
# anything stops): any text, then "\n</parameter>\n", holding no other </parameter> and none of the tags the
# output parser would take for the value's end
_XML_TEXT_RULE = (r"XML_TEXT: /(?s:.*)\n<\/parameter>\n/ & ~/(?s:.*<\/parameter>(?s:.){2,})/"
                  r" & ~/(?s:.*(<parameter=|<\/function>).*)/")
_XML_VALUE_END = json.dumps("\n</parameter>\n")
_XML_TYPED_VALUES = {"integer": r"/-?(0|[1-9][0-9]*)/", "boolean": '("true" | "false")',
                     "number": r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/"}


def _xml_call_rule(rule: str, function: dict[str, Any]) -> str:
    """One function's call in Qwen3-Coder's form: its required parameters, then any of the others, in the order
    the schema lists them, each value as its kind is written (tool_call_readers.XmlToolCall reads them)."""
    parameters = function.get("parameters") or {}
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())
    parts = [json.dumps(f"<function={function['name']}>\n")]
    for key, schema in properties.items():
        kind = parameter_kind(schema)
        enum = schema.get("enum") if isinstance(schema, Mapping) else None
        if kind == "string" and isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            value = "(" + " | ".join(json.dumps(v) for v in enum) + ") " + _XML_VALUE_END
        elif kind == "string":
            value = "XML_TEXT"
        elif kind == "json":
            value = f"%json {json.dumps({**schema, 'x-guidance': JSON_LAYOUT})} {_XML_VALUE_END}"
        else:
            value = f"{_XML_TYPED_VALUES[kind]} {_XML_VALUE_END}"
        member = f"{json.dumps(f'<parameter={key}>{chr(10)}')} {value}"
        parts.append(member if key in required else f"({member})?")
    parts.append(json.dumps("</function>"))
    return f"{rule}: " + " ".join(parts)


class Grammars:
    """Compiles grammars against one vocabulary (built once, on first use: about 0.1 s for 50k tokens).

    Compiling a big schema can take 100 ms or more, which must not happen on the engine thread (every stream
    would wait): the server calls `check` from a worker thread first, which keeps the compiled matcher, and
    the engine's `matcher` then only copies it. Thread-safe."""

    CACHED = 64         # compiled grammars kept (least recently used dropped)

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lltokenizer = None
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def _vocabulary(self):
        if llguidance is None:
            raise GrammarError("constrained decoding (response_format) needs the llguidance package")
        with self._lock:
            if self._lltokenizer is None:
                self._lltokenizer = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(_Vocabulary(self._tokenizer)), n_vocab=self.vocab_size,
                    eos_token=sorted(self._tokenizer.stop_ids))
            return self._lltokenizer

    def _compiled_matcher(self, grammar: str):
        """A fresh (never advanced) matcher of `grammar`, compiled once; GrammarError if it does not compile."""
        with self._lock:
            template = self._compiled.get(grammar)
            if template is not None:
                self._compiled.move_to_end(grammar)
        if template is None:
            template = llguidance.LLMatcher(self._vocabulary(), grammar, log_level=0)
            if template.is_error():
                raise GrammarError(f"invalid grammar: {template.get_error()}")
            if TokenMatcher(template.deep_copy(), self.vocab_size).refuses_everything():
                raise GrammarError("invalid grammar: no text satisfies it (e.g. a rule defined only by itself, or "
                                   "a regex or schema that nothing matches)")
            with self._lock:
                self._compiled[grammar] = template
                while len(self._compiled) > self.CACHED:
                    self._compiled.popitem(last=False)
        return template

    def check(self, grammar: str) -> None:
        """Compile `grammar` (kept for `matcher`); GrammarError with llguidance's message if it does not."""
        self._compiled_matcher(grammar)

    def matcher(self, grammar: str) -> TokenMatcher:
        return TokenMatcher(self._compiled_matcher(grammar).deep_copy(), self.vocab_size)


class TokenMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher, vocab_size: int):
        if matcher.is_error():
            raise GrammarError(f"invalid grammar: {matcher.get_error()}")
        self._matcher = matcher
        self._words = (vocab_size + 31) // 32

    def allowed(self) -> torch.Tensor:
        """The tokens the grammar allows next: int32 [ceil(V / 32)] on the CPU, bit t % 32 of word t // 32."""
        return allowed_masks([self])[0]

    def accept(self, token: int) -> None:
        self._matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar is complete (or broken): nothing but an end of turn may follow."""
        return self._matcher.is_stopped() or self._matcher.is_error()

    @property
    def failed(self) -> bool:
        """llguidance gave up on the output (a limit of its lexer or parser, e.g. a regex repeated a million
        times): the text so far does not complete the grammar, and nothing can follow it."""
        return self._matcher.is_error()

    def refuses_everything(self) -> bool:
        """Whether a fresh matcher allows no first token at all: a grammar whose language is empty."""
        self.allowed()
        return self._matcher.is_error()


_executor = None


def allowed_masks(matchers: list[TokenMatcher]) -> torch.Tensor:
    """TokenMatcher.allowed of several matchers (one vocabulary) as int32 [n, words], computed in parallel
    on llguidance's thread pool when there are several (the GIL is released meanwhile)."""
    global _executor
    words = matchers[0]._words
    masks = torch.empty(len(matchers), words, dtype=torch.int32)
    one = words * masks.element_size()
    if len(matchers) == 1:
        matchers[0]._matcher.unsafe_compute_mask_ptr(masks.data_ptr(), one)
        return masks
    if _executor is None:
        _executor = llguidance.LLExecutor()
    _executor.unsafe_compute_mask_ptr([(m._matcher, i) for i, m in enumerate(matchers)], masks.data_ptr(), one,
                                      len(matchers))
    return masks


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads: each token's bytes, the special ones, and an encoder."""

    def __init__(self, tokenizer: Tokenizer):
        n = tokenizer.vocab_size
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = [i for i in range(n) if tokenizer.is_special(i)]
        special = set(self.special_token_ids)
        self.tokens = [b"" if i in special else tokenizer.token_bytes(i) for i in range(n)]
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special=False)


def apply_token_masks(logits: torch.Tensor, masks: list[torch.Tensor | None]) -> torch.Tensor:
    """Set to -inf the logits (float32 [B, V]) of tokens a row's mask (see TokenMatcher.allowed) leaves out;
    rows whose mask is None are unchanged. One host-to-device copy of the packed masks."""
    if all(m is None for m in masks):
        return logits
    batch, vocab = logits.shape
    words = (vocab + 31) // 32
    packed = torch.full((batch, words), -1, dtype=torch.int32)
    for i, mask in enumerate(masks):
        if mask is not None:
            packed[i] = mask
    packed = packed.to(logits.device, non_blocking=True)
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((packed[:, :, None] >> bits) & 1).bool().reshape(batch, words * 32)[:, :vocab]
    return logits.masked_fill(~allowed, float("-inf"))


def schema_from_response_format(response_format: dict[str, Any]) -> tuple[bool, dict[str, Any] | None]:
    """OpenAI's response_format -> (constrained?, schema). Raises ValueError naming what is wrong."""
    kind = response_format.get("type", "text")
    if kind == "text":
        return False, None
    if kind == "json_object":
        return True, None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError("response_format.json_schema must be an object with a `schema` object")
        return True, spec.get("schema")
    raise ValueError(f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'")
