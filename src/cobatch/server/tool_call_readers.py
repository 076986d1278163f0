"""Readers of one tool call each, in the formats models write them; server/output_parser.py finds where a call
starts and hands the text that follows to the reader of its format, piece by piece.

- ToolCallScanner: a `{"name": ..., "arguments": ...}` JSON object (Hermes / Qwen2.5 tags, bare calls, lists).
- DeepSeekToolCall: one call of DeepSeek's block, after its `<｜tool▁call▁begin｜>` (V3, R1, V3.1).
- MistralToolCall: `NAME[ARGS]{...}` after Mistral's `[TOOL_CALLS]` (v11 tokenizers on).
- XmlToolCall: `NAME>...</function>` after `<function=`: Qwen3-Coder's parameters, or Llama 3.1's JSON.

Each sends a call's name as soon as it is known and its arguments' JSON text as it arrives, and says where the call
ended in what it was fed (`closed_at`), or that it was no call after all. Two helpers follow a call's text as it
grows, looking only at what came since they last did: JsonNesting (brackets outside strings) and RawArguments
(text up to a closing marker).
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Collection, Iterator, Mapping

from cobatch.engine.grammar import parameter_kind
from cobatch.server.output_events import Event, ToolCallArgsDelta, ToolCallStart

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
FENCE = "```"
# DeepSeek's markers (added tokens of its vocabulary that decode as this text: full-width bars, U+2581 spaces)
DS_CALLS_OPEN, DS_CALLS_CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_OPEN, DS_CALL_CLOSE, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
# Qwen3-Coder's call (inside <tool_call>, or alone) and its parameters
XML_FUNCTION_OPEN, XML_FUNCTION_CLOSE = "<function=", "</function>"
XML_PARAMETER_OPEN, XML_PARAMETER_CLOSE = "<parameter=", "</parameter>"
# Mistral's (control tokens, which the text keeps when tools are declared: TOOL_MARKER_TOKENS)
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
TOOL_MARKER_TOKENS = (MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID)
# what starts a call in content
TOOL_OPENINGS = (TOOL_OPEN, DS_CALLS_OPEN, DS_CALL_OPEN, XML_FUNCTION_OPEN, MISTRAL_CALLS)


PARTIAL, _NO = "partial", "no"


def _match_literal(s: str, i: int, options: tuple[str, ...]) -> tuple[str, int]:
    """Match one of `options` at s[i:]: ("ok", end), (PARTIAL, i) if s ends inside one, or (_NO, i)."""
    rest = s[i:]
    for lit in options:
        if rest.startswith(lit):
            return "ok", i + len(lit)
    if any(lit.startswith(rest) for lit in options):
        return PARTIAL, i
    return _NO, i


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def match_tool_header(s: str) -> tuple[str, str | None, int]:
    """Does s start like `{"name": "NAME", "arguments": ` followed by a value?

    Returns ("ok", NAME, index of the value's first character), (PARTIAL, None, 0) when s is a prefix
    of such a header, or (_NO, None, 0)."""
    i = _skip_ws(s, 0)
    name = None
    for step in ("{", '"name"', ":", "string", ",", ('"arguments"', '"parameters"'), ":"):
        i = _skip_ws(s, i)
        if i >= len(s):
            return PARTIAL, None, 0
        if step == "string":
            if s[i] != '"':
                return _NO, None, 0
            end = _string_end(s, i)
            if end is None:
                return PARTIAL, None, 0
            try:
                name = json.loads(s[i:end])
            except ValueError:
                return _NO, None, 0
            i = end
            continue
        status, i = _match_literal(s, i, step if isinstance(step, tuple) else (step,))
        if status != "ok":
            return status, None, 0
    i = _skip_ws(s, i)
    if i >= len(s):
        return PARTIAL, None, 0
    return "ok", name, i


def _string_end(s: str, i: int) -> int | None:
    """Index just past the JSON string starting at s[i] == '"', or None if it is not closed yet."""
    j = i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
            continue
        if s[j] == '"':
            return j + 1
        j += 1
    return None


class JsonNesting:
    """Follows the nesting of JSON text fed piece by piece: brackets outside strings."""

    def __init__(self):
        self.depth, self._in_str, self._esc = 0, False, False

    def closings(self, piece: str) -> Iterator[int]:
        """The index in `piece` of each closing bracket outside strings, once `depth` is what it leaves."""
        for j, c in enumerate(piece):
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                yield j


class ToolCallScanner:
    """Follows one tool-call JSON object as it streams in.

    Tracks JSON nesting (outside strings) over everything fed, so it knows where an object-valued
    `arguments` ends (depth back to 1) and where the whole object ends (depth back to 0)."""

    def __init__(self, index: int, known_names: Collection[str] | None = None):
        self.index = index
        self.text = ""
        self.name: str | None = None          # set once the header is recognized
        self.args = ""                         # argument text sent so far
        self._known = known_names
        self._value_start: int | None = None
        self._value_end: int | None = None     # set when an object/array value closed
        self._streaming = False                 # object-valued arguments: sent as they come
        self._pos, self._nesting = 0, JsonNesting()     # text scanned, and its nesting
        self.closed_at: int | None = None       # index just past the outer '}'
        self.header_failed = False

    def feed(self, text: str) -> list[Event]:
        self.text += text
        events: list[Event] = []
        if self.name is None and not self.header_failed:
            status, name, value_start = match_tool_header(self.text)
            if status == "ok" and (self._known is None or name in self._known):
                self.name, self._value_start = name, value_start
                self._streaming = self.text[value_start] in "{["
                events.append(ToolCallStart(self.index, name))
            elif status != PARTIAL:
                self.header_failed = True
        self._scan()      # after the header check, so the value's start is known while scanning
        if self._streaming:
            end = self._value_end if self._value_end is not None else len(self.text)
            start = self._value_start + len(self.args)
            if end > start:
                delta = self.text[start:end]
                self.args += delta
                events.append(ToolCallArgsDelta(self.index, delta))
        return events

    def _scan(self) -> None:
        for j in self._nesting.closings(self.text[self._pos:]):
            at = self._pos + j + 1
            if self._nesting.depth == 1 and self._value_start is not None and self._value_end is None \
                    and at > self._value_start:
                self._value_end = at
            if self._nesting.depth == 0 and self.closed_at is None:
                self.closed_at = at
        self._pos = len(self.text)

    def finish(self) -> list[Event] | None:
        """The call is over (closing tag or end of output). Events for whatever was not streamed, or
        None if this never was a tool call (nothing was sent for it)."""
        if self.name is not None:
            if self._streaming:
                return []
            value = self._parse_whole()
            args = (value or {}).get("arguments", (value or {}).get("parameters"))
            return [ToolCallArgsDelta(self.index, _arguments_text(args))]
        value = self._parse_whole()
        if value is None or not isinstance(value.get("name"), str):
            return None
        args = value.get("arguments", value.get("parameters", {}))
        return [ToolCallStart(self.index, value["name"]), ToolCallArgsDelta(self.index, _arguments_text(args))]

    def _parse_whole(self) -> dict | None:
        end = self.closed_at if self.closed_at is not None else len(self.text)
        try:
            value = json.loads(self.text[:end])
        except ValueError:
            return None
        return value if isinstance(value, dict) else None


def _arguments_text(args) -> str:
    if isinstance(args, str):      # some models write the arguments as a JSON string already
        return args
    return json.dumps(args if args is not None else {}, ensure_ascii=False)


class RawArguments:
    """Arguments written as they are up to a closing marker (DeepSeek's, Llama 3.1's `</function>`), sent as they
    come: less a partial marker at the end, and less the characters in `hold` there (they may belong to the end).
    Each feed looks only at what came since the last one, so a long argument costs its length, not its square."""

    def __init__(self, start: int, marker: str, hold: str = " \t\r\n"):
        self.start, self.marker, self.hold = start, marker, hold
        self.sent = 0                          # characters sent
        self._looked = start                   # the marker was looked for up to here

    def delta(self, text: str, final: bool) -> tuple[str, int | None]:
        """(the new argument text to send, the index just past the marker once it has come)"""
        at = text.find(self.marker, max(self.start, self._looked - len(self.marker)))
        self._looked = len(text)
        closed = at + len(self.marker) if at >= 0 else None
        end = at if at >= 0 else len(text)
        if at < 0 and not final:
            end -= partial_suffix(text[max(self.start, end - len(self.marker)):], self.marker)
        while end > self.start + self.sent and text[end - 1] in self.hold:
            end -= 1
        delta = text[self.start + self.sent:end]
        self.sent += len(delta)
        return delta, closed


class DeepSeekToolCall:
    """One DeepSeek call after its `<｜tool▁call▁begin｜>`, as it streams in: the name once the separator (and
    under V3, the line after it) has come, then the arguments up to `<｜tool▁call▁end｜>`, without V3's ```json
    fence. Whitespace and backticks at the end of what has come are held back: they may be the closing fence."""

    def __init__(self, index: int):
        self.index = index
        self.text = ""
        self.name: str | None = None
        self._args_start: int | None = None   # where the arguments begin in text
        self._args: RawArguments | None = None
        self.closed_at: int | None = None      # index just past <｜tool▁call▁end｜>
        self._fenced = False                    # V3: the arguments sit in a ```json fence
        self.failed = False                     # (never: until the output ends, anything may still be its name)

    def feed(self, text: str, final: bool = False) -> list[Event]:
        self.text += text
        events: list[Event] = []
        if self.name is None:
            self._read_head(final)
            if self.name is not None:
                events.append(ToolCallStart(self.index, self.name))
        if self._args_start is None:
            return events
        if self._args is None:
            self._args = RawArguments(self._args_start, DS_CALL_CLOSE, hold=" \t\r\n`")   # ` : the closing fence
        delta, self.closed_at = self._args.delta(self.text, final)
        if self.closed_at is not None:          # the whole of it known: less V3's closing fence
            args = self.text[self._args_start:self.closed_at - len(DS_CALL_CLOSE)].rstrip()
            args = args.removesuffix(FENCE).rstrip() if self._fenced else args
            delta = args[self._args.sent - len(delta):]
        if delta:
            events.append(ToolCallArgsDelta(self.index, delta))
        return events

    def _read_head(self, final: bool) -> None:
        sep = self.text.find(DS_SEP)
        if sep < 0:
            return
        head, rest = self.text[:sep].strip(), sep + len(DS_SEP)
        if head != "function":                # V3.1: the name before the separator, the arguments after it
            self.name, self._args_start = head, rest
            return
        line_end = self.text.find("\n", rest)  # V3: the type before it, the name on the rest of the line
        close = self.text.find(DS_CALL_CLOSE, rest)
        if close >= 0 and (line_end < 0 or close < line_end):    # a call without arguments
            self.name, self._args_start = self.text[rest:close].strip(), close
            return
        if line_end < 0:
            if final:
                self.name, self._args_start = self.text[rest:].strip(), len(self.text)
            return
        after = line_end + 1
        tail = self.text[after:]
        if tail.startswith(FENCE):              # ```json, to its line's end
            fence_end = self.text.find("\n", after)
            if fence_end < 0 and not final:
                return
            self._fenced, after = True, (fence_end + 1 if fence_end >= 0 else len(self.text))
        elif FENCE.startswith(tail) and not final:
            return                              # it may still become the fence
        self.name, self._args_start = self.text[rest:line_end].strip(), after

    def finish(self) -> list[Event] | None:
        """The output ended inside the call: what is left of it, or None if it never got a name (text)."""
        events = self.feed("", final=True)
        return events if self.name is not None else None


_NAME_LIMIT = 256       # a function or parameter name longer than this (or on two lines) is not one: it was text


class MistralToolCall:
    """One call after Mistral's `[TOOL_CALLS]` from its v11 tokenizers on (Mistral Small 3.2, Devstral, Magistral):
    `NAME[ARGS]{JSON arguments}` (`NAME[CALL_ID]ID[ARGS]{...}` in some), with no closing marker: the arguments end
    where their JSON value closes. The markers are control tokens, kept in the text for this (TOOL_MARKER_TOKENS)."""

    def __init__(self, index: int):
        self.index = index
        self.text = ""
        self.name: str | None = None
        self.failed = False                      # not a call after all: its text is content
        self.closed_at: int | None = None       # index just past the arguments' JSON value
        self._args_from: int | None = None      # just past [ARGS]
        self._value_from: int | None = None     # the value's first character
        self._scanned = 0                        # text the nesting has seen ends here
        self._sent = 0                           # argument characters sent
        self._nesting = JsonNesting()

    def feed(self, text: str, final: bool = False) -> list[Event]:
        self.text += text
        events: list[Event] = []
        if self.name is None:
            at = self.text.find(MISTRAL_ARGS)
            head = self.text if at < 0 else self.text[:at]
            name = head.split(MISTRAL_CALL_ID)[0].strip()
            if "\n" in name or len(head) > 2 * _NAME_LIMIT or (at < 0 and final) or (at >= 0 and not name):
                self.failed = True
                return events
            if at < 0:
                return events
            self.name, self._args_from = name, at + len(MISTRAL_ARGS)
            events.append(ToolCallStart(self.index, name))
        if self._value_from is None:
            body = self.text[self._args_from:]
            if not body.strip():
                return events
            self._value_from = self._scanned = len(self.text) - len(body.lstrip())
        end = next((j for j in self._nesting.closings(self.text[self._scanned:]) if self._nesting.depth <= 0), None)
        if end is not None:
            self.closed_at = self._scanned + end + 1
            args = self.text[self._value_from:self.closed_at]
        else:
            self._scanned = len(self.text)
            args = self.text[self._value_from:]
            args = args.rstrip() if final else args
        if len(args) > self._sent:
            events.append(ToolCallArgsDelta(self.index, args[self._sent:]))
            self._sent = len(args)
        return events

    def finish(self) -> list[Event] | None:
        """The output ended inside the call: what is left of it, or None if it never got a name (text)."""
        events = self.feed("", final=True)
        return None if self.failed or self.name is None else events


# How a parameter's value may end: its closing tag, or (a model that left it out) the next parameter or the call's end
_VALUE_ENDS = (XML_PARAMETER_CLOSE, XML_PARAMETER_OPEN, XML_FUNCTION_CLOSE)
_LONGEST_END = max(map(len, _VALUE_ENDS))


class XmlToolCall:
    """One call after its `<function=`, as it streams in. Qwen3-Coder writes
    `NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>`, each value raw text (one newline after its
    tag and one before its closing tag are not part of it), typed by the schema the request declared for that
    parameter (a string where it declares none); Llama 3.1's templates teach `NAME>{JSON arguments}</function>`.

    The name is sent once its `>` has come. Each parameter becomes a member of the arguments' JSON object once it
    has ended; a string's text is sent as it arrives, less what may still be its end (a newline, the start of a
    closing tag)."""

    def __init__(self, index: int, tool_schemas: Mapping[str, Mapping] | None):
        self.index = index
        self.text = ""
        self.name: str | None = None
        self.failed = False                      # not a call after all: its text is content
        self.closed_at: int | None = None       # index just past </function>
        self._schemas = tool_schemas or {}
        self._pos = 0                            # text before it is read
        self._members = 0                        # parameters sent
        self._json: RawArguments | None = None  # Llama 3.1: the JSON arguments
        self._param: tuple[str, int, int] | None = None     # the open parameter: key, value start, chars sent
        self._looked = 0                         # the open parameter's end was looked for up to here

    def feed(self, text: str, final: bool = False) -> list[Event]:
        self.text += text
        events: list[Event] = []
        if self.name is None and not self._read_name(final):
            return events
        if self._pos == 0:      # the name was read just now
            events.append(ToolCallStart(self.index, self.name))
            self._pos = self.text.index(">") + 1
        if self._json is None and self._members == 0 and self._param is None:
            body = self.text[self._pos:].lstrip()
            if not body and not final:
                return events
            if body.startswith("{"):
                self._json = RawArguments(len(self.text) - len(body), XML_FUNCTION_CLOSE)
        if self._json is not None:
            return events + self._feed_json(final)
        while self.closed_at is None and self._step(events, final):
            pass
        return events

    def _read_name(self, final: bool) -> bool:
        end = self.text.find(">")
        head = self.text if end < 0 else self.text[:end]
        if "\n" in head or "<" in head or len(head) > _NAME_LIMIT or (end == 0) or (end < 0 and final):
            self.failed = True
            return False
        if end < 0:
            return False
        self.name = head.strip()
        return True

    def _feed_json(self, final: bool) -> list[Event]:
        delta, self.closed_at = self._json.delta(self.text, final)
        return [ToolCallArgsDelta(self.index, delta)] if delta else []

    def _step(self, events: list[Event], final: bool) -> bool:
        """Read what follows; False when it must wait for more text."""
        if self._param is not None:
            return self._read_value(events, final)
        rest = self.text[self._pos:]
        body = rest.lstrip()
        skipped = len(rest) - len(body)
        if body.startswith(XML_FUNCTION_CLOSE):
            self._close(events, self._pos + skipped + len(XML_FUNCTION_CLOSE))
            return False
        if body.startswith(XML_PARAMETER_OPEN):
            key_end = body.find(">")
            key = body[len(XML_PARAMETER_OPEN):key_end] if key_end >= 0 else body[len(XML_PARAMETER_OPEN):]
            if "\n" in key or len(key) > _NAME_LIMIT:     # not a parameter's tag: what follows is skipped
                self._pos += skipped + len(XML_PARAMETER_OPEN)
                return True
            start = self._pos + skipped + key_end + 1
            if key_end < 0 or (start == len(self.text) and not final):
                return self._wait_or_close(events, final)
            start += self.text.startswith("\n", start)
            self._param, self._looked = (key.strip(), start, 0), start
            if self._kind(key.strip()) == "string":
                events.append(ToolCallArgsDelta(self.index, self._member_head(key.strip()) + '"'))
            return True
        if not final and any(m.startswith(body) for m in (XML_FUNCTION_CLOSE, XML_PARAMETER_OPEN)):
            return False
        # neither a parameter nor the end: skip to the next tag (text a model put between them)
        at = body.find("<", 1)
        if at < 0:
            return self._wait_or_close(events, final)
        self._pos += skipped + at
        return True

    def _wait_or_close(self, events: list[Event], final: bool) -> bool:
        if final:
            self._close(events, len(self.text))
        return False

    def _read_value(self, events: list[Event], final: bool) -> bool:
        key, start, sent = self._param
        # An end can only begin in what came since the last look, or in the few characters before it: each token's
        # look costs its own length, not the value's (a long string, a file's text, comes a token at a time).
        look_from = max(start, self._looked - _LONGEST_END)
        self._looked = len(self.text)
        ends = [(at, end) for end in _VALUE_ENDS if (at := self.text.find(end, look_from)) >= 0]
        if ends:
            value_end, end = min(ends)
            self._pos = value_end + (len(end) if end == XML_PARAMETER_CLOSE else 0)
        else:
            # what may still be its end; when the output ended here, the start of a closing tag it was cut in
            tail = self.text[max(start, len(self.text) - _LONGEST_END - 1):]
            value_end = len(self.text) - max(max(partial_suffix(tail, end), partial_suffix(tail, "\n" + end))
                                             for end in _VALUE_ENDS)
            if not final:
                if self._kind(key) == "string":
                    self._send_text(events, value_end)
                return False
            self._pos = len(self.text)
        if value_end > start and self.text[value_end - 1] == "\n":       # the newline before the closing tag
            value_end -= 1
        if self._kind(key) == "string":
            self._send_text(events, value_end)
            events.append(ToolCallArgsDelta(self.index, '"'))
        else:
            value = self.text[start:value_end]
            events.append(ToolCallArgsDelta(self.index, self._member_head(key) + _typed_json(value, self._kind(key))))
        self._param = None
        return True

    def _send_text(self, events: list[Event], end: int) -> None:
        """The open string parameter's text up to index `end` of the call's text (its start was sent before):
        JSON-escaped, which escapes character by character, so the pieces join into the escaped whole."""
        key, start, sent = self._param
        if end - start > sent:
            escaped = json.dumps(self.text[start + sent:end], ensure_ascii=False)[1:-1]
            events.append(ToolCallArgsDelta(self.index, escaped))
            self._param = (key, start, end - start)

    def _member_head(self, key: str) -> str:
        self._members += 1
        return ("{" if self._members == 1 else ", ") + json.dumps(key, ensure_ascii=False) + ": "

    def _close(self, events: list[Event], at: int) -> None:
        events.append(ToolCallArgsDelta(self.index, "}" if self._members else "{}"))
        self.closed_at = at

    def _kind(self, key: str) -> str:
        schema = self._schemas.get(self.name)
        properties = schema.get("properties") if isinstance(schema, Mapping) else None
        return parameter_kind(properties.get(key) if isinstance(properties, Mapping) else None)

    def finish(self) -> list[Event] | None:
        """The output ended inside the call: what is left of it, or None if it never got a name (text)."""
        if self.failed:
            return None
        events = self.feed("", final=True)
        if self.name is None or self.failed:
            return None
        if self.closed_at is None and self._json is not None:
            self.closed_at = len(self.text)
        return events


def _typed_json(raw: str, kind: str) -> str:
    """A parameter's raw text as the JSON value of its kind; as a string where it does not read as one."""
    text = raw.strip()
    if text == "null":
        return "null"
    if kind == "integer":
        try:
            return str(int(text))
        except ValueError:
            pass
    elif kind == "number":
        try:
            return str(int(text))
        except ValueError:
            pass
        try:
            value = float(text)
            if math.isfinite(value):
                return json.dumps(value)
        except ValueError:
            pass
    elif kind == "boolean":
        if text.lower() in ("true", "false"):
            return text.lower()
    elif kind == "json":
        try:
            return json.dumps(json.loads(text, parse_constant=_not_json), ensure_ascii=False)
        except ValueError:
            pass
        try:        # a Python literal ({'a': True}): models write those too
            return json.dumps(ast.literal_eval(text), ensure_ascii=False)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
    return json.dumps(raw, ensure_ascii=False)


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def partial_suffix(buf: str, marker: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of marker."""
    for k in range(min(len(buf), len(marker) - 1), 0, -1):
        if marker.startswith(buf[-k:]):
            return k
    return 0
