"""A grammar that holds only from a trigger token on: tool calls a model writes by itself.

With `tool_choice: auto` the model may answer in text or call a tool. A small model's calls
break (unbalanced JSON, an invented function, a missing argument), so once it writes the call
marker (`<tool_call>`, a token of its own in the vocabularies that use it: Qwen2.5, Qwen3,
Qwen3-Coder, Hermes), the rest of the call is held to the offered functions' schemas, in the
model's own syntax (Hermes' JSON, or Qwen3-Coder's XML) as llama.cpp's "lazy grammars" do: one
call, then the `</tool_call>` token, then free text again (another call opens a new grammar).
Until the marker, nothing is masked. The grammar's forced tokens (a call's frame, a lone
function's name) then draft themselves.

`LazyConstraint` is a `TokenConstraint`: every consumed token is logged with what it did, so
a rollback (a rejected draft) can undo a call's opening or closing exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from server.engine.errors import GrammarError
from server.engine.structured.grammar import GrammarConstraint

FREE, OPEN, IN, CLOSE = "free", "open", "in", "close"


class LazyConstraint:
    def __init__(self, trigger: int, grammar: Callable[[], GrammarConstraint]):
        self._trigger = trigger
        self._grammar = grammar
        self._active: GrammarConstraint | None = None
        self._log: list[tuple[str, GrammarConstraint | None]] = []  # per consumed token

    def allowed(self) -> np.ndarray | None:
        return self._active.allowed() if self._active is not None else None

    def forced(self) -> list[int]:
        return self._active.forced() if self._active is not None else []

    def consume(self, tokens: list[int]) -> int:
        for count, token in enumerate(tokens):
            active = self._active
            if active is None:
                if int(token) == self._trigger:
                    self._active = self._grammar()
                    self._log.append((OPEN, self._active))
                else:
                    self._log.append((FREE, None))
                continue
            if active.consume([int(token)]) != 1:
                return count
            if active.is_finished():  # the call's `</tool_call>`: free text again
                self._log.append((CLOSE, active))
                self._active = None
            else:
                self._log.append((IN, active))
        return len(tokens)

    def rollback(self, num_tokens: int) -> None:
        for _ in range(num_tokens):
            kind, grammar = self._log.pop()
            if kind == OPEN:
                self._active = None
            elif kind in (IN, CLOSE):
                grammar.rollback(1)
                self._active = grammar

    def is_finished(self) -> bool:
        return False


def lazy_tool_calls(grammars, vocab: dict[str, int], functions: list[dict], start: str,
                    end: str, syntax: str = "json"):
    """A builder of the constraint for calls opened by the `start` token and closed by the
    `end` token (`GenerationParams.constraint`), written in `syntax` ("json": Hermes' JSON,
    `Grammars.tool_call_body`; "xml": Qwen3-Coder's, `Grammars.xml_call_body`); None when
    either token is not one token of `vocab` or the functions' schemas do not compile."""
    if start not in vocab or end not in vocab:
        return None
    body = grammars.xml_call_body if syntax == "xml" else grammars.tool_call_body
    try:
        grammar = body(functions, vocab[end])
    except GrammarError:
        return None
    return lambda: LazyConstraint(vocab[start], grammar)
