"""Forward-time tables and their measurement one forward at a time, within a budget: on a
model whose every forward takes a known time on a clock of the test's own."""

from __future__ import annotations

import mlx.core as mx
import pytest
from support.models import ZOO

from server.engine.models.model_kit import load_model
from server.engine.speculation.forward_times import (
    Budget,
    ForwardTimer,
    ForwardTimes,
    monotone,
    time_forwards,
)

TARGET = ForwardTimes((1, 8), (1, 2, 3), ((0.05, 0.05, 0.06), (0.10, 0.12, 0.24)))


def flat(table: ForwardTimes) -> list[float]:
    return [s for row in table.seconds for s in row]


def test_forward_times_interpolate_between_and_extrapolate_past_the_grid():
    assert TARGET.at(1, 1) == 0.05 and TARGET.at(8, 3) == 0.24
    assert TARGET.at(8, 2) == pytest.approx(0.12)
    # 4 rows lie 3/7 of the way from 1 row to 8
    assert TARGET.at(4, 1) == pytest.approx(0.05 + (0.10 - 0.05) * 3 / 7)
    assert TARGET.at(15, 1) == pytest.approx(0.15)  # one more grid step of rows: +0.05
    assert TARGET.at(8, 4) == pytest.approx(0.36)  # past 3 tokens: the last slope, +0.12
    assert TARGET.at(0, 1) == 0.05  # below the grid: flat


def test_a_noisy_table_is_made_non_decreasing():
    assert monotone([[3, 2, 4], [1, 5, 4]]) == [[3, 3, 4], [3, 5, 5]]


def test_a_table_scales_above_its_fixed_part():
    scaled = TARGET.scaled(2.0, fixed_s=0.02)
    assert flat(scaled) == pytest.approx([0.08, 0.08, 0.10, 0.18, 0.22, 0.46])


class ClockedModel:
    """A real model whose forwards take 1 ms per row x token on the test's clock: the timer's
    figures and its budget decisions are then exact. Counts its forwards."""

    def __init__(self, model):
        self.model, self.layers = model, model.layers
        self.now = 0.0
        self.forwards = 0

    def __call__(self, x, cache=None):
        self.forwards += 1
        self.now += 0.001 * x.shape[0] * x.shape[1]
        return self.model(x, cache=cache)

    def clock(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def tiny_model(tiny_pair):
    return load_model(str(tiny_pair[0])).model


def test_the_timer_measures_level_by_level_one_forward_per_step(tiny_model):
    """Rows 1, 2, 4 x tokens 1, 2, one rep: a context forward, then per level a warm-up of
    2 tokens and a pass over 1 and 2: 1 + 3 x 3 = 10 forwards, each its own step."""
    model = ClockedModel(tiny_model)
    timer = ForwardTimer(model, (1, 2, 4), (1, 2), context=16, reps=1, clock=model.clock)
    steps = 0
    for _ in timer.forwards():
        steps += 1
        assert model.forwards == steps  # one forward per step, never more
    assert steps == 10 and timer.levels == [1, 2, 4] and not timer.stopped_by_budget
    table = timer.table()
    assert table.rows == (1, 2, 4)
    assert flat(table) == pytest.approx([0.001, 0.002, 0.002, 0.004, 0.004, 0.008])
    # levels: 1 x (2 + 1 + 2) ms, 2 x 5 ms, 4 x 5 ms; the context forward: 16 ms
    assert timer.level_s == pytest.approx([0.005, 0.010, 0.020])
    assert timer.spent_s == pytest.approx(0.016 + 0.035)


def test_the_budget_stops_before_a_level_it_cannot_pay_for(tiny_model):
    """After the context (16 ms) and levels 1 and 2 (5 + 10 ms), level 4 is expected to take
    10 ms x 4/2 = 20 ms: a budget of 55 ms pays for it (51 ms spent), not for 8 rows (expected
    at 40 ms more), so 1, 2 and 4 rows are measured and 8 is extrapolated."""
    model = ClockedModel(tiny_model)
    budget = Budget(0.055)
    timer = ForwardTimer(model, (1, 2, 4, 8), (1, 2), context=16, reps=1, budget=budget,
                         clock=model.clock)
    for _ in timer.forwards():
        pass
    assert timer.levels == [1, 2, 4] and timer.stopped_by_budget and timer.complete
    assert budget.spent == pytest.approx(0.051)
    assert timer.table().at(8, 1) == pytest.approx(0.008)  # extrapolated from 2 -> 4


def test_no_measurement_starts_when_the_estimate_says_its_first_levels_do_not_fit(tiny_model):
    """The prior says the context and the first two levels take 16 + 15 ms: a 30 ms budget
    runs no forward at all; 0 s (`engine.cost_model_budget_s: 0`) never measures."""
    estimate = ForwardTimes((1, 2), (1, 2), ((0.001, 0.002), (0.002, 0.004)))
    for seconds in (0.030, 0.0):
        model = ClockedModel(tiny_model)
        timer = ForwardTimer(model, (1, 2, 4), (1, 2), context=16, reps=1,
                             budget=Budget(seconds), estimate=estimate, clock=model.clock)
        assert list(timer.forwards()) == [] and model.forwards == 0
        assert timer.stopped_by_budget and timer.table() is None and not timer.complete


def test_time_forwards_measures_the_whole_grid(tiny_model):
    table = time_forwards(tiny_model, (1, 2), (1, 3), context=8, reps=1)
    assert table.rows == (1, 2) and table.tokens == (1, 3)
    assert all(0 < s < 1 for row in table.seconds for s in row)
    assert table.seconds == tuple(map(tuple, monotone(table.seconds)))


def cache_state(cache: list) -> tuple:
    """What the next forward reads from a batch cache: the KV layers' lengths and offsets,
    the recurrent layers' states."""
    from server.engine.kv.layers import kv_leaves, state_leaves

    return ([(c._idx, c.offset.tolist()) for c in kv_leaves(cache)],
            [[a.tolist() for a in c.cache if a is not None] for c in state_leaves(cache)])


@pytest.mark.parametrize("arch", ZOO)
def test_every_cache_kind_is_timed_and_left_as_it_was(zoo, arch):
    """Sliding windows, recurrent states, layers with both: after each forward the KV caches
    are trimmed back and the states put back, so the level's last forward leaves its cache as
    two copies of the row's context were; the row's own cache is never touched."""
    from server.engine.kv.layers import arrays_of, batch_layer

    model = load_model(str(zoo[arch][0])).model
    timer = ForwardTimer(model, (1, 2), (1, 3), context=8, reps=2)
    forwards = timer.forwards()
    next(forwards)  # the context forward
    row = [mx.array(a) for a in arrays_of(timer.row_cache)]
    fresh = cache_state([batch_layer([c] * 2) for c in timer.row_cache])
    for _ in forwards:
        pass
    assert timer.levels == [1, 2] and all(s > 0 for s in flat(timer.table()))
    assert cache_state(timer.level_cache) == fresh
    after = arrays_of(timer.row_cache)
    assert len(after) == len(row) and all(mx.array_equal(a, b).item()
                                          for a, b in zip(row, after, strict=True))
