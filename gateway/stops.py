"""Stop sequences over streamed text: emit what is safe, hold back what might become a stop."""

from __future__ import annotations


class StopFilter:
    """Feed text pieces; get back the text that can be shown and whether a stop sequence appeared.

    Text that could be the beginning of a stop sequence is held back until the next piece decides
    it; what follows the stop sequence is never emitted, nor the stop sequence itself unless `include`.
    """

    def __init__(self, stops: list[str], include: bool = False):
        self.stops = [s for s in stops if s]
        self.include = include
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buffer = self.pending + text
        hits = [(i, len(s)) for i, s in ((buffer.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            start, length = min(hits)  # the first stop; of two starting there, the shorter one
            return buffer[: start + length if self.include else start], True
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buffer)), hold, -1):
                if stop.startswith(buffer[-k:]):
                    hold = k
                    break
        self.pending = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        """At the end of generation: whatever was held back (it did not become a stop)."""
        rest, self.pending = ("" if self.stopped else self.pending), ""
        return rest
