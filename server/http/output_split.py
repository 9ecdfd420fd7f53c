"""One answer's text, token by token, split into content and tool calls: the chat path's
`ToolCallParser` when the request offers tools, the text as it is when it does not."""

from __future__ import annotations

from collections.abc import Callable

from server.http.tools import ToolCallParser


class OutputSplit:
    def __init__(self, tool_calls: Callable[[], ToolCallParser] | None):
        self._parser = tool_calls() if tool_calls is not None else None

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """The content safe to show now and the OpenAI tool calls this text completed."""
        return self._parser.feed(text) if self._parser is not None else (text, [])

    def finish(self) -> tuple[str, list[dict]]:
        return self._parser.finish() if self._parser is not None else ("", [])

    @property
    def made_calls(self) -> bool:
        return self._parser is not None and bool(self._parser.calls)
