"""Engine events -> an OpenAI Responses API response object and its event stream.

`ResponseBuilder` turns tokens into the documented events (each with its `sequence_number`)
and keeps the response object they describe; a collected response is the same builder run
over the whole output, so streamed and collected answers agree. Content goes into a message
item, each tool call into a function_call or custom_tool_call item (`ToolTable` says which), in
the order the model wrote them.
"""

from __future__ import annotations

from collections.abc import Callable

from api_schemas.openai import Stats
from api_schemas.responses import (
    CustomToolCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponseUsage,
)
from server.engine import Finished, TokenEvent
from server.http.common.blocks import BlockBuilder
from server.http.common.errors import APIError
from server.http.common.output_split import Output, OutputSplit
from server.http.common.reasoning import ReplyStart
from server.http.common.streaming import ResponseFormat, json_dict, sse_events
from server.http.openai.responses.tools import ToolTable


class ResponseBuilder(BlockBuilder):
    """`logprob`: a token's log-probability entry (None when they were not asked for)."""

    reasoning_kind, text_kind = ReasoningItem, OutputMessage

    def __init__(self, response: ResponseObject, split: OutputSplit, tools: ToolTable,
                 logprob: Callable[[TokenEvent], dict | None] = lambda _: None):
        super().__init__(split)
        self.response, self.tools = response, tools
        self._sequence = 0
        self._reasoning_tokens = 0
        self._logprob = logprob
        self._logprobs: list[dict] = []  # of the answer's tokens whose text is still held back

    def event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def open(self) -> list[dict]:
        snapshot = json_dict(self.response)
        return [self.event("response.created", response=snapshot),
                self.event("response.in_progress", response=snapshot)]

    def token(self, event: TokenEvent) -> list[dict]:
        self._reasoning_tokens += self.split.in_reasoning
        entry = None if self.split.in_reasoning else self._logprob(event)
        if entry is not None:
            self._logprobs.append(entry)
        return super().token(event)

    def close(self, done: Finished) -> list[dict]:
        events = self._output(self.split.finish(done.finish_reason))
        complete = done.finish_reason == "stop"
        events += self._close_block(status="completed" if complete else "incomplete")
        r, stats = self.response, done.stats
        r.status = "completed" if complete else "incomplete"
        r.incomplete_details = None if complete else IncompleteDetails(reason="max_output_tokens")
        r.usage = ResponseUsage(
            input_tokens=stats.prompt_tokens, output_tokens=stats.generation_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=stats.cached_tokens),
            output_tokens_details=OutputTokensDetails(reasoning_tokens=self._reasoning_tokens),
            total_tokens=stats.prompt_tokens + stats.generation_tokens)
        r.stats = Stats(**stats.to_dict())
        kind = "response.completed" if complete else "response.incomplete"
        return events + [self.event(kind, response=json_dict(r))]

    def _output(self, out: Output) -> list[dict]:
        events = super()._output(out)
        if out.calls:
            self._logprobs = []  # the tokens of the calls: not output text
        return events

    @property
    def _index(self) -> int:
        return len(self.response.output) - 1

    def _open_block(self, kind: type) -> list[dict]:
        self._open = item = kind()
        item.status, item.content = "in_progress", []
        self.response.output.append(item)
        added = self.event("response.output_item.added", output_index=self._index,
                           item=json_dict(item))
        item.content.append(OutputText(text="") if isinstance(item, OutputMessage)
                            else ReasoningText(text=""))
        return [added, self.event("response.content_part.added", item_id=item.id,
                                  output_index=self._index, content_index=0,
                                  part=json_dict(item.content[0]))]

    def _append(self, item, text: str) -> list[dict]:
        part = item.content[0]
        part.text += text
        where = {"item_id": item.id, "output_index": self._index, "content_index": 0}
        if isinstance(item, ReasoningItem):
            return [self.event("response.reasoning_text.delta", **where, delta=text)]
        logprobs, self._logprobs = self._logprobs, []
        part.logprobs += logprobs
        return [self.event("response.output_text.delta", **where, delta=text,
                           logprobs=logprobs, from_draft=self._from_draft)]

    def _closed(self, item, status: str = "completed") -> list[dict]:
        item.status = status
        index, part = self.response.output.index(item), item.content[0]
        where = {"item_id": item.id, "output_index": index, "content_index": 0}
        done = (self.event("response.output_text.done", **where, text=part.text,
                           logprobs=part.logprobs)
                if isinstance(item, OutputMessage) else
                self.event("response.reasoning_text.done", **where, text=part.text))
        return [done, self.event("response.content_part.done", **where, part=json_dict(part)),
                self.event("response.output_item.done", output_index=index,
                           item=json_dict(item))]

    def _call(self, call: dict) -> list[dict]:
        """A call's events: added in progress, its input or arguments whole, then done."""
        item = self.tools.output_item(call)
        self.response.output.append(item)
        field = "input" if isinstance(item, CustomToolCallItem) else "arguments"
        text, kind = getattr(item, field), ("response.custom_tool_call_input" if field ==
                                            "input" else "response.function_call_arguments")
        where = {"item_id": item.id, "output_index": self._index}
        added = item.model_copy(update={field: "", "status": "in_progress"})
        done = {"input": text} if field == "input" else {"name": item.name, "arguments": text}
        return [self.event("response.output_item.added", output_index=self._index,
                           item=json_dict(added)),
                self.event(f"{kind}.delta", **where, delta=text),
                self.event(f"{kind}.done", **where, **done),
                self.event("response.output_item.done", output_index=self._index,
                           item=json_dict(item))]


class ResponsesFormat(ResponseFormat):
    """`skeleton`: the response object as the request describes it (echoed fields);
    `on_finish` receives it once it is complete (the response store)."""

    def __init__(self, model: str, tokenizer, skeleton: ResponseObject, tool_calls,
                 tools: ToolTable, on_finish: Callable[[ResponseObject], None],
                 start: ReplyStart):
        super().__init__(model, tokenizer, "resp")
        self._skeleton, self._tool_calls, self._on_finish = skeleton, tool_calls, on_finish
        self._tools, self._start = tools, start
        self._builder: ResponseBuilder | None = None

    def _new_builder(self) -> ResponseBuilder:
        split = OutputSplit.of(self._tool_calls, self.tokenizer, self._start)
        return ResponseBuilder(self._skeleton.model_copy(deep=True), split, self._tools,
                               self._logprob_entry)

    def _logprob_entry(self, event: TokenEvent) -> dict | None:
        """The Responses API's log-probability entry: the chat one's shape."""
        entry = self.token_logprob(event)
        return entry.model_dump() if entry is not None else None

    def stream_open(self) -> list[dict]:
        self._builder = self._new_builder()
        return sse_events(self._builder.open())

    def stream_token(self, event: TokenEvent, first: bool) -> list[dict]:
        return sse_events(self._builder.token(event))

    def stream_close(self, done: Finished, include_usage: bool) -> list[dict]:
        events = self._builder.close(done)
        self._on_finish(self._builder.response)
        return sse_events(events)

    def stream_error(self, error: APIError) -> list[dict]:
        body = error.body()["error"]
        return sse_events([self._builder.event("error", code=body["code"], message=body["message"],
                                          param=body["param"])])

    def stream_end(self) -> list[dict]:
        return []

    def response(self, events: list[TokenEvent], done: Finished) -> ResponseObject:
        builder = self._new_builder()
        builder.open()
        for event in events:
            builder.token(event)
        builder.close(done)
        self._on_finish(builder.response)
        return builder.response
