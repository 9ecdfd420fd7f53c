"""The suffix index: proposals against a brute-force reference of their definition, counts as
confidence, tenants kept apart, and the byte bound (measured with tracemalloc)."""

from __future__ import annotations

import random
import tracemalloc
from array import array

import pytest

from server.engine.speculation.suffix import (
    ANCHOR,
    MAX_MATCH,
    MIN_CONFIDENCE,
    SMOOTHING,
    SPEC_FACTOR,
    SuffixIndex,
)


def ctx(tokens) -> array:
    return array("I", tokens)


def reference(docs: list[list[int]], context: list[int], k: int):
    """The definition, spelled out: every earlier occurrence of the context's last ANCHOR
    tokens (in the context itself, its continuation running on into the draft; in the stored
    texts, newest first, each latest first), measured back up to MAX_MATCH tokens; the deepest
    ones are walked, each step taking the token most of them continue with (the first in that
    order on a tie)."""
    n = len(context)
    found = []  # (tokens, continuation start, own)
    found += [(context, pos, True) for pos in range(n - 1, ANCHOR - 1, -1)
              if context[pos - ANCHOR: pos] == context[n - ANCHOR:]]
    for doc in reversed(docs):
        found += [(doc, pos, False) for pos in range(len(doc) - 1, ANCHOR - 1, -1)
                  if doc[pos - ANCHOR: pos] == context[n - ANCHOR:]]

    def depth(tokens, end):
        m = 0
        while m < min(MAX_MATCH, end, n) and tokens[end - 1 - m] == context[n - 1 - m]:
            m += 1
        return m

    depths = [depth(tokens, pos) for tokens, pos, _ in found]
    deepest = max(depths, default=0)
    if deepest < ANCHOR or k <= 0:
        return [], [], 0
    group = [f for f, d in zip(found, depths, strict=True) if d == deepest]
    tokens, confidence, chance = [], [], 1.0
    for j in range(min(k, max(1, int(SPEC_FACTOR * deepest)))):
        nexts = []
        for seq, pos, own in group:
            i = pos + j
            nexts.append(seq[i] if i < len(seq) else tokens[i - len(seq)] if own else None)
        counted = [t for t in nexts if t is not None]
        if not counted:
            break
        best = max(counted, key=lambda t: (counted.count(t), -counted.index(t)))
        chance *= counted.count(best) / (len(group) + SMOOTHING / (deepest + j))
        if chance < MIN_CONFIDENCE:
            break
        tokens.append(best)
        confidence.append(chance)
        group = [g for g, t in zip(group, nexts, strict=True) if t == best]
    return tokens, confidence, deepest


def test_a_stored_answer_continues_a_repeated_context():
    index = SuffixIndex(10**6)
    answer = list(range(100, 160))
    index.add("", [1, 2, 3, 4, 5] + answer)
    proposal = index.propose("", ctx([9, 9, 1, 2, 3, 4, 5]), 16)
    assert proposal.tokens == answer[:5]  # a 5-token match drafts 5 (SPEC_FACTOR)
    assert proposal.match_length == 5 and proposal.occurrences == 1
    # one occurrence: 1 / (1 + 1/m) at each step, m the match so far
    expected, chance = [], 1.0
    for j in range(5):
        chance *= 1 / (1 + SMOOTHING / (5 + j))
        expected.append(chance)
    assert proposal.confidence == pytest.approx(expected)
    assert proposal.expected_accepted() == pytest.approx(sum(expected))
    assert proposal.expected_accepted(2) == pytest.approx(sum(expected[:2]))
    # further in: the match is MAX_MATCH deep, so the whole k is drafted
    context = [1, 2, 3, 4, 5] + answer[:40]
    assert index.propose("", ctx(context), 16).tokens == answer[40:56]


def test_the_majority_continuation_wins_with_its_share_as_confidence():
    index = SuffixIndex(10**6)
    for last in (7, 8, 7):
        index.add("", [1, 2, 3, 4, last, 9])
    proposal = index.propose("", ctx([5, 1, 2, 3, 4]), 4)
    assert proposal.tokens[0] == 7 and proposal.occurrences == 3
    assert proposal.confidence[0] == pytest.approx(2 / (3 + SMOOTHING / 4))
    # the same in the context itself: its own occurrences count with the stored ones
    own = index.propose("", ctx([1, 2, 3, 4, 8, 0, 1, 2, 3, 4]), 4)
    assert own.occurrences == 4 and own.tokens[0] in (7, 8)


def test_the_deepest_match_wins_over_a_more_frequent_shallow_one():
    index = SuffixIndex(10**6)
    for _ in range(5):
        index.add("", [20, 21, 22, 23, 30, 31])
    index.add("", [10, 11, 20, 21, 22, 23, 40, 41])
    proposal = index.propose("", ctx([10, 11, 20, 21, 22, 23]), 3)
    assert proposal.tokens[:2] == [40, 41] and proposal.match_length == 6


def test_a_repeating_context_drafts_on_into_its_own_draft():
    period = [5, 6, 7, 8]
    proposal = SuffixIndex(10**6).propose("", ctx(period * 4), 10)
    assert proposal.tokens == (period * 3)[:10]


def test_nothing_matches_nothing_is_proposed():
    index = SuffixIndex(10**6)
    index.add("", [1, 2, 3, 4, 5])
    assert index.propose("", ctx([7, 8, 9, 1, 2]), 8).tokens == []  # 2 tokens: below ANCHOR
    assert index.propose("", ctx([1, 2, 3]), 8).tokens == []  # too short to have a past
    assert index.propose("", ctx([0, 1, 2, 3]), 0).tokens == []


def test_agrees_with_the_reference_on_random_texts():
    rng = random.Random(0)
    for trial in range(400):
        alphabet = rng.choice([2, 3, 4, 6])
        index, docs = SuffixIndex(10**7), []
        for _ in range(rng.randrange(0, 4)):
            doc = [rng.randrange(alphabet) for _ in range(rng.randrange(4, 20))]
            index.add("t", doc)
            docs.append(doc)
        context = [rng.randrange(alphabet) for _ in range(rng.randrange(4, 25))]
        k = rng.randrange(0, 12)
        got = index.propose("t", ctx(context), k)
        tokens, confidence, depth = reference(docs, context, k)
        assert got.tokens == tokens, (trial, docs, context, k)
        assert got.confidence == pytest.approx(confidence)
        if tokens:
            assert got.match_length == depth
        assert index.propose("t", ctx(context), k, stored=False).tokens == \
            reference([], context, k)[0]


def test_one_tenants_text_never_drafts_for_another():
    index = SuffixIndex(10**6)
    secret = list(range(200, 240))
    index.add("a", [1, 2, 3, 4] + secret)
    assert index.propose("a", ctx([1, 2, 3, 4]), 8).tokens == secret[:4]
    assert index.propose("b", ctx([1, 2, 3, 4]), 8).tokens == []
    assert index.propose("", ctx([1, 2, 3, 4]), 8).tokens == []


def test_the_oldest_texts_leave_to_keep_the_bound():
    index = SuffixIndex(40_000)
    first = [1, 2, 3, 4, 5, 6, 7, 8]
    index.add("", first)
    assert index.propose("", ctx([1, 2, 3, 4]), 4).tokens == [5, 6, 7, 8]
    rng = random.Random(1)
    for _ in range(200):
        index.add("", [rng.randrange(10_000, 20_000) for _ in range(50)])
        assert index.nbytes <= index.max_bytes
    assert index.propose("", ctx([1, 2, 3, 4]), 4).tokens == []
    assert 0 < len(index) < 200
    # a text larger than the bound keeps its end
    big = list(range(30_000, 40_000))
    index.add("", big)
    assert len(index) == 1 and index.tokens < len(big)
    assert index.propose("", ctx(big[-50:-20]), 4).tokens == big[-20:-16]
    index.clear()
    assert (len(index), index.nbytes, index.tokens) == (0, 0, 0)


@pytest.mark.parametrize("max_bytes", [2_000_000, 5_000_000])
def test_memory_at_the_bound_is_within_it(max_bytes):
    """Filled three times over its bound with random answers (every anchor new: the most
    entries per token; the oldest leaving), the index holds no more memory than its bound,
    and at least half of it (its dicts' tables grow in powers of two: 0.6-0.9 of the bound
    from 1 to 20 MB)."""
    rng = random.Random(2)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = SuffixIndex(max_bytes)
        for _ in range(3 * max_bytes // (300 * 300)):
            index.add("", [rng.randrange(150_000) for _ in range(rng.randrange(20, 600))])
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert index.nbytes <= max_bytes
    assert 0.5 * max_bytes <= held <= max_bytes, held
