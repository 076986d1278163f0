"""Generated token ids -> text deltas that are safe to send.

Two things are held back until they are decided:
- bytes of a UTF-8 character split over several tokens (the tokenizer's StreamDecoder does that);
- text that may be the start of a stop string: a stop string can span any number of tokens, and the
  stop string itself is not sent (unless the request asks for it), so its first characters cannot go out
  before we know.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from cobatch.tokenizer import Tokenizer


class StopStringFilter:
    """Cuts the text at the first stop string (after it with include_stop); holds back a tail that may still
    become one."""

    def __init__(self, stops: Sequence[str], include_stop: bool = False):
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self.include_stop = include_stop
        self._longest = max((len(s) for s in self.stops), default=0)
        self._held = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """The part of `text` (plus anything held before) that can be sent now."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        hit = min(((buf.find(s), s) for s in self.stops if s in buf), default=None,
                  key=lambda found: (found[0], -len(found[1])))
        if hit is not None:
            self.matched, self._held = hit[1], ""
            return buf[:hit[0] + (len(hit[1]) if self.include_stop else 0)]
        keep = self._partial_stop_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """At the end of generation: what was held back is not a stop string after all."""
        out, self._held = ("" if self.matched is not None else self._held), ""
        return out

    def _partial_stop_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0


class TextStream:
    """Token ids in, sendable text out: UTF-8 safe, special tokens skipped (unless skip_special is False),
    stop strings cut (kept, with include_stop)."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = (), include_stop: bool = False,
                 skip_special: bool = True, keep_special: Collection[int] = ()):
        self._decoder = tokenizer.stream_decoder(skip_special=skip_special, keep=keep_special)
        self._stops = StopStringFilter(stops, include_stop)

    @property
    def stop_matched(self) -> str | None:
        return self._stops.matched

    def push(self, token_id: int) -> str:
        return self._stops.push(self._decoder.push(token_id))

    def finish(self) -> str:
        return self._stops.push(self._decoder.flush()) + self._stops.flush()
