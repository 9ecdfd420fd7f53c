"""Engine events -> OpenAI responses, streamed (SSE, one chunk per token) or collected.

One code path serves both endpoints; a `ResponseFormat` knows the shape of each.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

from sse_starlette import EventSourceResponse

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
    Stats,
    TokenLogprob,
    TopLogprob,
    Usage,
    response_id,
)
from server.engine.events import Finished, TokenEvent
from server.engine.worker import StreamJob
from server.http.errors import as_api_error


def usage_of(stats) -> Usage:
    return Usage(prompt_tokens=stats.prompt_tokens, completion_tokens=stats.generation_tokens,
                 total_tokens=stats.prompt_tokens + stats.generation_tokens)


class ResponseFormat:
    """Shapes one completion's chunks and its collected response."""

    def __init__(self, model: str, tokenizer, prefix: str):
        self.model, self.tokenizer = model, tokenizer
        self.id = response_id(prefix)
        self.created = int(time.time())

    def token_str(self, token: int) -> str:
        return self.tokenizer.decode([token])


class ChatFormat(ResponseFormat):
    def __init__(self, model: str, tokenizer):
        super().__init__(model, tokenizer, "chatcmpl")

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
        delta = Delta(role="assistant" if first else None, content=event.text)
        return self._chunk(ChatChunkChoice(delta=delta, from_draft=event.from_draft,
                                           logprobs=self.logprobs([event])))

    def final_chunk(self, done: Finished):
        return self._chunk(ChatChunkChoice(delta=Delta(), finish_reason=done.finish_reason),
                           stats=Stats(**done.stats.to_dict()))

    def usage_chunk(self, done: Finished):
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   choices=[], usage=usage_of(done.stats))

    def response(self, events: list[TokenEvent], done: Finished):
        message = AssistantMessage(content="".join(e.text for e in events))
        choice = ChatChoice(message=message, finish_reason=done.finish_reason,
                            logprobs=self.logprobs(events))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model,
                                      choices=[choice], usage=usage_of(done.stats),
                                      stats=Stats(**done.stats.to_dict()))


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


Observer = Callable[[Finished], None]


async def collect(job: StreamJob, fmt: ResponseFormat, observe: Observer):
    """Run a job to the end and build the non-streamed response."""
    events, done = [], None
    try:
        async for event in job:
            if isinstance(event, Finished):
                done = event
                observe(done)
            else:
                events.append(event)
    finally:
        job.cancel()  # no-op when finished; stops the worker if this request was cancelled
    return fmt.response(events, done)


async def stream_response(job: StreamJob, fmt: ResponseFormat, include_usage: bool,
                          observe: Observer):
    """Fetch the first event before answering, so an early failure is still an HTTP error."""
    events = job.__aiter__()
    try:
        first = await events.__anext__()
    except BaseException:
        job.cancel()
        raise
    return EventSourceResponse(_sse(job, events, first, fmt, include_usage, observe), ping=15)


async def _sse(job: StreamJob, events: AsyncIterator, first, fmt: ResponseFormat,
               include_usage: bool, observe: Observer):
    try:
        event, is_first = first, True
        while True:
            if isinstance(event, Finished):
                observe(event)
                yield {"data": _dump(fmt.final_chunk(event))}
                if include_usage:
                    yield {"data": _dump(fmt.usage_chunk(event))}
                break
            yield {"data": _dump(fmt.token_chunk(event, is_first))}
            is_first = False
            try:
                event = await events.__anext__()
            except StopAsyncIteration:
                break
            except Exception as e:  # the response has started: report in-band, then end
                yield {"data": json.dumps(as_api_error(e).body())}
                break
        yield {"data": "[DONE]"}
    finally:
        job.cancel()  # client gone or stream over: the worker stops within a token
