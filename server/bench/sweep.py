"""Run every cell on every runner (interleaved cell by cell) and turn the runs into rows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from server.bench.cells import Cell
from server.bench.runners import Runner, RunResult
from server.bench.stats import per_token_acceptance, summarize, theoretical_speedup


@dataclass(frozen=True)
class SweepSettings:
    reps: int
    warmup: int
    max_tokens: int
    temperature: float
    seed: int
    drafter: str
    acceptance: str
    adaptive: bool


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def cell_row(cell: Cell, runs: list[RunResult], *, server: str, settings: SweepSettings,
             error: str | None = None) -> dict:
    """One row: medians, IQRs and robust CVs of the reps, plus pooled draft counts."""
    tps = summarize([r.tps for r in runs])
    peak = summarize([r.peak_gb for r in runs])
    rate = summarize([_ratio(r.accepted, r.proposed) for r in runs])
    frac = summarize([_ratio(r.from_draft, r.tokens) for r in runs])

    def total(attr: str) -> int | None:
        vals = [getattr(r, attr) for r in runs]
        return sum(vals) if vals and all(v is not None for v in vals) else None

    proposed, accepted, rounds = total("proposed"), total("accepted"), total("rounds")
    return {
        "server": server, "kind": cell.kind, "k": cell.k,
        "drafter": settings.drafter if cell.k else None,
        "acceptance_rule": settings.acceptance if cell.k else None,
        "adaptive": settings.adaptive if cell.k else None,
        "temperature": settings.temperature, "max_tokens": settings.max_tokens,
        "reps": len(runs), "warmup": settings.warmup, "error": error,
        "tps_median": tps.median, "tps_iqr": tps.iqr, "tps_q1": tps.q1, "tps_q3": tps.q3,
        "tps_cv": tps.cv, "flagged": tps.noisy,
        "speedup": None, "theory": None, "alpha": None, "cost_ratio": None,
        "accept_rate_median": rate.median, "accept_rate_iqr": rate.iqr,
        "from_draft_median": frac.median, "from_draft_iqr": frac.iqr,
        "peak_gb_median": peak.median, "peak_gb_iqr": peak.iqr,
        "tokens_median": summarize([r.tokens for r in runs]).median,
        "prompt_tokens": runs[0].prompt_tokens if runs else None,
        "ttft_median": summarize([r.ttft_s for r in runs]).median,
        "proposed": proposed, "accepted": accepted, "rounds": rounds,
        "k_mean": _ratio(proposed, rounds) if rounds else (cell.k or None),
        "compare_with": None, "compare_ratio": None,
        "tps_reps": [r.tps for r in runs],
    }


def add_speedups(row: dict, baseline: dict | None, cost_ratio: float | None) -> None:
    """Measured speedup over the kind's baseline, and what the speedup model predicts."""
    row["cost_ratio"] = cost_ratio
    if row["error"] is None and baseline is not None and baseline["error"] is None:
        row["speedup"] = _ratio(row["tps_median"], baseline["tps_median"])
    if row["k"] == 0:
        row["theory"] = 1.0 if row["error"] is None else None
        return
    if row["proposed"] and cost_ratio is not None:
        k = row["k_mean"]
        alpha = per_token_acceptance(row["accepted"] / row["proposed"], k)
        row["alpha"] = alpha
        row["theory"] = theoretical_speedup(alpha, k, cost_ratio)


def run_cell(runner: Runner, cell: Cell, settings: SweepSettings) -> dict:
    """Warm-up runs (discarded), then the reps; any exception makes an error row."""
    runs: list[RunResult] = []
    try:
        for i in range(settings.warmup):
            runner.run(cell, max_tokens=settings.max_tokens,
                       seed=settings.seed + settings.reps + i)
        for i in range(settings.reps):
            runs.append(runner.run(cell, max_tokens=settings.max_tokens, seed=settings.seed + i))
    except Exception as e:  # a failed cell is data: record it, go on with the sweep
        return cell_row(cell, [], server=runner.label, settings=settings,
                        error=f"{type(e).__name__}: {e}")
    return cell_row(cell, runs, server=runner.label, settings=settings)


def sweep(
    runners: list[Runner],
    cells: list[Cell],
    settings: SweepSettings,
    *,
    cost_ratio: float | None,
    on_row: Callable[[dict], None],
    on_start: Callable[[Cell, str], None] = lambda cell, label: None,
    on_done: Callable[[Cell, str], None] = lambda cell, label: None,
) -> list[dict]:
    """Each cell on each runner in turn; rows go to `on_row` as soon as a cell is done."""
    rows: list[dict] = []
    labels = [r.label for r in runners]
    if len(set(labels)) != len(labels):
        raise ValueError(f"runner labels must differ: {labels}")
    baselines: dict[tuple[str, str], dict] = {}
    for cell in cells:
        cell_rows = []
        for runner in runners:
            on_start(cell, runner.label)
            row = run_cell(runner, cell, settings)
            if cell.baseline:
                baselines[(runner.label, cell.kind)] = row
            add_speedups(row, baselines.get((runner.label, cell.kind)), cost_ratio)
            cell_rows.append(row)
            on_done(cell, runner.label)
        if len(cell_rows) == 2:
            first, second = cell_rows
            ratio = _ratio(first["tps_median"], second["tps_median"])
            for row, other in ((first, second), (second, first)):
                row["compare_with"], row["compare_ratio"] = other["server"], ratio
        for row in cell_rows:
            on_row(row)
            rows.append(row)
    return rows
