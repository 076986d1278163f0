"""The model's text -> content, reasoning and tool calls, incrementally.

Recognized formats:
- `<think>...</think>` at the start of the output (or the prompt ended with `<think>`): reasoning.
- `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5 / Hermes), anywhere, when the
  request declared tools.
- A bare `{"name": <declared tool>, "arguments": {...}}` object as the whole answer, optionally in a
  ```json fence, when the request declared tools: small models (Qwen2.5-Coder-0.5B among them) answer
  that way despite the template asking for tags. `"parameters"` is accepted for `"arguments"` (Llama 3.x).
- A bare JSON list of such objects, `[{...}, {...}]`: Mistral's `[TOOL_CALLS][...]` and Phi-4-mini's
  `<|tool_call|>[...]<|/tool_call|>`, whose markers are special tokens and so absent from the text.
- DeepSeek's `<｜tool▁calls▁begin｜>` block of calls, when the request declared tools: each
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` then the arguments in a ```json fence (V3, R1), or
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS` (V3.1), up to `<｜tool▁call▁end｜>`; the block ends at
  `<｜tool▁calls▁end｜>`.

A tool call's name is sent as soon as it is known and its arguments' JSON text as it arrives, so clients
see partial argument deltas. Text that may still turn into a marker is held back, like stop strings.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
FENCE = "```"
# DeepSeek's markers (added tokens of its vocabulary that decode as this text: full-width bars, U+2581 spaces)
DS_CALLS_OPEN, DS_CALLS_CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_OPEN, DS_CALL_CLOSE, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
TOOL_OPENINGS = (TOOL_OPEN, DS_CALLS_OPEN, DS_CALL_OPEN)   # what starts tagged tool calls in content


@dataclass(slots=True)
class ContentDelta:
    text: str


@dataclass(slots=True)
class ReasoningDelta:
    text: str


@dataclass(slots=True)
class ToolCallStart:
    index: int
    name: str


@dataclass(slots=True)
class ToolCallArgsDelta:
    index: int
    text: str


Event = ContentDelta | ReasoningDelta | ToolCallStart | ToolCallArgsDelta


# --- one tool-call object ---------------------------------------------------------------------------

_PARTIAL, _NO = "partial", "no"


def _match_literal(s: str, i: int, options: tuple[str, ...]) -> tuple[str, int]:
    """Match one of `options` at s[i:]: ("ok", end), (_PARTIAL, i) if s ends inside one, or (_NO, i)."""
    rest = s[i:]
    for lit in options:
        if rest.startswith(lit):
            return "ok", i + len(lit)
    if any(lit.startswith(rest) for lit in options):
        return _PARTIAL, i
    return _NO, i


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def match_tool_header(s: str) -> tuple[str, str | None, int]:
    """Does s start like `{"name": "NAME", "arguments": ` followed by a value?

    Returns ("ok", NAME, index of the value's first character), (_PARTIAL, None, 0) when s is a prefix
    of such a header, or (_NO, None, 0)."""
    i = _skip_ws(s, 0)
    name = None
    for step in ("{", '"name"', ":", "string", ",", ('"arguments"', '"parameters"'), ":"):
        i = _skip_ws(s, i)
        if i >= len(s):
            return _PARTIAL, None, 0
        if step == "string":
            if s[i] != '"':
                return _NO, None, 0
            end = _string_end(s, i)
            if end is None:
                return _PARTIAL, None, 0
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
        return _PARTIAL, None, 0
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
        self._pos, self._depth, self._in_str, self._esc = 0, 0, False, False
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
            elif status != _PARTIAL:
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
        s = self.text
        for j in range(self._pos, len(s)):
            c = s[j]
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
                continue
            if c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 1 and self._value_start is not None and self._value_end is None \
                        and j >= self._value_start:
                    self._value_end = j + 1
                if self._depth == 0 and self.closed_at is None:
                    self.closed_at = j + 1
        self._pos = len(s)

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


class DeepSeekToolCall:
    """One DeepSeek call after its `<｜tool▁call▁begin｜>`, as it streams in: the name once the separator (and
    under V3, the line after it) has come, then the arguments up to `<｜tool▁call▁end｜>`, without V3's ```json
    fence. Whitespace and backticks at the end of what has come are held back: they may be the closing fence."""

    def __init__(self, index: int):
        self.index = index
        self.text = ""
        self.name: str | None = None
        self._args_start: int | None = None   # where the arguments begin in text
        self.args = ""                         # argument text sent so far
        self.closed_at: int | None = None      # index just past <｜tool▁call▁end｜>
        self._fenced = False                    # V3: the arguments sit in a ```json fence

    def feed(self, text: str, final: bool = False) -> list[Event]:
        self.text += text
        events: list[Event] = []
        if self.name is None:
            self._read_head(final)
            if self.name is not None:
                events.append(ToolCallStart(self.index, self.name))
        if self._args_start is None:
            return events
        body = self.text[self._args_start:]
        at = body.find(DS_CALL_CLOSE)
        if at >= 0:
            self.closed_at = self._args_start + at + len(DS_CALL_CLOSE)
            args = body[:at].rstrip()
            args = args.removesuffix(FENCE).rstrip() if self._fenced else args
        else:
            args = body if final else body[:len(body) - _partial_suffix(body, DS_CALL_CLOSE)]
            if not final:
                args = args.rstrip(" \t\r\n`")
        if len(args) > len(self.args):
            events.append(ToolCallArgsDelta(self.index, args[len(self.args):]))
            self.args = args
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


# --- the whole output -------------------------------------------------------------------------------

class OutputParser:
    """Feed it text deltas; get events. Call finish() once at the end."""

    def __init__(self, *, tool_names: Collection[str] | None = None, reasoning: bool = True,
                 start_in_reasoning: bool = False):
        self._tools = tool_names is not None
        self._tool_names = frozenset(tool_names or ())
        # without reasoning a block the prompt opened is content like the rest (llama.cpp's --reasoning-format none)
        self._state = "reasoning" if start_in_reasoning and reasoning else "start"
        self._think_allowed = reasoning and not start_in_reasoning
        self._strip_leading = False     # whitespace after </think> or a tool call is not content
        self._buf = ""
        self._scanner: ToolCallScanner | None = None
        self._ds_call: DeepSeekToolCall | None = None
        self._fenced = False
        self._in_list = False           # inside a bare [call, call, ...] list
        self.num_tool_calls = 0
        self._events: list[Event] = []

    def push(self, text: str) -> list[Event]:
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        self._run(final=True)
        if self._scanner is not None:
            self._end_tool(closing="")
        if self._ds_call is not None:
            self._end_ds_call()
        if self._buf:
            self._emit_text(self._buf)
            self._buf = ""
        return self._take()

    def _take(self) -> list[Event]:
        events, self._events = _merge(self._events), []
        return events

    # Each state handler consumes from self._buf and returns False when it must wait for more text.
    def _run(self, final: bool) -> None:
        while self._buf and getattr(self, "_on_" + self._state)(final):
            pass

    def _emit_text(self, text: str) -> None:
        if not text:
            return
        kind = ReasoningDelta if self._state == "reasoning" else ContentDelta
        self._events.append(kind(text))

    def _on_start(self, final: bool) -> bool:
        """Before any visible output: look for <think>, or a bare JSON tool call."""
        body = self._buf.lstrip()
        if not body:
            return False if not final else self._to_content()
        if self._think_allowed and body.startswith(THINK_OPEN):
            self._buf, self._state, self._think_allowed = body[len(THINK_OPEN):], "reasoning", False
            return True
        if self._tools:
            if body.startswith(FENCE):
                after = body[len(FENCE):]
                fence_end = after.find("\n")
                if fence_end < 0:
                    return False if not final else self._to_content()
                if after[:fence_end].strip() in ("", "json"):
                    return self._probe_bare(after[fence_end + 1:], fenced=True, final=final)
            elif body.startswith("{"):
                return self._probe_bare(body, fenced=False, final=final)
            elif body.startswith("["):
                return self._probe_bare(body[1:], fenced=False, final=final, in_list=True)
        waiting_for = ((THINK_OPEN,) if self._think_allowed else ()) + ((FENCE, *TOOL_OPENINGS) if self._tools else ())
        if not final and any(m.startswith(body) for m in waiting_for):
            return False
        return self._to_content()

    def _probe_bare(self, body: str, fenced: bool, final: bool, in_list: bool = False) -> bool:
        status, name, _ = match_tool_header(body)
        if status == _PARTIAL and not final:
            return False
        if status == "ok" and name in self._tool_names:
            self._fenced, self._in_list = fenced, in_list
            self._start_tool(body, bare=True)
            return True
        return self._to_content()

    def _to_content(self) -> bool:
        self._state = "content"
        if self._strip_leading:
            self._buf = self._buf.lstrip()
        return True

    def _on_content(self, final: bool) -> bool:
        found = [(at, marker) for marker in TOOL_OPENINGS if self._tools and (at := self._buf.find(marker)) >= 0]
        if found:
            at, marker = min(found)
            self._emit_text(self._buf[:at].rstrip())     # the newline before a tool call is not content
            if marker == TOOL_OPEN:
                self._start_tool(self._buf[at + len(TOOL_OPEN):], bare=False)
            else:         # DeepSeek's block (a model may also leave out its opening: a call's own marker)
                self._buf, self._state = self._buf[at + (len(marker) if marker == DS_CALLS_OPEN else 0):], "ds_calls"
            return True
        keep = 0
        if self._tools and not final:
            # Hold back a possible start of a tool call's marker, and the whitespace before it.
            keep = max(_partial_suffix(self._buf, marker) for marker in TOOL_OPENINGS)
            head = self._buf[:len(self._buf) - keep]
            keep += len(head) - len(head.rstrip())
        self._emit_text(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _on_reasoning(self, final: bool) -> bool:
        at = self._buf.find(THINK_CLOSE)
        if at >= 0:
            self._emit_text(self._buf[:at])
            self._buf = self._buf[at + len(THINK_CLOSE):]
            self._state, self._strip_leading = "start", True
            return True
        keep = 0 if final else _partial_suffix(self._buf, THINK_CLOSE)
        self._emit_text(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    # --- tool calls -------------------------------------------------------------------------------
    def _start_tool(self, rest: str, bare: bool) -> None:
        self._scanner = ToolCallScanner(self.num_tool_calls, self._tool_names if bare else None)
        self._state = "bare_tool" if bare else "tagged_tool"
        self._buf = rest

    def _on_tagged_tool(self, final: bool) -> bool:
        at = self._buf.find(TOOL_CLOSE)
        if at >= 0:
            self._events += self._scanner.feed(self._buf[:at])
            self._buf = self._buf[at + len(TOOL_CLOSE):]
            self._end_tool(closing=TOOL_CLOSE)
            return True
        keep = 0 if final else _partial_suffix(self._buf, TOOL_CLOSE)
        self._events += self._scanner.feed(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _on_bare_tool(self, final: bool) -> bool:
        scanner = self._scanner
        self._events += scanner.feed(self._buf)
        if scanner.closed_at is None:
            self._buf = ""
            return False
        self._buf = scanner.text[scanner.closed_at:]     # text after the object, fed but not part of it
        scanner.text = scanner.text[:scanner.closed_at]
        self._end_tool(closing="")
        return True

    def _end_tool(self, closing: str) -> None:
        scanner, self._scanner = self._scanner, None
        events = scanner.finish()
        if events is None:           # not a tool call after all (tagged, unparsable): it was text
            opening = "" if self._state == "bare_tool" else TOOL_OPEN
            self._state = "content"
            self._emit_text(opening + scanner.text + closing)
            return
        self._events += events
        self.num_tool_calls += 1
        self._state = "after_tool"

    def _on_ds_calls(self, final: bool) -> bool:
        """Inside DeepSeek's block of calls, between calls: the next call, or the block's end."""
        body = self._buf.lstrip()
        if body.startswith(DS_CALL_OPEN):
            self._ds_call = DeepSeekToolCall(self.num_tool_calls)
            self._buf, self._state = body[len(DS_CALL_OPEN):], "ds_call"
            return True
        if body.startswith(DS_CALLS_CLOSE):
            body = body[len(DS_CALLS_CLOSE):]
        elif not final and (not body or DS_CALL_OPEN.startswith(body) or DS_CALLS_CLOSE.startswith(body)):
            self._buf = body
            return False
        # the block ended (or broke off): what follows is handled as after any tool call
        self._buf, self._state = body, "after_tool"
        return True

    def _on_ds_call(self, final: bool) -> bool:
        call = self._ds_call
        self._events += call.feed(self._buf, final)
        self._buf = ""
        if call.closed_at is None:
            return False
        self._buf = call.text[call.closed_at:]      # fed, but after the call
        self._end_ds_call()
        return True

    def _end_ds_call(self) -> None:
        call, self._ds_call = self._ds_call, None
        events = call.finish() if call.closed_at is None else []
        if call.name is None:                       # never a call: it was text
            self._state = "content"
            self._emit_text(DS_CALL_OPEN + call.text)
            return
        self._events += events or []
        self.num_tool_calls += 1
        self._state = "ds_calls"

    def _on_after_tool(self, final: bool) -> bool:
        """Between tool calls: whitespace and a closing fence go; another call or text may follow."""
        body = self._buf.lstrip()
        if self._in_list:                 # `, {next call}` or the closing `]`
            if not body:
                self._buf = body
                return False
            if body.startswith(","):
                rest = body[1:].lstrip()
                status, name, _ = match_tool_header(rest)
                if status == _PARTIAL and not final:
                    self._buf = body
                    return False
                if status == "ok" and name in self._tool_names:
                    self._start_tool(rest, bare=True)
                    return True
            elif body.startswith("]"):
                body = body[1:]
            self._in_list = False         # the list ended (or broke off): what follows is handled as usual
        if self._fenced:
            if not body or (not final and FENCE.startswith(body) and body != FENCE):
                self._buf = body
                return False
            if body.startswith(FENCE):
                body = body[len(FENCE):].lstrip()
            self._fenced = False
        self._buf = body
        if not body:
            return False
        self._state, self._think_allowed, self._strip_leading = "start", False, True
        return True


def _partial_suffix(buf: str, marker: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of marker."""
    for k in range(min(len(buf), len(marker) - 1), 0, -1):
        if marker.startswith(buf[-k:]):
            return k
    return 0


def _merge(events: list[Event]) -> list[Event]:
    """Join neighbouring deltas of the same kind (fewer, larger chunks)."""
    out: list[Event] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, (ContentDelta, ReasoningDelta)) and type(last) is type(e):
            out[-1] = type(e)(last.text + e.text)
        elif isinstance(e, ToolCallArgsDelta) and isinstance(last, ToolCallArgsDelta) and last.index == e.index:
            out[-1] = ToolCallArgsDelta(e.index, last.text + e.text)
        elif isinstance(e, (ContentDelta, ReasoningDelta, ToolCallArgsDelta)) and not e.text:
            continue
        else:
            out.append(e)
    return out
