"""Prompt lookup: draft the tokens that followed the last n-gram when it occurred before.

Like vLLM's `ngram` speculative method (and "prompt lookup decoding"): the text so far often
repeats itself (code edits, quotes, summaries of the prompt), so the continuation of an earlier
occurrence of the current suffix is a free, model-less draft.

The search runs in C: the tokens become a buffer of 32-bit words and `bytes.rfind` finds the
n-gram's last earlier occurrence; a match that is not word-aligned is skipped.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

DEFAULT_MAX_NGRAM = 3
DEFAULT_MIN_NGRAM = 1

_WORD = array("I").itemsize


def as_token_buffer(tokens: Sequence[int]) -> array:
    """The 32-bit unsigned buffer `find_continuation` searches (pass one to skip a copy)."""
    return tokens if isinstance(tokens, array) and tokens.typecode == "I" else array("I", tokens)


def find_continuation(
    tokens: Sequence[int],
    num_tokens: int,
    *,
    max_ngram: int = DEFAULT_MAX_NGRAM,
    min_ngram: int = DEFAULT_MIN_NGRAM,
) -> list[int]:
    """Up to `num_tokens` tokens that followed the most recent earlier occurrence of the last
    n-gram of `tokens`, trying n from `max_ngram` down to `min_ngram`; [] when none occurs.

    The continuation may run into the suffix itself (a repeating pattern keeps repeating).
    """
    return find_match(tokens, num_tokens, max_ngram=max_ngram, min_ngram=min_ngram)[0]


def find_match(tokens: Sequence[int], num_tokens: int, *, max_ngram: int = DEFAULT_MAX_NGRAM,
               min_ngram: int = DEFAULT_MIN_NGRAM) -> tuple[list[int], int]:
    """`find_continuation`'s tokens, and the length n of the n-gram they continue (0 when
    none occurs, or no token is asked for)."""
    if min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    length = len(tokens)
    if num_tokens <= 0 or length < 2:
        return [], 0
    buffer = as_token_buffer(tokens)
    data = buffer.tobytes()
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        start = _last_earlier_occurrence(data, data[(length - n) * _WORD :], length - 1)
        if start is not None:
            begin = start + n
            return buffer[begin : begin + num_tokens].tolist(), n
    return [], 0


def _last_earlier_occurrence(data: bytes, pattern: bytes, limit: int) -> int | None:
    """Token index of the last occurrence of `pattern` inside tokens[:limit], if any."""
    end = limit * _WORD
    while True:
        pos = data.rfind(pattern, 0, end)
        if pos < 0:
            return None
        if pos % _WORD == 0:
            return pos // _WORD
        # A match straddling two tokens; look again for one that starts further left.
        end = pos + len(pattern) - 1
