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
