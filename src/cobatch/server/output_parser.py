"""The model's text -> content, reasoning and tool calls, incrementally.

Recognized formats:
- `<think>...</think>` at the start of the output (or the prompt ended with `<think>`): reasoning; so is
  Magistral's `[THINK]...[/THINK]` (control tokens the text keeps for this, REASONING_MARKER_TOKENS).
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
- `[TOOL_CALLS]NAME[ARGS]{...}` (Mistral's v11 tokenizers on; the markers are control tokens that the text keeps
  for this, TOOL_MARKER_TOKENS), when the request declared tools.
- `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>` (Qwen3-Coder), each
  value raw text typed by the declared tool's JSON schema, and `<function=NAME>{...}</function>` (Llama 3.1's
  templates), when the request declared tools.

A tool call's name is sent as soon as it is known and its arguments' JSON text as it arrives, so clients
see partial argument deltas. Text that may still turn into a marker is held back, like stop strings.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from cobatch.server.output_events import ContentDelta, Event, ReasoningDelta, merged
from cobatch.server.tool_call_readers import (DS_CALL_OPEN, DS_CALLS_CLOSE, DS_CALLS_OPEN, FENCE, MISTRAL_CALLS,
                                              PARTIAL, TOOL_CLOSE, TOOL_OPEN, TOOL_OPENINGS, XML_FUNCTION_OPEN,
                                              DeepSeekToolCall, MistralToolCall, ToolCallScanner, XmlToolCall,
                                              match_tool_header, partial_suffix)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Magistral's reasoning markers (control tokens: the text keeps them for the parser, REASONING_MARKER_TOKENS)
MISTRAL_THINK_OPEN, MISTRAL_THINK_CLOSE = "[THINK]", "[/THINK]"
REASONING_MARKER_TOKENS = (MISTRAL_THINK_OPEN, MISTRAL_THINK_CLOSE)
THINK_BLOCKS = {THINK_OPEN: THINK_CLOSE, MISTRAL_THINK_OPEN: MISTRAL_THINK_CLOSE}     # opening -> its closing


class OutputParser:
    """Feed it text deltas; get events. Call finish() once at the end."""

    def __init__(self, *, tool_names: Collection[str] | None = None, reasoning: bool = True,
                 start_in_reasoning: bool = False, tool_schemas: Mapping[str, Mapping] | None = None):
        """tool_names: the declared tools (None: tool calls are not parsed); tool_schemas: their parameters' JSON
        schemas by name, which type the values of calls written as XML."""
        self._tools = tool_names is not None
        self._tool_names = frozenset(tool_names or ())
        self._tool_schemas = tool_schemas
        # without reasoning a block the prompt opened is content like the rest (llama.cpp's --reasoning-format none)
        self._state = "reasoning" if start_in_reasoning and reasoning else "start"
        self._think_allowed = reasoning and not start_in_reasoning
        self._think_close = THINK_CLOSE       # the closing of the block being read
        self._strip_leading = False     # whitespace after </think> or a tool call is not content
        self._buf = ""
        self._scanner: ToolCallScanner | None = None
        # a call read by its format's reader (DeepSeekToolCall, XmlToolCall, MistralToolCall), the text that opened
        # it (given back if it is no call) and the state after it
        self._call: DeepSeekToolCall | XmlToolCall | MistralToolCall | None = None
        self._call_opening, self._after_call = "", "after_tool"
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
        if self._state == "tool_tag":     # the output ended just after <tool_call>
            self._start_tool(self._buf, bare=False)
        if self._call is not None:
            self._end_call()
        if self._scanner is not None:
            self._end_tool(closing="")
        if self._buf:
            self._emit_text(self._buf)
            self._buf = ""
        return self._take()

    def _take(self) -> list[Event]:
        events, self._events = merged(self._events), []
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
        opening = next((o for o in THINK_BLOCKS if body.startswith(o)), None) if self._think_allowed else None
        if opening is not None:
            self._buf, self._state, self._think_allowed = body[len(opening):], "reasoning", False
            self._think_close = THINK_BLOCKS[opening]
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
        waiting_for = (*(THINK_BLOCKS if self._think_allowed else ()),
                       *((FENCE, *TOOL_OPENINGS) if self._tools else ()))
        if not final and any(m.startswith(body) for m in waiting_for):
            return False
        return self._to_content()

    def _probe_bare(self, body: str, fenced: bool, final: bool, in_list: bool = False) -> bool:
        status, name, _ = match_tool_header(body)
        if status == PARTIAL and not final:
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
            before = self._buf[:at].rstrip()
            self._emit_text(before)                    # the newline before a tool call is not content
            if marker == TOOL_OPEN:
                self._buf, self._state = self._buf[at + len(TOOL_OPEN):], "tool_tag"
            elif marker == XML_FUNCTION_OPEN:          # (its whitespace is given back if it is no call)
                self._start_call(XmlToolCall(self.num_tool_calls, self._tool_schemas), self._buf[at + len(marker):],
                                 opening=self._buf[len(before):at + len(marker)])
            elif marker == MISTRAL_CALLS:
                self._buf, self._state = self._buf[at + len(marker):], "mistral_calls"
            else:         # DeepSeek's block (a model may also leave out its opening: a call's own marker)
                self._buf, self._state = self._buf[at + (len(marker) if marker == DS_CALLS_OPEN else 0):], "ds_calls"
            return True
        keep = 0
        if self._tools and not final:
            # Hold back a possible start of a tool call's marker, and the whitespace before it.
            keep = max(partial_suffix(self._buf, marker) for marker in TOOL_OPENINGS)
            head = self._buf[:len(self._buf) - keep]
            keep += len(head) - len(head.rstrip())
        self._emit_text(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _on_reasoning(self, final: bool) -> bool:
        at = self._buf.find(self._think_close)
        if at >= 0:
            self._emit_text(self._buf[:at])
            self._buf = self._buf[at + len(self._think_close):]
            self._state, self._strip_leading = "start", True
            return True
        keep = 0 if final else partial_suffix(self._buf, self._think_close)
        self._emit_text(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    # --- tool calls -------------------------------------------------------------------------------
    def _start_tool(self, rest: str, bare: bool) -> None:
        self._scanner = ToolCallScanner(self.num_tool_calls, self._tool_names if bare else None)
        self._state = "bare_tool" if bare else "tagged_tool"
        self._buf = rest

    def _on_tool_tag(self, final: bool) -> bool:
        """Just after <tool_call>: a JSON object (Hermes, Qwen2.5) or Qwen3-Coder's <function=NAME>."""
        body = self._buf.lstrip()
        if body.startswith(XML_FUNCTION_OPEN):
            opening = TOOL_OPEN + self._buf[:len(self._buf) - len(body)] + XML_FUNCTION_OPEN
            self._start_call(XmlToolCall(self.num_tool_calls, self._tool_schemas), body[len(XML_FUNCTION_OPEN):],
                             opening=opening, then="xml_tag_close")
            return True
        if not final and XML_FUNCTION_OPEN.startswith(body):
            return False
        self._start_tool(self._buf, bare=False)
        return True

    def _on_tagged_tool(self, final: bool) -> bool:
        at = self._buf.find(TOOL_CLOSE)
        if at >= 0:
            self._events += self._scanner.feed(self._buf[:at])
            self._buf = self._buf[at + len(TOOL_CLOSE):]
            self._end_tool(closing=TOOL_CLOSE)
            return True
        keep = 0 if final else partial_suffix(self._buf, TOOL_CLOSE)
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
            self._start_call(DeepSeekToolCall(self.num_tool_calls), body[len(DS_CALL_OPEN):], opening=DS_CALL_OPEN,
                             then="ds_calls")
            return True
        if body.startswith(DS_CALLS_CLOSE):
            body = body[len(DS_CALLS_CLOSE):]
        elif not final and (not body or DS_CALL_OPEN.startswith(body) or DS_CALLS_CLOSE.startswith(body)):
            self._buf = body
            return False
        # the block ended (or broke off): what follows is handled as after any tool call
        self._buf, self._state = body, "after_tool"
        return True

    def _on_mistral_calls(self, final: bool) -> bool:
        """After Mistral's [TOOL_CALLS]: a JSON list of calls (its older tokenizers) or NAME[ARGS]{...}."""
        body = self._buf.lstrip()
        if not body and not final:
            return False
        if body.startswith("["):
            return self._probe_bare(body[1:], fenced=False, final=final, in_list=True)
        if body.startswith("{"):
            return self._probe_bare(body, fenced=False, final=final)
        self._start_call(MistralToolCall(self.num_tool_calls), body, opening="")
        return True

    def _start_call(self, call, rest: str, opening: str, then: str = "after_tool") -> None:
        self._call, self._call_opening, self._after_call = call, opening, then
        self._buf, self._state = rest, "call"

    def _on_call(self, final: bool) -> bool:
        call = self._call
        self._events += call.feed(self._buf, final)
        self._buf = ""
        if call.closed_at is None and not call.failed:
            return False
        if not call.failed:
            self._buf = call.text[call.closed_at:]      # fed, but after the call
        self._end_call()
        return True

    def _end_call(self) -> None:
        call, self._call = self._call, None
        events = call.finish() if call.closed_at is None else []
        if events is None:             # never a call: its opening was text, and what followed is read again
            self._state = "content"
            self._emit_text(self._call_opening)
            self._buf = call.text + self._buf
            return
        self._events += events
        self.num_tool_calls += 1
        self._state = self._after_call

    def _on_xml_tag_close(self, final: bool) -> bool:
        """After a call that <tool_call> opened: its </tool_call>."""
        body = self._buf.lstrip()
        if body.startswith(TOOL_CLOSE):
            body = body[len(TOOL_CLOSE):]
        elif not final and TOOL_CLOSE.startswith(body):
            self._buf = body
            return False
        self._buf, self._state = body, "after_tool"
        return True

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
                if status == PARTIAL and not final:
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
