"""Stop strings over a generation's text (`StopText`): what a generation may show so far.

Why held back: a stop string may straddle several steps' pieces ("EN" + "D"); text that
could still grow into one is shown only once it cannot, so a client never sees the start of
a stop string the response then leaves out."""

from __future__ import annotations


class StopText:
    """The text a generation may show, with stop sequences: text that could still grow into
    a stop sequence is held back; at a stop sequence the text ends before it."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.held, self.done = stops, "", False
        self.word: str | None = None  # the stop sequence reached

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text to show now, whether a stop sequence was reached)."""
        if self.done:
            return "", True
        buf = self.held + piece
        hits = [(i, s) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.word = min(hits)
            self.held, self.done = "", True
            return buf[:at], True
        keep = max((n for s in self.stops for n in range(min(len(s) - 1, len(buf)), 0, -1)
                    if buf.endswith(s[:n])), default=0)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        rest, self.held = ("" if self.done else self.held), ""
        return rest
