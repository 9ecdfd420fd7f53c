"""OpenAI's Predicted Outputs: the client sends its guess of the answer (`prediction`, such as the
file it asks to edit) and the guess drafts it.

The answer so far is kept aligned with the guess: each round drafts what follows, in the guess,
the answer's last n-gram (the longest of 3 or 2 tokens that occurs), found from where the
previous round's match was, so a repeated line in code continues where the answer is; from
anywhere in the guess when the answer left it (a deleted or rewritten part). Before the first
token the guess's start is the draft. Where the guess has no match, or prompt lookup finds a
longer one in the prompt and the answer (the model left the guess and repeats itself), the
request's own drafter drafts. Rounds drafted from the guess count as prompt lookup's: no second
model runs, and the target verifies every token, so the output is what it would be without a
guess.
"""

from __future__ import annotations

from array import array

from server.engine.speculation.prompt_lookup import DEFAULT_MAX_NGRAM, as_token_buffer

_WORD = array("I").itemsize


class PredictionDraft:
    def __init__(self, prediction: tuple[int, ...] | list[int]):
        self._tokens = as_token_buffer(list(prediction))
        self._data = self._tokens.tobytes()
        self._cursor = 0  # where the last match ended, in the guess

    def __len__(self) -> int:
        return len(self._tokens)

    def propose(self, output: list[int], num_tokens: int,
                min_ngram: int = 2) -> tuple[list[int], int]:
        """Up to `num_tokens` tokens of the guess that follow the answer so far (`output`),
        found by an n-gram of at least `min_ngram` tokens (a single token, a space or a
        bracket, matches anywhere and drafts noise), and the n-gram's length (the longest
        there is before the first token)."""
        if num_tokens <= 0:
            return [], 0
        if not output:
            return self._tokens[:num_tokens].tolist(), DEFAULT_MAX_NGRAM
        for n in range(min(DEFAULT_MAX_NGRAM, len(output)), min_ngram - 1, -1):
            pattern = array("I", output[-n:]).tobytes()
            start = self._find(pattern, max(self._cursor - n, 0))
            if start is None:
                start = self._find(pattern, 0)
            if start is not None:
                self._cursor = start + n
                return self._tokens[start + n: start + n + num_tokens].tolist(), n
        return [], 0

    def _find(self, pattern: bytes, first: int) -> int | None:
        """Token index of the first occurrence of `pattern` at or after token `first`."""
        pos = first * _WORD
        while True:
            pos = self._data.find(pattern, pos)
            if pos < 0:
                return None
            if pos % _WORD == 0:
                return pos // _WORD
            pos += 1
