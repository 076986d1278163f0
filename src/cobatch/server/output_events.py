"""What the output parser makes of a reply's text, piece by piece: content, reasoning, and tool calls (a call's
name once, then its arguments' JSON text in as many pieces as it comes in)."""

from __future__ import annotations

from dataclasses import dataclass


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


def merged(events: list[Event]) -> list[Event]:
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
