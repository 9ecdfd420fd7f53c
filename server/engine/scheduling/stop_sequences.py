"""Stop strings over a stream of text segments, holding back what may start a stop string."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...] | list[str]):
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the text, once one did

    def feed(self, segment: str, *, final: bool = False) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string was hit)."""
        text = self._held + segment
        self._held = ""
        if not self.stops:
            return text, False
        hits = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            cut, self.matched = min(hits, key=lambda hit: hit[0])
            return text[:cut], True
        if final:
            return text, False
        keep = self._partial_suffix(text)
        if keep:
            self._held = text[-keep:]
            text = text[:-keep]
        return text, False

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
