"""Engine events -> API responses, streamed (SSE) or collected.

One code path serves every endpoint; a `ResponseFormat` knows the shape of each, in its API's
folder: OpenAI's chat and text completions (one `data:` chunk per token, then `[DONE]`), the
Responses and Messages APIs (named events, no `[DONE]`), Ollama's JSON lines, llama.cpp's.
"""

from __future__ import annotations

import asyncio
import json
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable

from sse_starlette import EventSourceResponse
from starlette.responses import Response, StreamingResponse

from api_schemas.openai import (
    TokenLogprob,
    TopLogprob,
    response_id,
)
from server.engine import Finished, RequestCancelled, TokenEvent
from server.http.common.choices import Choices
from server.http.common.errors import APIError, as_api_error


class ResponseFormat(ABC):
    """Shapes one completion's stream and its collected response, in one API's wire format.

    A stream is a list of messages per call ({"data": ..., "event": ...}: SSE, or lines of
    JSON for Ollama): `stream_open` once, `stream_token` per token, `stream_close` when the
    choice ends (or `stream_error` after a failure), `stream_end` last."""

    def __init__(self, model: str, tokenizer, prefix: str):
        self.model, self.tokenizer = model, tokenizer
        self.id = response_id(prefix)
        self.created = int(time.time())
        self.index = 0  # of its choice in a response with several

    def sibling_of(self, first: ResponseFormat, index: int) -> ResponseFormat:
        """This format as choice `index` of the response `first` shapes."""
        self.id, self.created, self.index = first.id, first.created, index
        return self

    def token_str(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def token_logprob(self, event: TokenEvent) -> TokenLogprob | None:
        """The chat (and Responses) API's entry for a token; None when none was asked."""
        if event.logprob is None:
            return None
        tok = self.token_str(event.token)
        tops = [TopLogprob(token=self.token_str(t), logprob=lp,
                           bytes=list(self.token_str(t).encode()))
                for t, lp in (event.top_logprobs or ())]
        return TokenLogprob(token=tok, logprob=event.logprob, bytes=list(tok.encode()),
                            top_logprobs=tops)

    def stream_open(self) -> list[dict]:
        return []

    @abstractmethod
    def stream_token(self, event: TokenEvent, first: bool) -> list[dict]: ...

    @abstractmethod
    def stream_close(self, done: Finished, include_usage: bool) -> list[dict]: ...

    @abstractmethod
    def stream_error(self, error: APIError) -> list[dict]:
        """An error after the stream started: reported in-band, then the stream ends."""

    @abstractmethod
    def stream_end(self) -> list[dict]: ...

    @abstractmethod
    def response(self, events: list[TokenEvent], done: Finished):
        """The collected answer of one choice."""

    def stream_usage(self, stats: list, n: int) -> list[dict]:
        """After several choices' streams, the usage of them all (`n` per prompt)."""
        return []

    def combined(self, formats: list[ResponseFormat],
                 results: list[tuple[list[TokenEvent], Finished]], n: int):
        """The collected answer of several choices (`formats[0]` is self), for the APIs
        that have several (`n`, several prompts)."""
        raise NotImplementedError(f"{type(self).__name__} answers one choice")


def sse_events(events: list[dict]) -> list[dict]:
    """Named events (Responses', Anthropic's: each with its `type`) as SSE messages."""
    return [{"event": e["type"], "data": json.dumps(e, ensure_ascii=False)} for e in events]


def json_dict(model) -> dict:
    """A wire model as the JSON-ready dict an event embeds (Responses, Messages)."""
    return model.model_dump(mode="json")


Observer = Callable[[Finished], None]


async def collect(choices: Choices, formats: list[ResponseFormat], observe: Observer,
                  disconnected: Callable[[], Awaitable[bool]] | None = None):
    """Run the choices' jobs to the end and build the non-streamed response.

    A client that goes away while it waits cancels its request too (`disconnected` is polled).
    """
    events: list[list[TokenEvent]] = [[] for _ in formats]
    done: list[Finished | None] = [None] * len(formats)
    watcher = asyncio.create_task(_watch(choices, disconnected)) if disconnected else None
    try:
        await choices.start()
        async for i, event in choices.events():
            if isinstance(event, Finished):
                done[i] = event
                observe(event)
            else:
                events[i].append(event)
    except RequestCancelled:
        return Response(status_code=499)  # nobody is listening any more
    finally:
        if watcher is not None:
            watcher.cancel()
        choices.cancel()  # no-op when finished; frees the rows if this request was cancelled
    if len(formats) == 1:
        return formats[0].response(events[0], done[0])
    return formats[0].combined(formats, list(zip(events, done, strict=True)), choices.n)


DISCONNECT_POLL_S = 0.25


async def _watch(choices: Choices, disconnected: Callable[[], Awaitable[bool]]) -> None:
    while not await disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    choices.cancel()


async def stream_response(choices: Choices, formats: list[ResponseFormat], include_usage: bool,
                          observe: Observer, *, ndjson: bool = False):
    """Fetch each choice's first event before answering, so an early failure is still an HTTP
    error. `ndjson`: each message's data on a line of its own (Ollama's streams), not SSE."""
    await choices.start()
    messages = _messages(choices, formats, include_usage, observe)
    if ndjson:
        return StreamingResponse(_lines(messages), media_type="application/x-ndjson")
    return EventSourceResponse(messages, ping=15)


async def _lines(messages):
    async for message in messages:
        yield message["data"] + "\n"


async def _messages(choices: Choices, formats: list[ResponseFormat], include_usage: bool,
               observe: Observer):
    """One choice: its format's stream. Several: their chunks interleaved as their tokens
    come, each choice closed by its own final chunk, then one usage chunk for all."""
    single = len(formats) == 1
    started = [False] * len(formats)
    stats: list = [None] * len(formats)
    try:
        for fmt in formats:
            for message in fmt.stream_open():
                yield message
        try:
            async for i, event in choices.events():
                if isinstance(event, Finished):
                    observe(event)
                    stats[i] = event.stats
                    for message in formats[i].stream_close(event, include_usage and single):
                        yield message
                    continue
                for message in formats[i].stream_token(event, not started[i]):
                    yield message
                started[i] = True
        except Exception as e:  # the response has started: report in-band, then end
            for message in formats[0].stream_error(as_api_error(e)):
                yield message
        else:
            if include_usage and not single:
                for message in formats[0].stream_usage(stats, choices.n):
                    yield message
        for message in formats[0].stream_end():
            yield message
    finally:
        choices.cancel()  # client gone or stream over: the workers stop within a token
