"""The cost model: acceptance estimates and the per-row draft lengths they choose from forward
times, checked against values computed by hand."""

from __future__ import annotations

import pytest

from server.engine.speculation import cost_model
from server.engine.speculation.cost_model import (
    DrafterRates,
    DraftingShare,
    RoundCalibration,
    RowOption,
    StepCosts,
    acceptance_rate,
    choose_draft_lengths,
    decision_rate,
    drafting_saving,
    expected_accepted,
    hopeful_rate,
    prefill_repaid,
)
from server.engine.speculation.forward_times import ForwardTimes


def table(rows, tokens, seconds) -> ForwardTimes:
    return ForwardTimes(tuple(rows), tuple(tokens), tuple(map(tuple, seconds)))


# Rows 1 and 8, 1 to 3 tokens each: at 8 rows a second token costs 20% more, a third 100% more.
TARGET = table((1, 8), (1, 2, 3), [[0.05, 0.05, 0.06], [0.10, 0.12, 0.24]])
DRAFT = table((1, 8), (1, 2), [[0.001, 0.001], [0.002, 0.003]])


def test_expected_accepted_tokens_and_the_acceptance_estimate():
    assert expected_accepted(0.5, 0) == 0
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert acceptance_rate(3, 4, prior=0.5, weight=2) == pytest.approx(4 / 6)
    assert acceptance_rate(0, 0, prior=0.8) == pytest.approx(0.8)


def test_rows_with_few_rounds_get_the_benefit_of_the_doubt():
    assert hopeful_rate(0, 0) == pytest.approx(0.5 + (0.25 / 2) ** 0.5)  # 0.8536
    assert hopeful_rate(48, 98) == pytest.approx(0.49 + (0.49 * 0.51 / 100) ** 0.5)  # 0.54
    assert hopeful_rate(1000, 1000) == 0.99


def test_only_a_row_alone_decides_on_its_hopeful_rate():
    """Alone, trying costs only the row itself; in a batch every row pays for the widest draft,
    so the choice uses the plain estimate."""
    assert decision_rate(3, 4, 0.5, batch_rows=1) == hopeful_rate(3, 4, 0.5)
    assert decision_rate(3, 4, 0.5, batch_rows=2) == pytest.approx(4 / 6)
    options = [RowOption(i, 1, decision_rate(0, 0, 0.5, 8), True) for i in range(8)]
    hoping = [RowOption(i, 1, decision_rate(0, 0, 0.5, 1), True) for i in range(8)]
    # a second token costs 60% more at 8 rows: 8 rows at 0.5 make (8 + 4) / (0.16 + 0.002)
    # = 74.1 tok/s drafting, less than 8 / 0.10 = 80 plain; at 0.854 they would make 91.5,
    # more than plain's 80 and its BATCH_DRAFT_MARGIN (88)
    costs = StepCosts(table((1, 8), (1, 2), [[0.05, 0.05], [0.10, 0.16]]), DRAFT)
    assert choose_draft_lengths(options, 8, 8, costs) == {}
    assert set(choose_draft_lengths(hoping, 8, 8, costs)) == set(range(8))


def test_drafter_rates_decay_and_give_the_prior_of_new_rows():
    rates = DrafterRates()
    assert rates.prior("model") == pytest.approx(0.5)  # nothing seen: PRIOR_ACCEPTANCE
    rates.record("model", 3, 4)
    rates.record("model", 1, 2)
    accepted, trials = 3 * 0.99 + 1, 4 * 0.99 + 2
    assert rates.prior("model") == pytest.approx((accepted + 1) / (trials + 2))
    assert rates.prior("prompt_lookup") == pytest.approx(0.5)


def test_eight_lookup_rows_draft_one_token_when_it_pays_and_not_two():
    """At 8 rows: plain 8 / 0.10 = 80 tok/s; k = 1 at a = 0.5, (8 + 8 x 0.5) / 0.12 = 100;
    k = 2, (8 + 8 x 0.75) / 0.24 = 58.3. So k = 1."""
    options = [RowOption(i, 4, 0.5, by_model=False) for i in range(8)]
    assert choose_draft_lengths(options, 8, 0, StepCosts(TARGET)) == {i: 1 for i in range(8)}


def test_in_a_batch_drafting_must_beat_plain_decoding_by_the_margin():
    """8 lookup rows, plain 80 tok/s: at a = 0.26, k = 1 makes (8 + 2.08) / 0.12 = 84 tok/s,
    5% ahead, under the 10% margin (88): plain. At a = 0.4, 93.3: k = 1."""
    assert cost_model.BATCH_DRAFT_MARGIN == 0.10
    few = [RowOption(i, 4, 0.26, by_model=False) for i in range(8)]
    assert choose_draft_lengths(few, 8, 0, StepCosts(TARGET)) == {}
    more = [RowOption(i, 4, 0.4, by_model=False) for i in range(8)]
    assert choose_draft_lengths(more, 8, 0, StepCosts(TARGET)) == {i: 1 for i in range(8)}


def test_a_small_batch_drafts_without_the_margin():
    """At 2 rows plain makes 2 / 0.057143 = 35.0 tok/s; k = 1 at a = 0.1, 2.2 / 0.06 = 36.7
    (4.8% ahead, under the margin it would need from 8 rows on): k = 1. At a = 0.04, 34.7."""
    assert cost_model.MARGIN_FROM_ROWS == 8
    options = [RowOption(i, 4, 0.1, by_model=False) for i in range(2)]
    assert choose_draft_lengths(options, 2, 0, StepCosts(TARGET)) == {0: 1, 1: 1}
    options = [RowOption(i, 4, 0.04, by_model=False) for i in range(2)]
    assert choose_draft_lengths(options, 2, 0, StepCosts(TARGET)) == {}


def test_low_acceptance_does_not_pay_for_the_extra_positions():
    """(8 + 8 x 0.19) / 0.12 = 79.3 tok/s < plain 80: plain decoding."""
    options = [RowOption(i, 4, 0.19, by_model=False) for i in range(8)]
    assert choose_draft_lengths(options, 8, 0, StepCosts(TARGET)) == {}


def pays(costs: StepCosts, **row) -> bool:
    """Whether 8 rows drafting up to k = 4 at a = 0.5 repay a new row's draft prefill."""
    return prefill_repaid(drafting_saving(8, 4, 0.5, costs), costs, **row)


def test_the_draft_models_forward_is_charged_per_drafted_token():
    """Model rows at a = 0.5: k = 1 costs 0.12 + 1 x 0.002 (8 draft rows) -> 12 / 0.122 =
    98.4 tok/s > 80; with a draft forward of 0.05 s: 12 / 0.17 = 70.6 < 80, so plain."""
    options = [RowOption(i, 4, 0.5, by_model=True) for i in range(8)]
    assert choose_draft_lengths(options, 8, 8, StepCosts(TARGET, DRAFT)) == {i: 1 for i in range(8)}
    slow = table((1, 8), (1, 2), [[0.05, 0.05], [0.05, 0.05]])
    assert choose_draft_lengths(options, 8, 8, StepCosts(TARGET, slow)) == {}
    assert pays(StepCosts(TARGET, DRAFT))
    assert not pays(StepCosts(TARGET, slow))


def test_a_new_rows_draft_prefill_must_be_repaid_over_its_tokens():
    """8 rows at a = 0.5 draft k = 1: 98.36 tok/s against 80 plain, which saves
    1/80 - 0.122/12 = 0.0125 - 0.0101667 = 0.0023333 s per token: 0.2333 s over 100 tokens.
    The draft's prefill costs 0.003 / (8 x 2) = 0.0001875 s per token (its largest forward):
    1,000 prompt tokens (0.1875 s) are repaid, 1,300 (0.24375 s) are not."""
    costs = StepCosts(TARGET, DRAFT)
    assert DRAFT.per_token() == pytest.approx(0.0001875)
    assert pays(costs, prompt_tokens=1000, max_tokens=100)
    assert not pays(costs, prompt_tokens=1300, max_tokens=100)
    assert pays(costs, prompt_tokens=1300, max_tokens=200)


def test_only_the_rounds_that_draft_repay_a_draft_prefill():
    """The 1,000-token prefill above (0.1875 s) is repaid when every round drafts (0.2333 s
    saved over 100 tokens), not when half of them do (0.1167 s)."""
    costs = StepCosts(TARGET, DRAFT)
    assert pays(costs, prompt_tokens=1000, max_tokens=100, share=1.0)
    assert not pays(costs, prompt_tokens=1000, max_tokens=100, share=0.5)


def test_the_drafting_share_is_learned_per_batch_size_from_a_prior_of_drafting():
    share = DraftingShare()
    assert share.share(8) == 1.0  # nothing seen: rows are taken to draft
    share.record(8, False)
    share.record(12, True)  # the same bucket (8 to 15)
    d = DraftingShare.DECAY
    assert share.share(15) == pytest.approx((1 + 2) / (d + 1 + 2))
    assert share.share(16) == 1.0 and share.share(7) == 1.0  # other buckets
    for _ in range(1000):
        share.record(9, False)
    assert share.share(9) == pytest.approx(2 / (1 / (1 - d) + 2), rel=1e-3)  # the floor


def decayed(ratio: float, rounds: int, decay: float = RoundCalibration.DECAY) -> list[float]:
    """[sum of ratios, rounds] after `rounds` rounds at `ratio`, each decaying the ones before."""
    n = sum(decay ** i for i in range(rounds))
    return [ratio * n, n]


def test_measured_rounds_calibrate_the_choice():
    """The k = 1 choice above (12 / 0.12 = 100 tok/s against 8 / 0.10 = 80) with drafting rounds
    measured at 1.1x their table time: the factor is their decayed mean shrunk towards 1 by two
    pseudo-rounds, (4.367 + 2) / (3.970 + 2) = 1.0665 -> 93.8 tok/s, still drafting (plain's 80
    and its 10% margin make 88). Four more at 1.5x (12 rows: the same bucket as 8): (10.236 + 2)
    / (7.861 + 2) = 1.2408 -> 80.6 < 88, plain. Plain rounds, not measured, keep the table's
    time (1.0)."""
    options = [RowOption(i, 4, 0.5, by_model=False) for i in range(8)]
    costs = StepCosts(TARGET)
    for _ in range(4):
        costs.calibration.record(8, True, 0.12 * 1.1, 0.12)
    ratios, n = decayed(1.1, 4)
    assert costs.calibration.factor(8, True) == pytest.approx((ratios + 2) / (n + 2))
    assert costs.calibration.factor(8, False) == 1.0 and costs.calibration.factor(4, True) == 1.0
    assert choose_draft_lengths(options, 8, 0, costs) == {i: 1 for i in range(8)}
    for _ in range(4):
        costs.calibration.record(12, True, 0.12 * 1.5, 0.12)
    assert costs.calibration.factor(8, True) == pytest.approx(1.2408, abs=1e-4)
    assert choose_draft_lengths(options, 8, 0, costs) == {}


@pytest.mark.parametrize("plain", [1.0, 1.5])
def test_a_kind_no_longer_measured_drifts_back_to_plain_rounds_factor(plain):
    """Every round decays both kinds' sums in its bucket: 2,000 plain rounds measured at
    `plain` x their table after 50 drafting ones at 2x leave the drafting factor near plain
    rounds' factor again, the prior of its two pseudo-rounds (plain rounds' own prior is 1)."""
    calibration = RoundCalibration()
    for _ in range(50):
        calibration.record(16, True, 2.0, 1.0)
    ratios, n = decayed(2.0, 50)
    assert calibration.factor(16, True) == pytest.approx((ratios + 2) / (n + 2))
    for _ in range(2000):
        calibration.record(16, False, plain, 1.0)
    plain_ratios, plain_n = decayed(plain, 2000)
    plain_factor = (plain_ratios + 2) / (plain_n + 2)
    assert calibration.factor(16, False) == pytest.approx(plain_factor)
    kept = RoundCalibration.DECAY ** 2000
    assert calibration.factor(16, True) == pytest.approx(
        (ratios * kept + 2 * plain_factor) / (n * kept + 2))
    assert abs(calibration.factor(16, True) - plain) < 0.01


def test_drafting_rounds_never_measured_cost_what_plain_ones_do_against_the_table():
    """Plain rounds at 1.5x their table (a busy machine): the k = 1 round of 8 lookup rows,
    100 tok/s by the tables against 80, is judged at the same 1.5x (66.7 against 53.3), not at
    the table's time beside plain rounds' 1.5x (100 against 53.3)."""
    costs = StepCosts(TARGET)
    for _ in range(100):
        costs.calibration.record(8, False, 0.10 * 1.5, 0.10)
    factor = costs.calibration.factor(8, False)
    assert costs.calibration.factor(8, True) == pytest.approx(factor)
    assert costs.round_seconds(8, 1, 0, 0) == pytest.approx(0.12 * factor)


def test_one_row_drafts_its_whole_cap_when_positions_are_nearly_free():
    """Alone: k = 3 feeds 4 tokens, 0.07 s (extrapolated) + 3 x 0.001 for the draft, and gives
    1 + 0.9 + 0.81 + 0.729 = 3.439 tokens: 47.1 tok/s against 20 plain, 37.3 at k = 1
    (1.9 / 0.051) and 43.7 at k = 2 (2.71 / 0.062)."""
    options = [RowOption(7, 3, 0.9, by_model=True)]
    assert choose_draft_lengths(options, 1, 1, StepCosts(TARGET, DRAFT)) == {7: 3}


def test_a_forced_row_drafts_its_cap_and_the_others_ride_along():
    """A seeded sampled row drafts its own k = 2 whatever the cost: the round is 2 wide anyway,
    so the lookup rows' second positions are free and they draft 2 as well."""
    options = [RowOption(0, 2, 0.1, by_model=False, forced=True),
               *[RowOption(i, 4, 0.2, by_model=False) for i in range(1, 8)]]
    assert choose_draft_lengths(options, 8, 0, StepCosts(TARGET)) == {i: 2 for i in range(8)}


def test_drafting_rounds_faster_than_the_table_make_plain_rounds_faster_too():
    """Drafting rounds at a quarter of the table's time (a table measured while the machine
    was busy) and no plain round measured: plain rounds are judged at drafting rounds' mean
    (shrunk towards 1 by two pseudo-rounds), not the table's. Drafting rounds slower than the
    table leave plain rounds at 1 (drafting's own costs are not plain rounds')."""
    calibration = RoundCalibration()
    for _ in range(50):
        calibration.record(16, True, 0.25, 1.0)
    ratios, n = decayed(0.25, 50)
    plain = (ratios + 2) / (n + 2)  # drafting rounds' mean, shrunk towards the table
    assert calibration.factor(16, False) == pytest.approx(plain) and plain < 0.3
    assert calibration.factor(16, True) == pytest.approx((ratios + 2 * plain) / (n + 2))
    slower = RoundCalibration()
    for _ in range(50):
        slower.record(16, True, 1.5, 1.0)
    assert slower.factor(16, False) == 1.0
