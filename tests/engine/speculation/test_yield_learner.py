"""The draft length learned from what each round shape measurably yields (`YieldLearner`):
it settles on the best fixed length even when the tables say otherwise, stops drafting when
drafting does not pay and tries again now and then, keeps a fixed k, and remembers across
restarts."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from support.engine import alone, params, tokens_of

from server.engine.speculation.cost_model import RowOption
from server.engine.speculation.policy import SpeculationPolicy
from server.engine.speculation.yield_learner import EXPLORE_EVERY, YieldLearner


def arms(*tps: float) -> dict:
    """Tokens per second of k = 0, 1, 2, ... drafted by the draft model, by round shape."""
    return {(k, k, int(k > 0)): v for k, v in enumerate(tps)}


def simulate(learner: YieldLearner, true_tps: dict, prior_tps: dict, rounds: int = 3000,
             noise: float = 0.15, seed: int = 0) -> dict:
    """Rounds whose time is what `true_tps` says (with multiplicative noise, as on a busy
    machine); the tables' estimates are `prior_tps`. How often each arm was taken, in the
    last half."""
    rng = random.Random(seed)
    taken = {arm: 0 for arm in true_tps}
    for i in range(rounds):
        arm = learner.choose(1, "model", dict(prior_tps))
        tokens = 1 + arm[0] * 0.7  # what a round of this shape commits
        seconds = tokens / true_tps[arm] * (1 + rng.uniform(-noise, noise))
        learner.round_done(round(tokens), seconds)
        if i >= rounds // 2:
            taken[arm] += 1
    return taken


def mean_yield(taken: dict, true_tps: dict) -> float:
    return sum(true_tps[a] * n for a, n in taken.items()) / sum(taken.values())


def test_it_settles_within_5_percent_of_the_best_fixed_length_the_tables_misjudge():
    """The tables put k = 1 first (what the issue measured: they chose 1-2 where 4 made 1.3x
    plain decoding's tokens per second); the rounds say k = 4."""
    true_tps = arms(30.0, 32.0, 35.0, 38.0, 39.0)
    prior = arms(30.0, 34.0, 33.0, 31.0, 29.0)
    taken = simulate(YieldLearner(), true_tps, prior)
    assert mean_yield(taken, true_tps) >= 0.95 * max(true_tps.values())
    assert max(taken, key=taken.get) in ((3, 3, 1), (4, 4, 1))


def test_when_drafting_does_not_pay_it_stops_and_tries_again_now_and_then():
    true_tps = arms(40.0, 30.0, 27.0, 25.0, 22.0)
    prior = arms(30.0, 38.0, 40.0, 41.0, 42.0)
    taken = simulate(YieldLearner(), true_tps, prior)
    assert mean_yield(taken, true_tps) >= 0.95 * 40.0
    drafting = sum(n for arm, n in taken.items() if arm != (0, 0, 0))
    assert 0 < drafting <= 2 * sum(taken.values()) // EXPLORE_EVERY


def test_it_follows_a_change_of_what_pays():
    """A machine that got busy for the draft's forwards: the best length moves, and so does
    the choice."""
    learner = YieldLearner()
    before = arms(30.0, 33.0, 36.0, 38.0, 40.0)
    after = arms(30.0, 34.0, 31.0, 27.0, 24.0)
    simulate(learner, before, before)
    taken = simulate(learner, after, before, seed=1)
    assert mean_yield(taken, after) >= 0.95 * 34.0


def test_a_row_that_fixes_its_k_gets_it_whenever_the_round_drafts():
    learner = YieldLearner()
    for _ in range(50):  # a width of 1 measured best
        for k in range(5):
            learner.record(2, "model", (k, k, 1), 3 if k == 1 else 2, 0.05)
        learner.record(2, "model", (0, 0, 0), 2, 0.05)
    from server.engine.speculation.cost_model import StepCosts
    from server.engine.speculation.forward_times import ForwardTimes

    table = ForwardTimes((1, 2, 4), (1, 2, 5), ((0.010, 0.011, 0.014), (0.011, 0.012, 0.015),
                                                (0.012, 0.013, 0.016)))
    options = [RowOption(1, 4, 0.8, True, fixed=True), RowOption(2, 4, 0.8, True)]
    ks = SpeculationPolicy.choose(options, 2, 2, StepCosts(table, table), learner)
    assert ks == {1: 4, 2: 1}


def test_a_round_a_fixed_row_drafts_in_teaches_no_arm():
    """One row with its own k = 4: the round's arm for the rows left to the server is (0, 0,
    1), and what its k = 4 yields must not become that arm's (a free row then took it, and did
    not draft)."""
    from server.engine.speculation.cost_model import StepCosts
    from server.engine.speculation.forward_times import ForwardTimes

    table = ForwardTimes((1, 2, 4), (1, 2, 5), ((0.010, 0.011, 0.014), (0.011, 0.012, 0.015),
                                                (0.012, 0.013, 0.016)))
    learner = YieldLearner()
    for _ in range(40):
        ks = SpeculationPolicy.choose([RowOption(1, 4, 0.8, True, fixed=True)], 1, 1,
                                      StepCosts(table, table), learner)
        assert ks in ({}, {1: 4})  # it drafts its own k, or the round does not draft
        learner.round_done(5 if ks else 1, 0.05)
    assert set(learner.measured(1, "model")) <= {(0, 0, 0)}
    ks = SpeculationPolicy.choose([RowOption(2, 4, 0.8, True)], 1, 1, StepCosts(table, table),
                                  learner)
    assert ks.get(2, 0) > 0


@pytest.mark.parametrize("rows, drafts", [(2, True), (8, False)])
def test_in_a_large_batch_drafting_must_beat_plain_decoding_by_the_margin(rows, drafts,
                                                                          monkeypatch):
    """Drafting measured 5% ahead of plain decoding: taken in a small batch, not in one of
    `MARGIN_FROM_ROWS` rows, where its costs outside the rounds (the draft's prefill and
    catch-ups) are not in that figure (generated pair, 8 streams, through the server: 0.89x
    the tokens per second of the same server drafting less)."""
    from server.engine.speculation import yield_learner
    from server.engine.speculation.cost_model import BATCH_DRAFT_MARGIN, StepCosts, batch_bucket
    from server.engine.speculation.forward_times import ForwardTimes

    assert BATCH_DRAFT_MARGIN > 0.05
    monkeypatch.setattr(yield_learner, "PRIOR_ROUNDS", 0.0)  # the measured yields alone
    table = ForwardTimes((1, 2, 4, 8), (1, 2, 5), ((0.010, 0.011, 0.014), (0.011, 0.012, 0.015),
                                                   (0.012, 0.013, 0.016), (0.013, 0.015, 0.02)))
    learner = YieldLearner()
    for _ in range(60):
        for k in range(1, 5):
            learner.record(batch_bucket(rows), "model", (k, k, 1), 1.05 * rows, 0.02)
        learner.record(batch_bucket(rows), "model", (0, 0, 0), rows, 0.02)
    learner._rounds[(batch_bucket(rows), "model")] = 5  # past the early rounds
    options = [RowOption(i, 4, 0.6, True) for i in range(rows)]
    ks = SpeculationPolicy.choose(options, rows, rows, StepCosts(table, table), learner)
    assert bool(ks) is drafts


def test_what_was_learned_is_read_back_at_the_next_start(tmp_path):
    path = tmp_path / "lengths.json"
    first = YieldLearner(path)
    first.record(1, "model", (4, 4, 1), 5, 0.1)
    first.record(1, "lookup", (8, 0, 1), 7, 0.1)
    first.save()
    second = YieldLearner(path)
    assert second.measured(1, "model") == pytest.approx({(4, 4, 1): 50.0})
    arm = (8, 0, 1)
    assert second.estimate(1, "lookup", arm, 10.0) == first.estimate(1, "lookup", arm, 10.0)
    path.write_text("not json")
    assert YieldLearner(path).measured(1, "model") == {}


def test_the_scheduler_learns_from_its_rounds_and_its_text_stays_mlx_lms(kit, tmp_path):
    from server.engine.scheduling.scheduler import Scheduler, SchedulerConfig

    scheduler = Scheduler(kit, SchedulerConfig(), SpeculationPolicy(4))
    scheduler.use_cost_model(tmp_path, budget_s=0)
    counted = []
    done = scheduler.learner.round_done
    scheduler.learner.round_done = lambda tokens, seconds: (counted.append(tokens),
                                                           done(tokens, seconds))
    p = params(kit, 2, k=4, max_tokens=40)
    events = []
    seq = scheduler.submit(p, events.append)
    while seq.finish_reason is None:
        scheduler.step()
    assert tokens_of(events) == alone(kit, p)
    assert sum(counted) == len(seq.output) - 1  # what the rounds delivered (not the prefill's)
    # A prediction that is the answer and goes on past its end: rounds draft up to 16 tokens,
    # all accepted, the last one past max_tokens; it counts only what the request got.
    counted.clear()
    guessed = replace(p, prediction=tuple(tokens_of(events)) * 2)
    seq = scheduler.submit(guessed, lambda event: None)
    while seq.finish_reason is None:
        scheduler.step()
    assert len(seq.output) == 40 and sum(counted) == 39
    assert sum(len(scheduler.learner.measured(1, kind)) for kind in ("model", "lookup")) > 0


def test_plain_decoding_is_measured_early_in_a_bucket_the_tables_misjudge():
    """The tables put plain decoding below drafting where it yields 1.5x (hybrid pair, 16
    streams): within a burst's hundred rounds the learner measures it and keeps to it."""
    true_tps = arms(246.0, 150.0, 160.0, 140.0, 130.0)
    prior = arms(140.0, 141.0, 142.0, 141.0, 141.0)
    taken = simulate(YieldLearner(), true_tps, prior, rounds=60)
    assert taken[(0, 0, 0)] >= 0.9 * sum(taken.values())
