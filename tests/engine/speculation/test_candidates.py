"""What each drafter offers a round, and hybrid's choice among the offers: exact values."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from server.engine.params import GenerationParams, SpeculationParams
from server.engine.scheduling.sequence import Sequence
from server.engine.speculation.candidates import (
    DraftCandidate,
    best_candidate,
    counted_candidate,
    rate_candidate,
)
from server.engine.speculation.cost_model import hopeful_rate
from server.engine.speculation.suffix import (
    CALIBRATION_WEIGHT,
    SuffixCalibration,
    SuffixProposal,
)


def test_a_rate_gives_each_position_its_power():
    rate = hopeful_rate(6, 8, 0.5)
    model = rate_candidate("model", [], 3, 6, 8, 0.5)
    assert model.tokens == () and model.forwards == 3
    assert model.confidence == pytest.approx((rate, rate ** 2, rate ** 3))
    lookup = rate_candidate("prompt_lookup", [7, 8, 9, 10], 2, 6, 8, 0.5)
    assert lookup.tokens == (7, 8) and lookup.forwards == 0
    assert lookup.expected_accepted() == pytest.approx(rate + rate ** 2)
    assert lookup.expected_accepted(1) == pytest.approx(rate)


def test_counts_are_scaled_by_the_rows_calibration():
    candidate = counted_candidate([1, 2, 3], [0.9, 0.6, 0.3], 2, calibration=0.5)
    assert candidate.tokens == (1, 2) and candidate.confidence == pytest.approx((0.45, 0.3))
    assert counted_candidate([1], [0.9], 4, calibration=2.0).confidence == (1.0,)
    shared = SuffixCalibration(decay=0.5)
    row = SuffixCalibration(shared)
    assert row.factor() == shared.factor() == 1.0
    row.record(expected=6.0, accepted=2)
    w = CALIBRATION_WEIGHT
    assert shared.factor() == pytest.approx((2 + w) / (6 + w))
    assert row.factor() == pytest.approx((2 + w * shared.factor()) / (6 + w))
    assert row.factor(shared=False) == pytest.approx((2 + w) / (6 + w))
    # another row's rounds move the shared factor (decayed: the older count half) ...
    SuffixCalibration(shared).record(expected=4.0, accepted=4)
    assert shared.factor() == pytest.approx((2 * 0.5 + 4 + w) / (6 * 0.5 + 4 + w))
    # ... and so this row's prior, not its own counts
    assert row.factor() == pytest.approx((2 + w * shared.factor()) / (6 + w))


def offer(source, expected_each, n, forwards=0):
    tokens = () if source == "model" else tuple(range(n))
    return DraftCandidate(source, tokens, (expected_each,) * n, forwards)


def test_the_most_expected_tokens_win_and_a_host_drafter_wins_a_tie():
    suffix, lookup, model = offer("suffix", 0.5, 4), offer("prompt_lookup", 0.4, 4), \
        offer("model", 0.6, 4, forwards=4)
    assert best_candidate([lookup, suffix, model]) is model  # 2.4 > 2.0 > 1.6
    tie = offer("model", 0.5, 4, forwards=4)
    assert best_candidate([tie, lookup, suffix]) is suffix  # 2.0 each: the host drafter
    assert best_candidate([tie, offer("prompt_lookup", 0.5, 4)]).source == "prompt_lookup"


def test_draft_forwards_cost_round_time():
    """(1 + expected) per round time: the model's 4 forwards at 0.25 of a target forward
    double its round, so 3.4 expected tokens (4.4 per 2) lose to lookup's 1.5 (2.5 per 1)."""
    model, lookup = offer("model", 0.85, 4, forwards=4), offer("prompt_lookup", 0.75, 2)
    assert best_candidate([model, lookup]) is model
    assert best_candidate([model, lookup], forward_cost=0.25) is lookup
    assert best_candidate([model, lookup], forward_cost=0.05) is model  # 4.4/1.2 > 2.5


def test_an_empty_proposal_is_no_candidate():
    empty = DraftCandidate("suffix", (), ())
    model = offer("model", 0.1, 1, forwards=1)
    assert best_candidate([empty, model]) is model
    assert best_candidate([empty, DraftCandidate("prompt_lookup", (), ())]) is None


class StubIndex:
    """A suffix index that proposes what it is told."""

    def __init__(self, proposal: SuffixProposal):
        self.proposal = proposal
        self.asked = []
        self.calibration = SuffixCalibration()

    def propose(self, tenant, context, num_tokens, *, stored=True):
        self.asked.append((tenant, list(context), num_tokens))
        return self.proposal


def planned(proposal: SuffixProposal, prompt, *, tenant="t", source="hybrid"):
    tokenizer = SimpleNamespace(eos_token_ids={0}, detokenizer=None)  # plan_round reads neither
    spec = SpeculationParams(num_draft_tokens=4, source=source, lookup_draft_tokens=16)
    index = StubIndex(proposal)
    seq = Sequence(GenerationParams(prompt_tokens=tuple(prompt), max_tokens=50,
                                    speculation=spec, tenant=tenant),
                   tokenizer=tokenizer, vocab_size=64, sink=lambda event: None,
                   draft_name="d", suffix=index)
    seq.plan_round()
    return seq, index


def test_a_hybrid_row_weighs_suffix_lookup_and_the_model():
    """With no rounds behind it, lookup and the model are judged at the prior's hopeful rate
    (0.854); suffix drafting by its counts."""
    prior = hopeful_rate(0, 0, 0.5)
    prompt = [5, 6, 7, 8, 9, 3, 5, 6]  # "5 6" occurred: lookup proposes 7 8 9 3 5 6
    sure = SuffixProposal([40, 41, 42, 43, 44], [0.99, 0.98, 0.97, 0.96, 0.95], 12, 1)
    seq, index = planned(sure, prompt)
    assert index.asked == [("t", prompt, 16)]
    assert seq.round_drafter == "suffix" and seq.looked_up == [40, 41, 42, 43, 44]
    assert seq.candidate.expected_accepted() == pytest.approx(sum(sure.confidence))
    # lookup's 6 tokens at the prior: sum(0.854^j, j=1..6) = 3.6 > the model's 4 (2.7)
    unsure = SuffixProposal([40, 41], [0.3, 0.1], 3, 2)
    seq, _ = planned(unsure, prompt)
    assert seq.round_drafter == "prompt_lookup" and seq.looked_up == [7, 8, 9, 3, 5, 6]
    assert seq.candidate.expected_accepted() == pytest.approx(
        sum(prior ** j for j in range(1, 7)))
    seq, _ = planned(unsure, [5, 6, 7, 8, 9, 3, 1, 2])  # nothing to look up: the model
    assert seq.round_drafter == "model" and seq.looked_up == []
    assert seq.candidate.forwards == 4


def test_a_suffix_row_drafts_its_proposal_or_nothing():
    seq, index = planned(SuffixProposal([9, 9], [0.5, 0.2], 3, 1), [1, 2, 3, 4], source="suffix")
    assert seq.round_drafter == "suffix" and seq.looked_up == [9, 9]
    assert index.asked[0][0] == "t"
    seq, _ = planned(SuffixProposal(), [1, 2, 3, 4], source="suffix")
    assert seq.round_drafter == "suffix" and seq.looked_up == [] and seq.candidate.tokens == ()


def test_a_hybrid_row_that_loses_its_draft_model_goes_on_with_the_host_drafters():
    seq, _ = planned(SuffixProposal(), [1, 2, 3, 4])
    assert seq.sources == ("prompt_lookup", "suffix", "model") and seq.uses_draft_model
    seq.lose_draft_model()
    assert seq.sources == ("prompt_lookup", "suffix") and not seq.uses_draft_model
    assert seq.drafter == "hybrid" and seq.draft_name == "prompt_lookup+suffix"
    seq.plan_round()
    assert seq.round_drafter != "model"
