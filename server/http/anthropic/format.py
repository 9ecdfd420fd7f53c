"""Engine events -> an Anthropic message and its event stream.

`MessageBuilder` turns tokens into Anthropic's events and keeps the message they describe; a
collected message is the same builder run over the whole output, so both agree. Content goes
into text blocks, a thinking model's reasoning into thinking blocks, each tool call into a
tool_use block, in the order the model wrote them.
"""

from __future__ import annotations

import json

from api_schemas.anthropic import (
    Message,
    MessageUsage,
    TextContent,
    ThinkingContent,
    ToolUseContent,
    message_id,
)
from api_schemas.openai import Stats
from server.engine import Finished, TokenEvent
from server.http.anthropic.errors import error_body
from server.http.common.blocks import BlockBuilder
from server.http.common.errors import APIError
from server.http.common.output_split import OutputSplit
from server.http.common.reasoning import ReplyStart
from server.http.common.streaming import ResponseFormat, json_dict, sse_events
from server.http.common.tools import tool_input


def stop_reason(done: Finished, made_calls: bool) -> str:
    if done.finish_reason != "stop":
        return "max_tokens"
    if made_calls:
        return "tool_use"
    return "stop_sequence" if done.stop_sequence is not None else "end_turn"


class MessageBuilder(BlockBuilder):
    reasoning_kind, text_kind = ThinkingContent, TextContent

    def __init__(self, message: Message, split: OutputSplit):
        super().__init__(split)
        self.message = message

    def open(self) -> list[dict]:
        return [{"type": "message_start", "message": json_dict(self.message)}, {"type": "ping"}]

    def close(self, done: Finished) -> list[dict]:
        events = self._output(self.split.finish(done.finish_reason)) + self._close_block()
        m, stats = self.message, done.stats
        m.stop_reason = stop_reason(done, self.split.made_calls)
        m.stop_sequence = done.stop_sequence if m.stop_reason == "stop_sequence" else None
        m.usage = MessageUsage(input_tokens=stats.prompt_tokens - stats.cached_tokens,
                               cache_read_input_tokens=stats.cached_tokens,
                               output_tokens=stats.generation_tokens)
        m.stats = Stats(**stats.to_dict())
        delta = {"type": "message_delta",
                 "delta": {"stop_reason": m.stop_reason, "stop_sequence": m.stop_sequence},
                 "usage": json_dict(m.usage), "stats": json_dict(m.stats)}
        return events + [delta, {"type": "message_stop"}]

    @property
    def _index(self) -> int:
        return len(self.message.content) - 1

    def _open_block(self, kind: type) -> list[dict]:
        self._open = kind(**{"text" if kind is TextContent else "thinking": ""})
        self.message.content.append(self._open)
        return [{"type": "content_block_start", "index": self._index,
                 "content_block": json_dict(self._open)}]

    def _append(self, block, text: str) -> list[dict]:
        if isinstance(block, ThinkingContent):
            block.thinking += text
            return [{"type": "content_block_delta", "index": self._index,
                     "delta": {"type": "thinking_delta", "thinking": text}}]
        block.text += text
        return [{"type": "content_block_delta", "index": self._index,
                 "delta": {"type": "text_delta", "text": text},
                 "from_draft": self._from_draft}]

    def _closed(self, block, **how) -> list[dict]:
        return [{"type": "content_block_stop", "index": self.message.content.index(block)}]

    def _call(self, call: dict) -> list[dict]:
        function = call["function"]
        block = ToolUseContent(id=message_id("toolu"), name=function["name"],
                               input=tool_input(function["arguments"]))
        self.message.content.append(block)
        return [
            {"type": "content_block_start", "index": self._index,
             "content_block": {**json_dict(block), "input": {}}},
            {"type": "content_block_delta", "index": self._index,
             "delta": {"type": "input_json_delta", "partial_json": json.dumps(block.input)}},
            {"type": "content_block_stop", "index": self._index},
        ]


class MessagesFormat(ResponseFormat):
    def __init__(self, model: str, tokenizer, tool_calls, start: ReplyStart):
        super().__init__(model, tokenizer, "msg")
        self._tool_calls, self._reply = tool_calls, start
        self._start = Message(model=model, usage=MessageUsage(input_tokens=len(start.prompt),
                                                              output_tokens=0))
        self._builder: MessageBuilder | None = None

    def _new_builder(self) -> MessageBuilder:
        split = OutputSplit.of(self._tool_calls, self.tokenizer, self._reply)
        return MessageBuilder(self._start.model_copy(deep=True), split)

    def stream_open(self) -> list[dict]:
        self._builder = self._new_builder()
        return sse_events(self._builder.open())

    def stream_token(self, event: TokenEvent, first: bool) -> list[dict]:
        return sse_events(self._builder.token(event))

    def stream_close(self, done: Finished, include_usage: bool) -> list[dict]:
        return sse_events(self._builder.close(done))

    def stream_error(self, error: APIError) -> list[dict]:
        return sse_events([error_body(error)])

    def stream_end(self) -> list[dict]:
        return []

    def response(self, events: list[TokenEvent], done: Finished) -> Message:
        builder = self._new_builder()
        for event in events:
            builder.token(event)
        builder.close(done)
        return builder.message
