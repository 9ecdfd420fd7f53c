"""Engine events -> llama.cpp server's `/completion` answer (what `/infill` returns): one JSON
object, or SSE chunks `{"content", "stop": false}` then the whole object with `"stop": true`
(no `[DONE]`)."""

from __future__ import annotations

import json

from api_schemas.openai import Stats
from server.engine import Finished, TokenEvent
from server.http.common.errors import APIError
from server.http.common.streaming import ResponseFormat, json_dict


class InfillFormat(ResponseFormat):
    """`hide`: answer with no text (a warm-up request: its one token is dropped)."""

    def __init__(self, model: str, tokenizer, *, hide: bool = False):
        super().__init__(model, tokenizer, "infill")
        self._hide = hide

    def _final(self, content: str, done: Finished) -> dict:
        s = done.stats
        stop_type = ("limit" if done.finish_reason == "length"
                     else "word" if done.stop_sequence else "eos")
        prompt_ms, predicted_ms = s.ttft_s * 1e3, (s.total_s - s.ttft_s) * 1e3
        evaluated = s.prompt_tokens - s.cached_tokens
        return {
            "index": 0, "content": content, "id_slot": 0, "stop": True, "model": self.model,
            "tokens_predicted": 0 if self._hide else s.generation_tokens,
            "tokens_evaluated": s.prompt_tokens,
            "tokens_cached": s.cached_tokens, "truncated": False,
            "has_new_line": "\n" in content, "stop_type": stop_type,
            "stopping_word": done.stop_sequence or "",
            "timings": {
                "prompt_n": evaluated, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / max(evaluated, 1),
                "prompt_per_second": s.prompt_tps,
                "predicted_n": s.generation_tokens, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / max(s.generation_tokens, 1),
                "predicted_per_second": s.generation_tps},
            "stats": json_dict(Stats(**s.to_dict()))}

    def stream_token(self, event: TokenEvent, first: bool) -> list[dict]:
        if self._hide:
            return []
        return [{"data": json.dumps({"index": 0, "content": event.text, "stop": False,
                                     "from_draft": event.from_draft}, ensure_ascii=False)}]

    def stream_close(self, done: Finished, include_usage: bool) -> list[dict]:
        return [{"data": json.dumps(self._final("", done), ensure_ascii=False)}]

    def stream_error(self, error: APIError) -> list[dict]:
        return [{"data": json.dumps(error.body(), ensure_ascii=False)}]

    def stream_end(self) -> list[dict]:
        return []

    def response(self, events: list[TokenEvent], done: Finished) -> dict:
        return self._final("" if self._hide else "".join(e.text for e in events), done)
