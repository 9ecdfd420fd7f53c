"""What the Messages and Responses answers share: one answer's text, split into reasoning,
content and tool calls (`OutputSplit`), kept as a list of blocks (Anthropic's content blocks,
the Responses API's output items) in the order the model wrote them, with the events that
open, grow and close each. A collected answer is the same builder run over the whole output,
so streamed and collected answers agree."""

from __future__ import annotations

from abc import ABC, abstractmethod

from server.engine import Finished, TokenEvent
from server.http.common.output_split import Output, OutputSplit


class BlockBuilder(ABC):
    """Subclasses name their two kinds of text block (`reasoning_kind`, `text_kind`) and say
    how a block opens (`_open_block`), grows (`_append`) and closes (`_closed`), how a tool
    call is written (`_call`), and what opens and closes the whole answer."""

    reasoning_kind: type
    text_kind: type

    def __init__(self, split: OutputSplit):
        self.split = split
        self._open = None  # the block being written
        self._from_draft = False  # the last token's

    @abstractmethod
    def open(self) -> list[dict]: ...

    @abstractmethod
    def close(self, done: Finished) -> list[dict]: ...

    def token(self, event: TokenEvent) -> list[dict]:
        self._from_draft = event.from_draft
        return self._output(self.split.feed(event.text))

    def _output(self, out: Output) -> list[dict]:
        return (self._text(self.reasoning_kind, out.reasoning)
                + self._text(self.text_kind, out.content) + self._calls(out.calls))

    def _text(self, kind: type, text: str) -> list[dict]:
        """Append to the open block of `kind`, opening it first (and closing another) if
        need be."""
        if not text:
            return []
        events = []
        if not isinstance(self._open, kind):
            events = self._close_block() + self._open_block(kind)
        return events + self._append(self._open, text)

    def _close_block(self, **how) -> list[dict]:
        block, self._open = self._open, None
        return [] if block is None else self._closed(block, **how)

    def _calls(self, calls: list[dict]) -> list[dict]:
        events = self._close_block() if calls else []
        for call in calls:
            events += self._call(call)
        return events

    @abstractmethod
    def _open_block(self, kind: type) -> list[dict]:
        """A new, empty block of `kind` added to the answer and made the open one (`_open`):
        its opening events."""

    @abstractmethod
    def _append(self, block, text: str) -> list[dict]:
        """`text` added to the open `block`: its delta events."""

    @abstractmethod
    def _closed(self, block, **how) -> list[dict]:
        """`block` is complete: its closing events."""

    @abstractmethod
    def _call(self, call: dict) -> list[dict]:
        """One whole tool call (OpenAI's shape) as a block of its own: its events."""
