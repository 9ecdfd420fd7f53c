"""Where the cost model's forward times come from: a prior at once, the measured table when
it is ready. The server is ready as soon as its models are loaded; nothing waits for a
measurement.

Each model's times (`ModelTimes`) start from the best prior there is:

1. its own table, stored by an earlier start on this machine (`stored`);
2. else the stored table of the model nearest in size on this machine, scaled (`similar`);
3. else a formula from its parameters and the device (`formula`, `forward_prior`).

Then the scheduler measures in idle moments (`CostSource.step`, one forward per call, only
when no request waits or runs, so a request that arrives waits for one forward at most),
within a budget of machine time for the whole start (`engine.cost_model_budget_s`): a stored
table is spot-checked (and measured again when it was measured while the machine was busy),
any other is measured level by level (`ForwardTimer`) and stored. A measured table replaces
the prior when it is complete; rounds meanwhile correct the prior as they run
(`cost_model.RoundCalibration`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from enum import Enum
from pathlib import Path

from server.engine.models.model_kit import LoadedModel, ModelKit
from server.engine.speculation.cost_model import StepCosts
from server.engine.speculation.forward_prior import (
    DeviceSpeed,
    ModelSize,
    device_speed,
    formula_times,
    scaled_to,
)
from server.engine.speculation.forward_store import DEFAULT_CACHE_DIR, TableStore, machine_key
from server.engine.speculation.forward_times import (
    PROFILE_ROWS,
    PROFILE_TOKENS,
    Budget,
    ForwardTimer,
    ForwardTimes,
)

log = logging.getLogger(__name__)

# Machine time that measuring forward times may take per start, in idle moments: the default
# pair's whole grid took about 59 s on a 2-core CPU; the grid's smaller half (up to 8-16 rows,
# the rest extrapolated) fits in 10 s.
DEFAULT_BUDGET_S = 10.0
# A stored table is checked on these cells, and measured again when all of them now take less
# than BUSY_RATIO of its times.
SPOT_CHECK_ROWS = (1, 8)
SPOT_CHECK_TOKENS = (1, 2)
BUSY_RATIO = 0.75


class Origin(str, Enum):
    FORMULA = "formula"  # from the parameter count and the device
    SIMILAR = "similar"  # a stored table of a model of similar size on this machine, scaled
    STORED = "stored"  # this model's table, stored by an earlier start
    MEASURED = "measured"  # measured by this process


def measured_busy(check: ForwardTimes, table: ForwardTimes) -> bool:
    """Whether `table` was measured while the machine was busy: `check` (a spot check of a
    few of its cells now) is faster in every one by more than `BUSY_RATIO`. A table measured
    beside two busy processes put forwards at 2-7x their time and made extra positions look
    nearly free: the server drafted in batches of 16 and 32 rows where that made 0.8x the
    tokens per second of not drafting. A check slower than the table keeps it (the machine is
    busy now; the table is the better measurement)."""
    return all(check.at(r, t) < BUSY_RATIO * table.at(r, t)
               for r in check.rows for t in check.tokens)


class ModelTimes:
    """One model's forward times: `table` (from `origin`) now, measured in idle moments
    (`step`) and swapped in when ready."""

    def __init__(self, loaded: LoadedModel, role: str, variant: str, store: TableStore,
                 budget: Budget, speed: DeviceSpeed | None = None):
        self.loaded, self.role, self.store, self.budget = loaded, role, store, budget
        self.speed = speed or device_speed()
        self.size = ModelSize.of(loaded.model)
        self.key = machine_key(loaded.path, variant)
        self.table, self.origin, prior = self._prior()
        self.timer: ForwardTimer | None = None
        self.pending = True
        self._work = self._measure()
        log.info("cost model: %s %s: serving with %s forward times (%s)", role, loaded.path,
                 self.origin.value, prior)

    def _prior(self) -> tuple[ForwardTimes, Origin, str]:
        stored = self.store.load(self.key)
        if stored is not None:
            return stored, Origin.STORED, f"from {self.store.path(self.key)}"
        similar = self.store.similar(self.size)
        if similar is not None:
            table, size, path = similar
            return (scaled_to(table, size, self.size, self.speed), Origin.SIMILAR,
                    f"those of {path}, {size.parameters / 1e6:.1f}M parameters, scaled to"
                    f" {self.size.parameters / 1e6:.1f}M")
        return (formula_times(self.size, self.speed), Origin.FORMULA,
                f"{self.size.parameters / 1e6:.1f}M {self.size.kind} parameters on"
                f" {self.speed.name}")

    @property
    def levels(self) -> int:
        """Levels (row counts) measured so far by the current measurement."""
        return len(self.timer.levels) if self.timer is not None else 0

    def step(self) -> bool:
        """Run one forward of the measurement; True when it replaced the table."""
        try:
            return bool(next(self._work))
        except StopIteration:
            self.pending = False
        except Exception:  # noqa: BLE001 - a failed measurement must not fail requests
            log.exception("cost model: %s: measuring forward times failed; keeping the %s"
                          " times", self.role, self.origin.value)
            self.pending = False
        return False

    def _measure(self) -> Iterator[bool]:
        if self.origin is Origin.STORED:
            check = ForwardTimer(self.loaded.model, SPOT_CHECK_ROWS, SPOT_CHECK_TOKENS,
                                 budget=self.budget, estimate=self.table)
            self.timer = check
            yield from (False for _ in check.forwards())
            if not check.complete:
                log.info("cost model: %s: no time left in the budget for a spot check of its"
                         " stored forward times", self.role)
                return
            if not measured_busy(check.table(), self.table):
                log.info("cost model: %s: stored forward times confirmed by a spot check",
                         self.role)
                return
            log.info("cost model: %s: stored forward times are slower than the machine is now"
                     " (measured while it was busy): measuring them again", self.role)
        yield from self._measure_table()

    def _measure_table(self) -> Iterator[bool]:
        timer = ForwardTimer(self.loaded.model, budget=self.budget, estimate=self.table)
        self.timer = timer
        expected = sum(timer.expected_s(i) for i in range(len(timer.rows)))
        log.info("cost model: %s: measuring forward times of %s rows x %s tokens in idle"
                 " moments (the whole grid: about %.0f s of machine time by the %s times; %s)",
                 self.role,
                 _span(PROFILE_ROWS), _span(PROFILE_TOKENS), expected, self.origin.value,
                 _budget_text(self.budget))
        done = 0
        for _ in timer.forwards():
            if len(timer.levels) > done:
                done = len(timer.levels)
                log.info("cost model: %s: measured at %d rows (level %d of %d, %.1f s)", self.role,
                         timer.levels[-1], done, len(timer.rows), timer.spent_s)
            yield False
        if not timer.complete:
            log.info("cost model: %s: no time left in the budget to measure forward times;"
                     " keeping the %s times", self.role, self.origin.value)
            return
        self.table, self.origin = timer.table(), Origin.MEASURED
        self.store.save(self.key, self.table, self.size, self.loaded.path)
        skipped = PROFILE_ROWS[len(timer.levels):]
        log.info("cost model: %s: forward times measured in %.1f s (%s rows x %s tokens%s)%s",
                 self.role, timer.spent_s, _span(timer.levels),
                 _span(PROFILE_TOKENS),
                 f"; {_span(skipped)} rows extrapolated, past the budget" if skipped else "",
                 f"; stored in {self.store.path(self.key)}" if self.store.folder else "")
        yield True


def _span(values) -> str:
    return f"{values[0]}-{values[-1]}" if len(values) > 1 else str(values[0])


def _budget_text(budget: Budget) -> str:
    if budget.seconds is None:
        return "no bound"
    return f"at most {budget.seconds - budget.spent:.0f} s more: engine.cost_model_budget_s"


def kit_variant(kit: ModelKit, loaded: LoadedModel) -> str:
    """How a model was loaded, as far as its forward times depend on it."""
    return f"{kit.dtype}|fused={kit.fuse}" + ("|dequantized" if loaded.dequantized else "")


class CostSource:
    """The forward times of a `ModelKit`'s target and draft (`ModelTimes` each), measured in
    idle moments within one `Budget`. Models that stay (the target, when only the draft
    changes) keep their times from the `previous` source."""

    def __init__(self, kit: ModelKit, cache_dir: Path | None = DEFAULT_CACHE_DIR,
                 budget_s: float | None = DEFAULT_BUDGET_S,
                 previous: CostSource | None = None):
        self.budget = Budget(budget_s)
        self.cache_dir = cache_dir
        store = TableStore(cache_dir)
        kept = {id(m.loaded): m for m in (previous.models if previous is not None else [])}

        def times(loaded: LoadedModel, role: str) -> ModelTimes:
            return kept.get(id(loaded)) or ModelTimes(loaded, role, kit_variant(kit, loaded),
                                                      store, self.budget)

        self.target = times(kit.target, "target")
        self.draft = times(kit.draft, "draft") if kit.draft is not None else None
        self.models = [m for m in (self.target, self.draft) if m is not None]

    @property
    def pending(self) -> bool:
        """Whether a measurement has forwards left to run."""
        return any(m.pending for m in self.models)

    def step(self) -> bool:
        """One forward of the measurement furthest behind (the target's on a tie), so both
        models get their small levels before either its large ones; True when a table was
        replaced (`costs()` then has it)."""
        pending = [m for m in self.models if m.pending]
        return min(pending, key=lambda m: m.levels).step() if pending else False

    def finish(self) -> None:
        """Measure to the end now (benchmarks, the command line)."""
        while self.pending:
            self.step()

    def costs(self) -> StepCosts:
        """The tables the cost model reads now (with a calibration of their own)."""
        return StepCosts(self.target.table, self.draft.table if self.draft is not None else None)

    def status(self) -> dict:
        """For /health: where each model's times come from, and the measurement's progress."""
        return {"target": self.target.origin.value,
                "draft": self.draft.origin.value if self.draft is not None else None,
                "measuring": self.pending, "measured_s": round(self.budget.spent, 3),
                "budget_s": self.budget.seconds}
