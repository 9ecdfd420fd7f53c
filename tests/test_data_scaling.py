"""The data-scaling fit (`training.data_scaling`) against exact, computed values."""

import json
import math

import pytest

from server.model_files.training.data_scaling import (
    acceptance_at,
    agreement_for,
    answers_for,
    fit_power_law,
    main,
    point,
)

C, B = 2.0, 0.25  # 1 - agreement = C * answers^-B


def law(n: int) -> float:
    return 1 - C * n ** -B


def card(extra: int, minutes: float) -> dict:
    """A distill card continued once over the 1,000 training answers plus `extra` more."""
    run = {"answers": 1050, "train_minutes": minutes, "agreement_after": law(1000 + extra)}
    if extra:
        run["extra_answers"] = extra
    return {"soft_targets": 1000, "after": law(1000 + extra), "train_minutes": 99.0,
            "continued": [{"train_minutes": 1.0}, run]}


def test_point_counts_the_training_split_and_the_last_runs_extra_answers():
    assert point(card(0, 5.0)) == (1000, law(1000), 5.0 / 1000)
    assert point(card(3000, 20.0)) == (4000, law(4000), 20.0 / 4000)
    first_run = {"soft_targets": 800, "after": 0.5, "train_minutes": 8.0}
    assert point(first_run) == (800, 0.5, 0.01)


def test_fit_recovers_an_exact_power_law_and_inverts_it():
    c, b = fit_power_law([(n, law(n)) for n in (1000, 3000, 9000)])
    assert (c, b) == (pytest.approx(C), pytest.approx(B))
    assert answers_for(law(50_000), c, b) == pytest.approx(50_000)


def test_agreement_for_inverts_the_chain_acceptance():
    assert acceptance_at(0.5, 2) == pytest.approx((0.5 + 0.25) / 2)
    a = agreement_for(0.6, 4)
    assert (a + a ** 2 + a ** 3 + a ** 4) / 4 == pytest.approx(0.6)
    assert 0.80 < a < 0.81


def test_cli_prints_the_points_the_fit_and_the_priced_answers(tmp_path, capsys):
    drafts = []
    for extra, minutes in ((0, 10.0), (2000, 30.0), (8000, 90.0)):
        d = tmp_path / f"draft-{extra}"
        d.mkdir()
        (d / "training.json").write_text(json.dumps(card(extra, minutes)))
        drafts.append(str(d))
    main([*drafts, "--agreement", "0.9", "--answers-per-hour", "1000"])
    out = capsys.readouterr().out
    assert f"fit: 1 - agreement = {C:.3f} * answers^-{B:.3f}" in out
    assert "9,000" in out and f"{law(9000):.3f}" in out
    n = (C / 0.1) ** (1 / B)  # 160,000 answers for 0.9
    hours = (n - 9000) / 1000
    assert f"0.900      {n:,.0f}  {n / 9000:.1f}x" in out
    assert f"{hours:.0f}" in out and f"{n * 0.01 / 60:.1f}" in out
    needed = agreement_for(0.6, 4)
    assert f"needs agreement {needed:.3f}" in out
    assert math.isclose(acceptance_at(needed, 4), 0.6, rel_tol=1e-9)
