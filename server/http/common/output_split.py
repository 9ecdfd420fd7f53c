"""One answer's text, token by token, split into reasoning (`ReasoningSplit`, for a model that
thinks), content and tool calls (the chat path's `ToolCallParser` when the request offers
tools). Calls are parsed from the content only, never from the reasoning."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from server.http.common.reasoning import ReasoningSplit, ReplyStart, reasoning_split
from server.http.common.tools import ToolCallParser


@dataclass
class Output:
    """What a piece of text adds: reasoning, content safe to show now, completed calls."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)

    def __add__(self, other: Output) -> Output:
        return Output(self.reasoning + other.reasoning, self.content + other.content,
                      self.calls + other.calls)


class OutputSplit:
    def __init__(self, tool_calls: Callable[[], ToolCallParser] | None,
                 reasoning: ReasoningSplit | None = None):
        self._parser = tool_calls() if tool_calls is not None else None
        self._reasoning = reasoning

    @classmethod
    def of(cls, tool_calls: Callable[[], ToolCallParser] | None, tokenizer,
           start: ReplyStart | None) -> OutputSplit:
        """The split of a reply that starts at `start` (None: no reasoning to split off)."""
        return cls(tool_calls, reasoning_split(tokenizer, start) if start is not None else None)

    def feed(self, text: str) -> Output:
        reasoning, answer = self._reasoning.feed(text) if self._reasoning else ("", text)
        return Output(reasoning, *self._answer(answer))

    def finish(self, finish_reason: str) -> Output:
        """The rest, once the output ended for `finish_reason`: a tool call that "length" cut
        is dropped unless it parses (`ToolCallParser.finish`)."""
        reasoning, answer = self._reasoning.finish() if self._reasoning else ("", "")
        out = Output(reasoning, *self._answer(answer))
        if self._parser is not None:
            out = out + Output("", *self._parser.finish(cut=finish_reason == "length"))
        return out

    def _answer(self, text: str) -> tuple[str, list[dict]]:
        return self._parser.feed(text) if self._parser is not None else (text, [])

    @property
    def in_reasoning(self) -> bool:
        """Whether the text fed so far left the reply inside its reasoning."""
        return self._reasoning is not None and self._reasoning.in_reasoning

    @property
    def made_calls(self) -> bool:
        return bool(self.calls)

    @property
    def calls(self) -> list[dict]:
        return self._parser.calls if self._parser is not None else []
