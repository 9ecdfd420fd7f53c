"""Engine events -> Ollama's answers: one JSON object per line while streaming (each token's
text in `message.content`, or `response` for `/api/generate`, with `done: false`), then one
with `done: true`, the reason and the counts and durations (nanoseconds); collected, that last
object holding the whole text. A thinking model's reasoning goes in `thinking`, tool calls in
`message.tool_calls` with their arguments as an object. Our extensions: `from_draft` on each
streamed line, `stats` on the last.
"""

from __future__ import annotations

import json
import time

from api_schemas.openai import Stats
from server.engine import Finished, TokenEvent
from server.http.common.errors import APIError
from server.http.common.output_split import Output, OutputSplit
from server.http.common.reasoning import ReplyStart
from server.http.common.streaming import ResponseFormat, json_dict
from server.http.common.timestamps import rfc3339
from server.http.common.tools import tool_input


def created_at() -> str:
    return rfc3339(time.time())


def nanoseconds(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def ollama_call(call: dict) -> dict:
    function = call["function"]
    return {"function": {"name": function["name"], "arguments": tool_input(function["arguments"])}}


def _line(value: dict) -> list[dict]:
    return [{"data": json.dumps(value, ensure_ascii=False)}]


class OllamaFormat(ResponseFormat):
    """`chat`: `/api/chat`'s `message` (else `/api/generate`'s `response`); `tool_calls` and
    `start` as for the chat format (None: no calls, no reasoning to split off)."""

    def __init__(self, model: str, tokenizer, *, chat: bool, tool_calls=None,
                 start: ReplyStart | None = None):
        super().__init__(model, tokenizer, "ollama")
        self._chat, self._tool_calls, self._start = chat, tool_calls, start
        self._stream = self._split()

    def _split(self) -> OutputSplit:
        return OutputSplit.of(self._tool_calls, self.tokenizer, self._start)

    def _object(self, out: Output, **extra) -> dict:
        value: dict = {"model": self.model, "created_at": created_at()}
        if self._chat:
            message = {"role": "assistant", "content": out.content}
            if out.reasoning:
                message["thinking"] = out.reasoning
            if out.calls:
                message["tool_calls"] = [ollama_call(c) for c in out.calls]
            value["message"] = message
        else:
            value["response"] = out.content
            if out.reasoning:
                value["thinking"] = out.reasoning
        return value | extra

    def _logprobs(self, events: list[TokenEvent]) -> dict:
        entries = [self.token_logprob(e) for e in events]
        if not entries or entries[0] is None:
            return {}
        return {"logprobs": [json_dict(e) for e in entries]}

    def _final(self, out: Output, done: Finished, events: list[TokenEvent]) -> dict:
        s = done.stats
        return self._object(
            out, done=True, done_reason=done.finish_reason,
            total_duration=nanoseconds(s.total_s), load_duration=0,
            prompt_eval_count=s.prompt_tokens, prompt_eval_duration=nanoseconds(s.ttft_s),
            eval_count=s.generation_tokens, eval_duration=nanoseconds(s.total_s - s.ttft_s),
            **self._logprobs(events), stats=json_dict(Stats(**s.to_dict())))

    def stream_token(self, event: TokenEvent, first: bool) -> list[dict]:
        out = self._stream.feed(event.text)
        return _line(self._object(out, done=False, from_draft=event.from_draft,
                                  **self._logprobs([event])))

    def stream_close(self, done: Finished, include_usage: bool) -> list[dict]:
        return _line(self._final(self._stream.finish(done.finish_reason), done, []))

    def stream_error(self, error: APIError) -> list[dict]:
        return _line({"error": error.shown_message})

    def stream_end(self) -> list[dict]:
        return []

    def response(self, events: list[TokenEvent], done: Finished) -> dict:
        split = self._split()
        out = split.feed("".join(e.text for e in events)) + split.finish(done.finish_reason)
        return self._final(out, done, events)
