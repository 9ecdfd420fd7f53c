"""Prompt lookup: the n-gram search against a brute-force reference, and its proposals."""

from __future__ import annotations

import random

import pytest

from server.engine.speculation.drafting import lookup_proposal
from server.engine.speculation.prompt_lookup import (
    DEFAULT_MAX_NGRAM,
    DEFAULT_MIN_NGRAM,
    find_continuation,
    find_match,
)


def brute_force(tokens, num_tokens, max_ngram, min_ngram):
    """The definition, spelled out: longest n first, then the latest earlier start; the
    continuation and n."""
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + num_tokens], n
    return [], 0


def test_finds_the_continuation_of_the_last_trigram():
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert find_continuation(tokens, 3) == [4, 5, 9]
    assert find_continuation(tokens, 10) == [4, 5, 9, 1, 2, 3]


def test_prefers_the_longest_ngram_over_a_more_recent_shorter_one():
    tokens = [7, 8, 9, 1, 5, 9, 2, 7, 8, 9]
    # "9" alone last occurred at index 5 (followed by 2); "7 8 9" at index 0 (followed by 1).
    assert find_continuation(tokens, 3) == [1, 5, 9]
    assert find_continuation(tokens, 3, max_ngram=1) == [2, 7, 8]


def test_takes_the_most_recent_earlier_occurrence():
    assert find_continuation([1, 2, 5, 1, 2, 6, 1, 2], 2, max_ngram=2) == [6, 1]


def test_continuation_may_run_into_the_suffix():
    assert find_continuation([4, 1, 2, 1, 2], 5, max_ngram=2) == [1, 2]


def test_no_match_proposes_nothing():
    assert find_continuation([1, 2, 3, 4, 5], 4) == []
    assert find_continuation([1, 2, 3, 1], 4, min_ngram=2) == []
    assert find_continuation([7], 4) == []
    assert find_continuation([1, 2, 1], 0) == []


def test_matches_that_straddle_two_tokens_are_not_matches():
    # Little-endian words: 0x100, 0 -> bytes 00 01 00 00 00 00 00 00, which contain the bytes of
    # token 1 (01 00 00 00) at offset 1.
    assert find_continuation([0x100, 0, 5, 1], 3) == []
    assert find_continuation([1, 9, 0x100, 0, 5, 1], 3) == [9, 0x100, 0]


def test_agrees_with_brute_force_on_random_sequences():
    rng = random.Random(0)
    for _ in range(600):
        alphabet = rng.choice([2, 3, 5, 40, 152_000])
        tokens = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 40))]
        min_ngram = rng.randint(1, 3)
        max_ngram = rng.randint(min_ngram, 5)
        k = rng.randint(0, 6)
        expected, n = brute_force(tokens, k, max_ngram, min_ngram)
        assert find_continuation(tokens, k, max_ngram=max_ngram, min_ngram=min_ngram) == expected
        if k:  # and the n-gram it continues
            assert find_match(tokens, k, max_ngram=max_ngram, min_ngram=min_ngram) == (
                expected, n)


def test_long_context_lookup_agrees_with_brute_force():
    """200k tokens: the trigram far back wins over a later, shorter match."""
    rng = random.Random(1)
    tokens = [rng.randrange(150_000) for _ in range(200_000)] + [11, 12, 13]
    tokens[1000:1006] = [11, 12, 13, 21, 22, 23]
    tokens[150_000:150_003] = [12, 13, 31]
    assert find_match(tokens, 3) == ([21, 22, 23], 3) == brute_force(
        tokens, 3, DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM)
    later = [31, tokens[150_003], tokens[150_004]]
    assert find_match(tokens, 3, max_ngram=2) == (later, 2) == brute_force(tokens, 3, 2, 1)


def test_rejects_bad_ngram_bounds():
    with pytest.raises(ValueError):
        find_continuation([1, 2, 3], 2, max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError):
        find_continuation([1, 2, 3], 2, max_ngram=3, min_ngram=0)


def test_proposals_look_up_prompt_plus_output():
    prompt = [5, 6, 7, 8, 9, 3, 5, 6]
    assert lookup_proposal(prompt, 3) == [7, 8, 9]
    # the output so far ends "... 5 6 7 12": no n-gram ending in 12 occurred before
    assert lookup_proposal(prompt + [7, 12], 3) == []
    # "... 7 12 3": "12 3" is new, "3" was followed by 5 6 7
    assert lookup_proposal(prompt + [7, 12, 3], 3) == [5, 6, 7]
    assert lookup_proposal(prompt + [7, 12, 3], 0) == []
    # from a 2-gram only: "12 3" never occurred, and the 1-gram "3" is not asked
    assert lookup_proposal(prompt + [7, 12, 3], 3, min_ngram=2) == []


def test_hybrid_drafts_by_lookup_only_from_its_minimum_match():
    """A hybrid row drafts by lookup where its last `hybrid_min_match` tokens occurred before,
    with the draft model elsewhere; lookup alone takes any match."""
    from types import SimpleNamespace

    from server.engine.params import HYBRID_MIN_MATCH, GenerationParams, SpeculationParams
    from server.engine.scheduling.sequence import Sequence

    tokenizer = SimpleNamespace(eos_token_ids={0}, detokenizer=None)  # plan_round reads neither

    def planned(source, min_match, prompt):
        spec = SpeculationParams(num_draft_tokens=3, source=source, hybrid_min_match=min_match)
        seq = Sequence(GenerationParams(prompt_tokens=tuple(prompt), max_tokens=8,
                                        speculation=spec),
                       tokenizer=tokenizer, vocab_size=32, sink=lambda event: None, draft_name="d")
        seq.plan_round()
        return seq.round_drafter, seq.looked_up

    one = [5, 6, 7, 8, 9, 3, 5]  # only the 1-gram "5" occurred before (then 6 7 8)
    two = [5, 6, 7, 8, 9, 3, 5, 6]  # the 2-gram "5 6" occurred before (then 7 8 9)
    assert planned("hybrid", 1, one) == ("prompt_lookup", [6, 7, 8])
    assert planned("hybrid", 2, one) == ("model", [])
    assert planned("hybrid", 2, two) == ("prompt_lookup", [7, 8, 9])
    assert planned("hybrid", 3, two) == ("model", [])
    assert planned("prompt_lookup", 3, one) == ("prompt_lookup", [6, 7, 8])
    assert SpeculationParams().hybrid_min_match == HYBRID_MIN_MATCH == 2
