"""A model's forward times as a function of rows x tokens, and their measurement.

A decoding round feeds the target (rows, 1 + K): its time depends on rows x tokens and on the
machine (a 2-core CPU's matmuls grow with every token fed; a GPU's barely do until the batch is
large). `ForwardTimes` holds a table of such times on a small grid and interpolates between
its points. `ForwardTimer` measures one, a forward at a time, so that the scheduler can run
the measurement in idle moments between requests (`forward_source`) within a `Budget` of
machine time: it measures the grid's rows level by level, smallest first, and stops before a
level its budget cannot pay for; the table then extrapolates past the last level measured.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

PROFILE_ROWS = (1, 2, 4, 8, 16, 32)
PROFILE_TOKENS = (1, 2, 3, 5)
PROFILE_CONTEXT = 64  # tokens already in each row's cache while timing
# Timed forwards per cell after one warm-up forward per level; the fastest is kept. Passes take
# turns over the level's cells, so a moment when the machine is busy slows one pass of every
# cell alike, not every pass of one cell.
PROFILE_REPS = 2


@dataclass(frozen=True)
class ForwardTimes:
    """Seconds of one forward of (rows, tokens) inputs, on a grid and interpolated
    (bilinearly; linearly past the last grid point, flat below the first)."""

    rows: tuple[int, ...]
    tokens: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]  # seconds[i][j]: rows[i] x tokens[j]

    def at(self, rows: int, tokens: int) -> float:
        i, u = _segment(self.rows, rows)
        j, v = _segment(self.tokens, tokens)
        s = self.seconds
        top = s[i][j] + (s[i][j + 1] - s[i][j]) * v
        bottom = s[i + 1][j] + (s[i + 1][j + 1] - s[i + 1][j]) * v
        return max(top + (bottom - top) * u, 0.0)

    def per_token(self) -> float:
        """Seconds per token of the largest forward in the table: about what prefill costs per
        token (larger prefill forwards cost a little less per token)."""
        return self.seconds[-1][-1] / (self.rows[-1] * self.tokens[-1])

    def scaled(self, factor: float, fixed_s: float = 0.0) -> ForwardTimes:
        """The table with every time's part above `fixed_s` multiplied by `factor`."""
        return ForwardTimes(self.rows, self.tokens, tuple(
            tuple(fixed_s + max(s - fixed_s, 0.0) * factor for s in row) for row in self.seconds))

    def to_json(self) -> dict:
        return {"rows": list(self.rows), "tokens": list(self.tokens),
                "seconds": [list(r) for r in self.seconds]}

    @classmethod
    def from_json(cls, data: dict) -> ForwardTimes:
        return cls(tuple(data["rows"]), tuple(data["tokens"]),
                   tuple(tuple(float(x) for x in r) for r in data["seconds"]))

    @classmethod
    def of(cls, rows, tokens, seconds) -> ForwardTimes:
        """A table of `seconds[i][j]` made non-decreasing along both axes (`monotone`)."""
        return cls(tuple(rows), tuple(tokens), tuple(map(tuple, monotone(seconds))))


def _segment(grid: tuple[int, ...], x: int) -> tuple[int, float]:
    """(i, t): x lies at fraction t between grid[i] and grid[i + 1] (t > 1 past the end; t = 0
    before the start)."""
    if len(grid) == 1:
        raise ValueError("a forward-time grid needs at least two points per axis")
    i = min(max(bisect_right(grid, x) - 1, 0), len(grid) - 2)
    t = (x - grid[i]) / (grid[i + 1] - grid[i])
    return i, max(t, 0.0)


def monotone(seconds: list[list[float]]) -> list[list[float]]:
    """The table made non-decreasing along both axes (more rows or tokens never cost less; a
    noisy machine sometimes measures so)."""
    out = [list(r) for r in seconds]
    for i, row in enumerate(out):
        for j in range(len(row)):
            if j:
                row[j] = max(row[j], row[j - 1])
            if i:
                row[j] = max(row[j], out[i - 1][j])
    return out


class Budget:
    """Machine time that measurements may spend (seconds; None: no bound), shared by the timers
    of one start."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.spent = 0.0

    def allows(self, cost_s: float) -> bool:
        return self.seconds is None or self.spent + cost_s <= self.seconds


class ForwardTimer:
    """Times `model`'s forward of (r, t) inputs after `context` cached tokens, for each r of
    `rows` (a level) and t of `tokens`; `forwards()` runs one forward per step.

    Levels go smallest first. The first two are started together, when `budget` allows what
    `estimate` (a prior table) says they cost; each next one when the budget left allows what
    the level before took times the ratio of their rows (a forward's time grows at most in
    proportion to its rows: its fixed part does not grow at all). `table()` holds the levels
    measured (None before any is; `complete` once two are, or all of `rows`)."""

    def __init__(self, model: nn.Module, rows=PROFILE_ROWS, tokens=PROFILE_TOKENS, *,
                 context: int = PROFILE_CONTEXT, reps: int = PROFILE_REPS,
                 budget: Budget | None = None, estimate: ForwardTimes | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.model = model
        self.clock = clock
        self.rows, self.tokens = tuple(rows), tuple(tokens)
        self.context, self.reps = context, reps
        self.budget = budget or Budget(None)
        self.estimate = estimate
        self.best: dict[tuple[int, int], float] = {}
        self.levels: list[int] = []  # the rows measured, in order
        self.level_s: list[float] = []  # what each level took
        self.spent_s = 0.0  # machine time of all its forwards
        self.stopped_by_budget = False
        self.row_cache: list | None = None  # one row's context, copied for every level
        self.level_cache: list | None = None  # the level's rows

    @property
    def complete(self) -> bool:
        """Whether `table()` can interpolate: two levels or more measured, or all there are."""
        return len(self.levels) >= min(2, len(self.rows))

    def table(self) -> ForwardTimes | None:
        if not self.levels:
            return None
        return ForwardTimes.of(self.levels, self.tokens,
                               [[self.best[r, t] for t in self.tokens] for r in self.levels])

    def expected_s(self, level: int) -> float:
        """What measuring `level` (an index into `rows`) is expected to take."""
        r = self.rows[level]
        if self.levels:
            return self.level_s[-1] * r / self.levels[-1]
        if self.estimate is None:
            return 0.0
        return (self.reps * sum(self.estimate.at(r, t) for t in self.tokens)
                + self.estimate.at(r, self.tokens[-1]))

    def forwards(self) -> Iterator[None]:
        """Measure, one forward per step (yield)."""
        context_s = self.estimate.at(1, self.context) if self.estimate is not None else 0.0
        first = sum(self.expected_s(i) for i in range(min(2, len(self.rows))))
        if not self.budget.allows(context_s + first):
            self.stopped_by_budget = True
            return
        self.row_cache = self._context_cache()
        yield
        for level, r in enumerate(self.rows):
            if level >= 2 and not self.budget.allows(self.expected_s(level)):
                self.stopped_by_budget = True
                return
            start = self.spent_s
            yield from self._level(r, self.row_cache)
            self.levels.append(r)
            self.level_s.append(self.spent_s - start)

    def _context_cache(self) -> list:
        """One row's cache (each layer of its own kind) holding `context` tokens, filled by one
        forward of the model (so that every rank of a sharded target fills its own)."""
        from server.engine.kv.batch import new_cache, prefill

        cache = new_cache(self.model)
        self._timed(lambda: prefill(self.model, cache,
                                    [1 + n % 7 for n in range(self.context)]))
        return cache

    def _level(self, r: int, row_cache: list) -> Iterator[None]:
        """The level's forwards on `r` copies of the row: after each, the KV caches are
        trimmed back and the recurrent states (which cannot be trimmed) put back."""
        from server.engine.kv.layers import batch_layer, kv_leaves, state_leaves

        cache = self.level_cache = [batch_layer([c] * r) for c in row_cache]
        for rep in range(self.reps + 1):  # the first pass is one warm-up forward
            for t in self.tokens if rep else self.tokens[-1:]:
                states = [(c, c.snapshot()) for c in state_leaves(cache)]
                elapsed = self._timed(lambda t=t: mx.eval(
                    self.model(mx.ones((r, t), mx.uint32), cache=cache)))
                for c in kv_leaves(cache):
                    c.trim(t)
                for c, state in states:
                    c.restore(state)
                if rep:
                    self.best[r, t] = min(self.best.get((r, t), float("inf")), elapsed)
                yield

    def _timed(self, forward: Callable[[], object]) -> float:
        """Run `forward` (which evaluates what it computes); its seconds, spent."""
        start = self.clock()
        forward()
        elapsed = self.clock() - start
        self.budget.spent += elapsed
        self.spent_s += elapsed
        return elapsed


def time_forwards(model: nn.Module, rows=PROFILE_ROWS, tokens=PROFILE_TOKENS,
                  context: int = PROFILE_CONTEXT, reps: int = PROFILE_REPS) -> ForwardTimes:
    """The whole table of `model`'s forward times, measured now (no budget)."""
    timer = ForwardTimer(model, rows, tokens, context=context, reps=reps)
    for _ in timer.forwards():
        pass
    return timer.table()
