"""Engine events -> API responses, streamed (SSE) or collected.

One code path serves every endpoint; a `ResponseFormat` knows the shape of each: the chat and
text completions here (one `data:` chunk per token, then `[DONE]`), the Responses and Messages
APIs in their own modules (named events, no `[DONE]`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from sse_starlette import EventSourceResponse
from starlette.responses import Response

from api_schemas.openai import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Delta,
    PromptTokensDetails,
    Stats,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
    response_id,
)
from server.engine.events import Finished, RequestCancelled, TokenEvent
from server.engine.service import RequestHandle
from server.http.errors import APIError, as_api_error
from server.http.tools import ToolCallParser


def usage_of(stats) -> Usage:
    return Usage(prompt_tokens=stats.prompt_tokens, completion_tokens=stats.generation_tokens,
                 total_tokens=stats.prompt_tokens + stats.generation_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=stats.cached_tokens))


class ResponseFormat:
    """Shapes one completion's chunks and its collected response."""

    def __init__(self, model: str, tokenizer, prefix: str):
        self.model, self.tokenizer = model, tokenizer
        self.id = response_id(prefix)
        self.created = int(time.time())

    def token_str(self, token: int) -> str:
        return self.tokenizer.decode([token])

    # The stream as SSE messages ({"data": ..., "event": ...}); by default OpenAI's chunks.
    def stream_open(self) -> list[dict]:
        return []

    def stream_token(self, event: TokenEvent, first: bool) -> list[dict]:
        return [{"data": _dump(self.token_chunk(event, first))}]

    def stream_close(self, done: Finished, include_usage: bool) -> list[dict]:
        out = [{"data": _dump(self.final_chunk(done))}]
        if include_usage:
            out.append({"data": _dump(self.usage_chunk(done))})
        return out

    def stream_error(self, error: APIError) -> list[dict]:
        """An error after the stream started: reported in-band, then the stream ends."""
        return [{"data": json.dumps(error.body())}]

    def stream_end(self) -> list[dict]:
        return [{"data": "[DONE]"}]


class ChatFormat(ResponseFormat):
    """`tool_calls`: a ToolCallParser factory when the request offers tools; the text then
    goes through it, streamed or not, so both split content and calls the same way."""

    def __init__(self, model: str, tokenizer,
                 tool_calls: Callable[[], ToolCallParser] | None = None):
        super().__init__(model, tokenizer, "chatcmpl")
        self._tool_calls = tool_calls
        self._stream_tools = tool_calls() if tool_calls is not None else None

    def _chunk(self, choice: ChatChunkChoice, **extra) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   choices=[choice], **extra)

    def logprobs(self, events: list[TokenEvent]) -> ChatLogprobs | None:
        if not events or events[0].logprob is None:
            return None
        content = []
        for e in events:
            tok = self.token_str(e.token)
            tops = [TopLogprob(token=self.token_str(t), logprob=lp,
                               bytes=list(self.token_str(t).encode()))
                    for t, lp in (e.top_logprobs or ())]
            content.append(TokenLogprob(token=tok, logprob=e.logprob, bytes=list(tok.encode()),
                                        top_logprobs=tops))
        return ChatLogprobs(content=content)

    def token_chunk(self, event: TokenEvent, first: bool):
        role = "assistant" if first else None
        if self._stream_tools is None:
            delta = Delta(role=role, content=event.text)
        else:
            delta = self._tool_delta(*self._stream_tools.feed(event.text), role=role)
        return self._chunk(ChatChunkChoice(delta=delta, from_draft=event.from_draft,
                                           logprobs=self.logprobs([event])))

    def final_chunk(self, done: Finished):
        delta, reason = Delta(), done.finish_reason
        if self._stream_tools is not None:
            delta = self._tool_delta(*self._stream_tools.finish())
            reason = _tool_finish_reason(reason, self._stream_tools)
        return self._chunk(ChatChunkChoice(delta=delta, finish_reason=reason),
                           stats=Stats(**done.stats.to_dict()))

    def _tool_delta(self, content: str, calls: list[dict], role=None) -> Delta:
        """A delta of content and/or whole calls (OpenAI's `index` counts calls in the stream)."""
        first = len(self._stream_tools.calls) - len(calls)
        deltas = [ToolCallDelta(index=first + i, **c) for i, c in enumerate(calls)] or None
        return Delta(role=role, content=content or None, tool_calls=deltas)

    def usage_chunk(self, done: Finished):
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   choices=[], usage=usage_of(done.stats))

    def response(self, events: list[TokenEvent], done: Finished):
        text, reason = "".join(e.text for e in events), done.finish_reason
        message = AssistantMessage(content=text)
        if self._tool_calls is not None:
            parser = self._tool_calls()
            content, calls = parser.feed(text)
            rest, more = parser.finish()
            content += rest
            if parser.calls:
                message = AssistantMessage(content=content or None, tool_calls=calls + more)
            else:
                message = AssistantMessage(content=content)
            reason = _tool_finish_reason(reason, parser)
        choice = ChatChoice(message=message, finish_reason=reason,
                            logprobs=self.logprobs(events))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model,
                                      choices=[choice], usage=usage_of(done.stats),
                                      stats=Stats(**done.stats.to_dict()))


def _tool_finish_reason(reason: str, parser: ToolCallParser) -> str:
    return "tool_calls" if parser.calls and reason == "stop" else reason


class TextFormat(ResponseFormat):
    def __init__(self, model: str, tokenizer):
        super().__init__(model, tokenizer, "cmpl")

    def _response(self, choice: CompletionChoice, **extra) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model,
                                  choices=[choice], **extra)

    def logprobs(self, events: list[TokenEvent], offset: int = 0) -> CompletionLogprobs | None:
        if not events or events[0].logprob is None:
            return None
        out = CompletionLogprobs(top_logprobs=[])
        for e in events:
            out.tokens.append(self.token_str(e.token))
            out.token_logprobs.append(e.logprob)
            out.text_offset.append(offset)
            offset += len(e.text)
            out.top_logprobs.append({self.token_str(t): lp for t, lp in (e.top_logprobs or ())})
        return out

    def token_chunk(self, event: TokenEvent, first: bool):
        return self._response(CompletionChoice(text=event.text, from_draft=event.from_draft,
                                               logprobs=self.logprobs([event])))

    def final_chunk(self, done: Finished):
        return self._response(CompletionChoice(text="", finish_reason=done.finish_reason),
                              stats=Stats(**done.stats.to_dict()))

    def usage_chunk(self, done: Finished):
        return CompletionResponse(id=self.id, created=self.created, model=self.model,
                                  choices=[], usage=usage_of(done.stats))

    def response(self, events: list[TokenEvent], done: Finished):
        choice = CompletionChoice(text="".join(e.text for e in events),
                                  finish_reason=done.finish_reason, logprobs=self.logprobs(events))
        return self._response(choice, usage=usage_of(done.stats),
                              stats=Stats(**done.stats.to_dict()))


def _dump(model) -> str:
    return model.model_dump_json()


def json_dict(model) -> dict:
    """A wire model as the JSON-ready dict an event embeds (Responses, Messages)."""
    return model.model_dump(mode="json")


Observer = Callable[[Finished], None]


async def collect(job: RequestHandle, fmt: ResponseFormat, observe: Observer,
                  disconnected: Callable[[], Awaitable[bool]] | None = None):
    """Run a job to the end and build the non-streamed response.

    A client that goes away while it waits cancels its request too (`disconnected` is polled).
    """
    events, done = [], None
    watcher = asyncio.create_task(_watch(job, disconnected)) if disconnected else None
    try:
        async for event in job:
            if isinstance(event, Finished):
                done = event
                observe(done)
            else:
                events.append(event)
    except RequestCancelled:
        return Response(status_code=499)  # nobody is listening any more
    finally:
        if watcher is not None:
            watcher.cancel()
        job.cancel()  # no-op when finished; frees the row if this request was cancelled
    return fmt.response(events, done)


DISCONNECT_POLL_S = 0.25


async def _watch(job: RequestHandle, disconnected: Callable[[], Awaitable[bool]]) -> None:
    while not await disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    job.cancel()


async def stream_response(job: RequestHandle, fmt: ResponseFormat, include_usage: bool,
                          observe: Observer):
    """Fetch the first event before answering, so an early failure is still an HTTP error."""
    events = job.__aiter__()
    try:
        first = await events.__anext__()
    except BaseException:
        job.cancel()
        raise
    return EventSourceResponse(_sse(job, events, first, fmt, include_usage, observe), ping=15)


async def _sse(job: RequestHandle, events: AsyncIterator, first, fmt: ResponseFormat,
               include_usage: bool, observe: Observer):
    try:
        for message in fmt.stream_open():
            yield message
        event, is_first = first, True
        while True:
            if isinstance(event, Finished):
                observe(event)
                for message in fmt.stream_close(event, include_usage):
                    yield message
                break
            for message in fmt.stream_token(event, is_first):
                yield message
            is_first = False
            try:
                event = await events.__anext__()
            except StopAsyncIteration:
                break
            except Exception as e:  # the response has started: report in-band, then end
                for message in fmt.stream_error(as_api_error(e)):
                    yield message
                break
        for message in fmt.stream_end():
            yield message
    finally:
        job.cancel()  # client gone or stream over: the worker stops within a token
