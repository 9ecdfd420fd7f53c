"""OpenAI's chat and text completions: their SSE chunks (one per token, then `[DONE]`) and
collected responses, for one choice or several (`n`, several prompts)."""

from __future__ import annotations

import itertools
import json
import math
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

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
    CompletionTokensDetails,
    Delta,
    PromptTokensDetails,
    Stats,
    ToolCallDelta,
    Usage,
)
from server.engine import Finished, PromptLogprobs, TokenEvent
from server.http.common.errors import APIError
from server.http.common.output_split import Output, OutputSplit
from server.http.common.reasoning import ReplyStart
from server.http.common.streaming import ResponseFormat
from server.http.common.tools import ToolCallParser


def usage_of(stats: list, n: int = 1) -> Usage:
    """The usage of choices' stats (index order, `n` per prompt): each prompt counts once."""
    prompts = stats[::n]
    prompt = sum(s.prompt_tokens for s in prompts)
    completion = sum(s.generation_tokens for s in stats)
    predicted = [s for s in stats if s.accepted_prediction_tokens is not None]
    details = CompletionTokensDetails(
        accepted_prediction_tokens=sum(s.accepted_prediction_tokens for s in predicted),
        rejected_prediction_tokens=sum(s.rejected_prediction_tokens for s in predicted),
    ) if predicted else None
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(
                     cached_tokens=sum(s.cached_tokens for s in prompts)),
                 completion_tokens_details=details)


class ChunkFormat(ResponseFormat):
    """OpenAI's chunked stream: a `data:` chunk per token, the final chunk with the stats, the
    usage chunk if asked, then `[DONE]`."""

    @abstractmethod
    def token_chunk(self, event: TokenEvent, first: bool): ...

    @abstractmethod
    def final_chunk(self, done: Finished): ...

    @abstractmethod
    def usage_chunk(self, usage: Usage): ...

    @abstractmethod
    def choice(self, events: list[TokenEvent], done: Finished):
        """One choice of a collected response."""

    @abstractmethod
    def wrap(self, choices: list, usage: Usage, stats: Stats | None):
        """The collected response of `choices`."""

    def stream_token(self, event: TokenEvent, first: bool) -> list[dict]:
        return [{"data": _dump(self.token_chunk(event, first))}]

    def stream_close(self, done: Finished, include_usage: bool) -> list[dict]:
        out = [{"data": _dump(self.final_chunk(done))}]
        if include_usage:
            out += self.stream_usage([done.stats], 1)
        return out

    def stream_usage(self, stats: list, n: int) -> list[dict]:
        return [{"data": _dump(self.usage_chunk(usage_of(stats, n)))}]

    def stream_error(self, error: APIError) -> list[dict]:
        return [{"data": json.dumps(error.body())}]

    def stream_end(self) -> list[dict]:
        return [{"data": "[DONE]"}]

    def response(self, events: list[TokenEvent], done: Finished):
        stats = Stats(**done.stats.to_dict())
        return self.wrap([self.choice(events, done)], usage_of([done.stats]), stats)

    def combined(self, formats: list[ResponseFormat],
                 results: list[tuple[list[TokenEvent], Finished]], n: int):
        """Each choice carries its own stats, the usage counts each prompt once."""
        choices = [fmt.choice(events, done)
                   for fmt, (events, done) in zip(formats, results, strict=True)]
        for choice, (_, done) in zip(choices, results, strict=True):
            choice.stats = Stats(**done.stats.to_dict())
        return self.wrap(choices, usage_of([done.stats for _, done in results], n), None)


def _dump(model) -> str:
    return model.model_dump_json()


class ChatFormat(ChunkFormat):
    """`tool_calls`: a ToolCallParser factory when the request offers tools; `start`: where
    a thinking model's reply starts (reasoning or answer). The text goes
    through an `OutputSplit`, streamed or not, so both split reasoning, content and calls the
    same way."""

    def __init__(self, model: str, tokenizer,
                 tool_calls: Callable[[], ToolCallParser] | None = None,
                 start: ReplyStart | None = None):
        super().__init__(model, tokenizer, "chatcmpl")
        self._tool_calls, self._start = tool_calls, start
        self._plain = tool_calls is None and not self._thinks
        self._stream = self._split()

    @property
    def _thinks(self) -> bool:
        return self._start is not None and self.tokenizer.has_thinking

    def _split(self) -> OutputSplit:
        return OutputSplit.of(self._tool_calls, self.tokenizer, self._start)

    def _chunk(self, choice: ChatChunkChoice, **extra) -> ChatCompletionChunk:
        choice.index = self.index
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   choices=[choice], **extra)

    def logprobs(self, events: list[TokenEvent]) -> ChatLogprobs | None:
        if not events or events[0].logprob is None:
            return None
        return ChatLogprobs(content=[self.token_logprob(e) for e in events])

    def token_chunk(self, event: TokenEvent, first: bool):
        delta = self._delta(self._stream.feed(event.text), role="assistant" if first else None)
        return self._chunk(ChatChunkChoice(delta=delta, from_draft=event.from_draft,
                                           logprobs=self.logprobs([event])))

    def final_chunk(self, done: Finished):
        out = self._stream.finish(done.finish_reason)
        delta = Delta() if self._plain else self._delta(out)
        reason = _tool_finish_reason(done.finish_reason, self._stream)
        return self._chunk(ChatChunkChoice(delta=delta, finish_reason=reason),
                           stats=Stats(**done.stats.to_dict()))

    def _delta(self, out: Output, role=None) -> Delta:
        """A delta of reasoning, content and/or whole calls (OpenAI's `index` counts calls in
        the stream)."""
        first = len(self._stream.calls) - len(out.calls)
        deltas = [ToolCallDelta(index=first + i, **c) for i, c in enumerate(out.calls)] or None
        reasoning = out.reasoning or None
        return Delta(role=role, content=out.content if self._plain else out.content or None,
                     reasoning=reasoning, reasoning_content=reasoning, tool_calls=deltas)

    def usage_chunk(self, usage: Usage):
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   choices=[], usage=usage)

    def wrap(self, choices: list[ChatChoice], usage: Usage, stats: Stats | None):
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model,
                                      choices=choices, usage=usage, stats=stats)

    def choice(self, events: list[TokenEvent], done: Finished) -> ChatChoice:
        split = self._split()
        out = split.feed("".join(e.text for e in events)) + split.finish(done.finish_reason)
        reasoning = out.reasoning or None
        content = out.content or None if out.calls or self._thinks else out.content
        message = AssistantMessage(content=content, reasoning=reasoning,
                                   reasoning_content=reasoning, tool_calls=out.calls or None)
        return ChatChoice(index=self.index, message=message,
                          finish_reason=_tool_finish_reason(done.finish_reason, split),
                          logprobs=self.logprobs(events))


def _tool_finish_reason(reason: str, split: OutputSplit) -> str:
    return "tool_calls" if split.made_calls and reason == "stop" else reason


@dataclass(frozen=True)
class Echo:
    """A completion's prompt, returned before its text (`echo`), with its tokens'
    log-probabilities when `logprobs` was asked (`scores`)."""

    text: str
    tokens: list[int]
    scores: PromptLogprobs | None = None


class TextFormat(ChunkFormat):
    def __init__(self, model: str, tokenizer, echo: Echo | None = None):
        super().__init__(model, tokenizer, "cmpl")
        self.echo = echo
        self._offset = len(echo.text) if echo is not None else 0  # a stream's text so far

    def _response(self, choice: CompletionChoice, **extra) -> CompletionResponse:
        choice.index = self.index
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
            out.top_logprobs.append(self.top_dict(e.top_logprobs or ()))
        return out

    def top_dict(self, top) -> dict[str, float]:
        """Legacy completions' {text: logprob}: where two ids decode to one text, the more
        likely one's (a token that is the most likely has the top value)."""
        out: dict[str, float] = {}
        for token, logprob in top:
            text = self.token_str(token)
            out[text] = max(logprob, out.get(text, -math.inf))
        return out

    def echo_logprobs(self) -> CompletionLogprobs | None:
        """The prompt's tokens: the first with no logprob (nothing precedes it)."""
        if self.echo is None or self.echo.scores is None:
            return None
        scores, strs = self.echo.scores, [self.token_str(t) for t in self.echo.tokens]
        offsets = list(itertools.accumulate((len(t) for t in strs[:-1]), initial=0))
        tops = [self.top_dict(top) for top in scores.top]
        return CompletionLogprobs(tokens=strs, token_logprobs=[None, *scores.logprobs],
                                  top_logprobs=[None, *tops], text_offset=offsets)

    def stream_open(self) -> list[dict]:
        if self.echo is None:
            return []
        choice = CompletionChoice(text=self.echo.text, logprobs=self.echo_logprobs())
        return [{"data": _dump(self._response(choice))}]

    def token_chunk(self, event: TokenEvent, first: bool):
        logprobs = self.logprobs([event], self._offset)
        self._offset += len(event.text)
        return self._response(CompletionChoice(text=event.text, from_draft=event.from_draft,
                                               logprobs=logprobs))

    def final_chunk(self, done: Finished):
        return self._response(CompletionChoice(text="", finish_reason=done.finish_reason),
                              stats=Stats(**done.stats.to_dict()))

    def usage_chunk(self, usage: Usage):
        return CompletionResponse(id=self.id, created=self.created, model=self.model,
                                  choices=[], usage=usage)

    def wrap(self, choices: list[CompletionChoice], usage: Usage, stats: Stats | None):
        return CompletionResponse(id=self.id, created=self.created, model=self.model,
                                  choices=choices, usage=usage, stats=stats)

    def choice(self, events: list[TokenEvent], done: Finished) -> CompletionChoice:
        text = "".join(e.text for e in events)
        prompt = self.echo.text if self.echo is not None else ""
        logprobs = _joined(self.echo_logprobs(), self.logprobs(events, len(prompt)))
        return CompletionChoice(index=self.index, text=prompt + text,
                                finish_reason=done.finish_reason, logprobs=logprobs)


def _joined(*parts: CompletionLogprobs | None) -> CompletionLogprobs | None:
    """Logprobs of consecutive texts (an echoed prompt, then the completion) as one."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    out = CompletionLogprobs(top_logprobs=[])
    for p in parts:
        out.tokens += p.tokens
        out.token_logprobs += p.token_logprobs
        out.top_logprobs += p.top_logprobs
        out.text_offset += p.text_offset
    return out


def combined_response(formats: list[ResponseFormat],
                      results: list[tuple[list[TokenEvent], Finished]], n: int):
    """One response of several choices (`formats` and `results` in index order, `n` per
    prompt): each choice carries its own stats, the usage counts each prompt once."""
    choices = [fmt.choice(events, done) for fmt, (events, done) in zip(formats, results,
                                                                        strict=True)]
    for choice, (_, done) in zip(choices, results, strict=True):
        choice.stats = Stats(**done.stats.to_dict())
    return formats[0].wrap(choices, usage_of([done.stats for _, done in results], n), None)


