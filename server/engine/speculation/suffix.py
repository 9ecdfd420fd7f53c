"""Suffix drafting: the continuation of the context in the text this server served before.

As vLLM's suffix decoding (Arctic Inference): a repeated request (a retry, a regenerate, an
eval rerun, an agent asking again) is answered with the text the server just wrote, and agents
write the same tool calls and code again and again. The index holds recent answers (each with
the tail of its prompt, which anchors a repeated request's first tokens), and a request's own
prompt and output are searched as well. A proposal continues the longest match of the
context's end: among the earlier occurrences that match it deepest (up to `MAX_MATCH` tokens),
each next token is the one most of them continue with, and its confidence is how many of them
agree (the counts of a suffix tree's children over their parent's). The target verifies every
drafted token, so the output is what it would be without drafts.

Occurrences are found by the context's last `ANCHOR` tokens (and, where that is too common to
keep every occurrence, its last `LONG_ANCHOR` tokens), kept per tenant (an API key), so one
key's text never drafts another key's answer. The index is bounded in bytes: the oldest
documents leave first.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

DEFAULT_SUFFIX_MAX_MB = 64.0  # the index's bound: about 180,000 tokens of answers
ANCHOR = 3  # tokens an occurrence must match to be found (a shorter match drafts noise)
# Tokens an occurrence is also found by: the tail of a chat prompt ("<|im_start|>assistant\n")
# ends every request alike, so its short anchor keeps only the latest occurrences; the long one
# still finds the repeated request's own.
LONG_ANCHOR = 12
MAX_OCCURRENCES = 32  # kept per anchor (the latest), and walked per proposal
MAX_MATCH = 32  # tokens a match is measured back over (vLLM's suffix tree depth is 24)
PROMPT_TAIL = 32  # prompt tokens stored before each answer: they anchor a repeated request
# A proposal stops where the chance that all of it is accepted falls below this (vLLM's
# suffix_decoding_min_token_prob), and drafts at most SPEC_FACTOR tokens per matched token
# (its max_spec_factor): a short match is weak evidence.
MIN_CONFIDENCE = 0.1
SPEC_FACTOR = 1.0
# The pseudo-count of "something else" after a match of m tokens is SMOOTHING / m: one earlier
# occurrence of a 3-token match predicts with 0.75, of a 32-token match with 0.97.
SMOOTHING = 1.0
# What the index costs per stored token: the token, and an entry per anchor (a dict slot, its
# key and its reference). Measured with tracemalloc on random answers (every anchor new): 230
# bytes per token while it fills, 332 once the oldest leave (dicts keep their tables);
# tests/engine/speculation/test_suffix.py keeps the bound honest.
BYTES_PER_TOKEN = 360
BYTES_PER_DOCUMENT = 400

# A proposal's confidence, from counts, is scaled by how suffix rounds did against it: a row's
# (accepted + weight x prior) / (expected + weight), the prior being the index's own factor
# over every row's rounds (decayed: about the last hundred count), itself shrunk towards 1.
CALIBRATION_WEIGHT = 4.0
CALIBRATION_DECAY = 0.99

_WORD = array("I").itemsize
_BITS = 21  # short anchor keys pack their tokens' ids, each below 2**21 (every vocabulary is)
_HASH_BASE = 0x100000001B3  # long anchor keys: a polynomial hash mod 2**64 (FNV's prime)
_MASK64 = (1 << 64) - 1
_LONG_BIT = 1 << 63  # set in long keys, never in short ones (< 2**63)


@dataclass(frozen=True)
class SuffixProposal:
    """What suffix drafting proposes for the next positions, and how sure it is."""

    tokens: list[int] = field(default_factory=list)
    # confidence[j]: the chance that tokens[: j + 1] are all accepted, from the counts
    confidence: list[float] = field(default_factory=list)
    match_length: int = 0  # how many context tokens its occurrences matched (0: none)
    occurrences: int = 0  # how many earlier occurrences matched that deep

    def expected_accepted(self, k: int | None = None) -> float:
        """Expected accepted tokens of its first k (all) tokens."""
        return sum(self.confidence[:k])


NO_PROPOSAL = SuffixProposal()


class SuffixCalibration:
    """How suffix rounds did against their expected accepted tokens (from counts): a row's
    (`parent`: the index's, which every row's rounds also feed), or the index's (`decay`)."""

    def __init__(self, parent: SuffixCalibration | None = None, decay: float = 1.0):
        self.parent, self.decay = parent, decay
        self.accepted = self.expected = 0.0

    def record(self, expected: float, accepted: int) -> None:
        self.expected = self.expected * self.decay + expected
        self.accepted = self.accepted * self.decay + accepted
        if self.parent is not None:
            self.parent.record(expected, accepted)

    def factor(self, shared: bool = True) -> float:
        """accepted / expected, shrunk towards the parent's factor (`shared`; else 1)."""
        prior = self.parent.factor() if shared and self.parent is not None else 1.0
        return (self.accepted + CALIBRATION_WEIGHT * prior) / (self.expected
                                                               + CALIBRATION_WEIGHT)


@dataclass
class _Document:
    tenant: str
    tokens: array
    serial: int

    @property
    def nbytes(self) -> int:
        return BYTES_PER_DOCUMENT + BYTES_PER_TOKEN * len(self.tokens)


class SuffixIndex:
    """Recent answers of one target, searched by the context's end; at most `max_bytes`."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0  # what the stored texts cost (BYTES_PER_TOKEN...), at most max_bytes
        self.tokens = 0  # tokens stored (kept as a count: other threads read it)
        self._documents: dict[int, _Document] = {}  # oldest first
        self._anchors: dict[str, dict[int, int | list[int]]] = {}  # tenant: anchor: refs
        self._serial = 0
        self.calibration = SuffixCalibration(decay=CALIBRATION_DECAY)  # rows' prior

    def __len__(self) -> int:
        return len(self._documents)

    def clear(self) -> int:
        """Forget every stored text; how many there were."""
        count = len(self._documents)
        self._documents.clear()
        self._anchors.clear()
        self.nbytes = self.tokens = 0
        self.calibration = SuffixCalibration(decay=CALIBRATION_DECAY)
        return count

    def add(self, tenant: str, tokens: Sequence[int]) -> None:
        """Store a served text (the tail of a prompt and its answer) for `tenant`'s requests;
        the oldest texts leave to make room. A text larger than the bound keeps its end."""
        room = (self.max_bytes - BYTES_PER_DOCUMENT) // BYTES_PER_TOKEN
        if room <= ANCHOR or len(tokens) <= ANCHOR:
            return
        self._serial += 1
        doc = _Document(tenant, array("I", tokens[-room:]), self._serial)
        while self._documents and self.nbytes + doc.nbytes > self.max_bytes:
            self._remove(next(iter(self._documents.values())))
        self._documents[doc.serial] = doc
        self.nbytes += doc.nbytes
        self.tokens += len(doc.tokens)
        anchors = self._anchors.setdefault(tenant, {})
        for key, pos in _anchor_items(doc.tokens):
            _insert(anchors, key, _ref(doc.serial, pos))

    def _remove(self, doc: _Document) -> None:
        del self._documents[doc.serial]
        self.nbytes -= doc.nbytes
        self.tokens -= len(doc.tokens)
        anchors = self._anchors[doc.tenant]
        for key, pos in _anchor_items(doc.tokens):
            _delete(anchors, key, _ref(doc.serial, pos))
        if not anchors:
            del self._anchors[doc.tenant]

    def propose(self, tenant: str, context: array, num_tokens: int, *,
                stored: bool = True) -> SuffixProposal:
        """Up to `num_tokens` tokens that continue `context` (a buffer of 32-bit token ids,
        `prompt_lookup.as_token_buffer`), from its own earlier text and, with `stored`,
        from `tenant`'s stored texts."""
        n = len(context)
        if num_tokens <= 0 or n < ANCHOR + 1:
            return NO_PROPOSAL
        found = [_Occurrence(context, pos, True) for pos in _own_occurrences(context)]
        anchors = self._anchors.get(tenant) if stored else None
        if anchors:
            found += self._stored_occurrences(anchors, context)
        return _walk(found, context, num_tokens)

    def _stored_occurrences(self, anchors: dict, context: array) -> list[_Occurrence]:
        """The stored occurrences of the context's end (latest first): by its long anchor,
        then by its short one."""
        refs: list[int] = []
        for length in (LONG_ANCHOR, ANCHOR):
            if len(context) >= length:
                entry = anchors.get(_key(context, len(context), length))
                refs += [entry] if isinstance(entry, int) else reversed(entry or ())
        seen, found = set(), []
        for ref in refs:
            if ref in seen:
                continue
            seen.add(ref)
            doc = self._documents.get(ref >> 32)
            if doc is not None:
                found.append(_Occurrence(doc.tokens, ref & 0xFFFFFFFF, False))
        return found


@dataclass
class _Occurrence:
    """An earlier occurrence of the context's end: its continuation starts at `pos` of
    `tokens`. `own`: in the context itself, whose continuation runs on into the draft."""

    tokens: array
    pos: int
    own: bool
    depth: int = 0

    def token(self, j: int, drafted: list[int]) -> int | None:
        i = self.pos + j
        if i < len(self.tokens):
            return self.tokens[i]
        return drafted[i - len(self.tokens)] if self.own else None


def _walk(found: list[_Occurrence], context: array, num_tokens: int) -> SuffixProposal:
    """The proposal from the deepest matching occurrences: each step takes the token most of
    them continue with (the latest on a tie) and keeps those; its confidence is the running
    product of each step's share, smoothed by the match length."""
    n = len(context)
    for occ in found:
        occ.depth = _match_length(occ.tokens, occ.pos, context, n)
    deepest = max((occ.depth for occ in found), default=0)
    if deepest < ANCHOR:
        return NO_PROPOSAL
    group = [occ for occ in found if occ.depth == deepest]
    occurrences = len(group)
    tokens: list[int] = []
    confidence: list[float] = []
    chance = 1.0
    for j in range(min(num_tokens, max(1, int(SPEC_FACTOR * deepest)))):
        following: dict[int, list[_Occurrence]] = {}
        for occ in group:
            token = occ.token(j, tokens)
            if token is not None:
                following.setdefault(token, []).append(occ)
        if not following:
            break
        token, agree = max(following.items(), key=lambda item: len(item[1]))
        chance *= len(agree) / (len(group) + SMOOTHING / (deepest + j))
        if chance < MIN_CONFIDENCE:
            break
        tokens.append(token)
        confidence.append(chance)
        group = agree
    return SuffixProposal(tokens, confidence, deepest, occurrences)


def _match_length(tokens: array, end: int, context: array, n: int) -> int:
    """How many tokens before `end` in `tokens` equal the last ones of `context[:n]` (at most
    `MAX_MATCH`)."""
    cap = min(MAX_MATCH, end, n)
    m = 0
    while m < cap and tokens[end - 1 - m] == context[n - 1 - m]:
        m += 1
        if m == ANCHOR + 1 and tokens[end - cap: end] == context[n - cap: n]:
            return cap  # a deep match (a repeat): compared at once
    return m


def _own_occurrences(context: array) -> list[int]:
    """Where the continuations of the latest `MAX_OCCURRENCES` earlier occurrences of the
    context's last `ANCHOR` tokens start (latest first), each before the context's end."""
    n = len(context)
    data = context.tobytes()
    pattern = data[(n - ANCHOR) * _WORD:]
    found, end = [], (n - 1) * _WORD
    while len(found) < MAX_OCCURRENCES:
        pos = data.rfind(pattern, 0, end)
        if pos < 0:
            break
        if pos % _WORD == 0:
            found.append(pos // _WORD + ANCHOR)
        end = pos + len(pattern) - 1  # the next one starts further left (overlaps allowed)
    return found


def _key(tokens: array, end: int, length: int) -> int:
    """The anchor key of `tokens[end - length: end]` (`_anchor_keys`' for one position)."""
    if length == ANCHOR:
        a, b, c = tokens[end - 3: end]
        return (a << 2 * _BITS) | (b << _BITS) | c
    h = 0
    for t in tokens[end - length: end]:
        h = (h * _HASH_BASE + t) & _MASK64
    return h | _LONG_BIT


def _anchor_keys(tokens: array) -> tuple[list[int], list[int]]:
    """The short and the long anchor keys of every position of a stored text that something
    follows: `short[i]` is position i + ANCHOR's, `long[i]` position i + LONG_ANCHOR's. Short
    keys pack the ids (exact); long ones are a polynomial hash (a collision only finds an
    occurrence whose match length is then short), with the top bit set. Computed with numpy
    (a Python loop over each position took 10 us per token)."""
    t = np.frombuffer(tokens, dtype=np.uint32).astype(np.uint64)
    n = len(t)
    short = ((t[: n - 3] << 2 * _BITS) | (t[1: n - 2] << _BITS) | t[2: n - 1]).tolist()
    h = np.zeros(max(n - LONG_ANCHOR, 0), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(LONG_ANCHOR):
            h = h * np.uint64(_HASH_BASE) + t[j: j + len(h)]
    return short, (h | np.uint64(_LONG_BIT)).tolist()


def _anchor_items(tokens: array):
    """(key, continuation start) of every anchor of a stored text."""
    short, long = _anchor_keys(tokens)
    yield from zip(short, range(ANCHOR, len(tokens)), strict=True)
    yield from zip(long, range(LONG_ANCHOR, len(tokens)), strict=True)


def _ref(serial: int, pos: int) -> int:
    return serial << 32 | pos


def _insert(anchors: dict, key: int, ref: int) -> None:
    entry = anchors.get(key)
    if entry is None:
        anchors[key] = ref
    elif isinstance(entry, int):
        anchors[key] = [entry, ref]
    else:
        entry.append(ref)
        if len(entry) > MAX_OCCURRENCES:
            del entry[0]


def _delete(anchors: dict, key: int, ref: int) -> None:
    entry = anchors.get(key)
    if entry == ref:
        del anchors[key]
    elif isinstance(entry, list) and ref in entry:
        entry.remove(ref)
        if not entry:
            del anchors[key]
