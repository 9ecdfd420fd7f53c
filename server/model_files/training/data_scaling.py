"""How a draft's held-out agreement grows with its training data, and what a goal would cost.

    python -m server.model_files.training.data_scaling DRAFT... [--acceptance 0.6] [--k 4]
        [--agreement A ...] [--answers-per-hour R]

Each DRAFT is a folder `distill` wrote by continuing one draft over the training answers plus
some extra ones (`--init-from ... --extra-answers`), the same recipe for all. Its card gives
the answers its last run trained on (the training split plus its extra answers), the minutes it
took and its held-out agreement. This fits a power law to the disagreement,
1 - agreement = c * answers^-b (least squares on the logarithms; no floor, so the data it
extrapolates is a lower bound), and prints how many answers an agreement would take under it:
the one that `--acceptance` at a fixed `--k` needs and any `--agreement` given. That agreement
assumes each drafted token is accepted with the same probability a, independently:
accepted/proposed = (a + a^2 + ... + a^k) / k. With `--answers-per-hour` (the target's decoding
rate) it prices the missing answers in hours; an epoch's training time is priced at the
slowest card's minutes per answer.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from server.bench.report import aligned


def point(card: dict) -> tuple[int, float, float]:
    """(answers trained on, held-out agreement, training minutes per answer) of a card's last
    run: the training split (`soft_targets`) plus the extra answers it was continued over."""
    last = (card.get("continued") or [card])[-1]
    answers = card["soft_targets"] + last.get("extra_answers", 0)
    return answers, card["after"], last["train_minutes"] / answers


def fit_power_law(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(c, b) of 1 - agreement = c * answers^-b, least squares on log(answers), log(1 - a)."""
    slope, intercept = np.polyfit([math.log(n) for n, _ in points],
                                  [math.log(1 - a) for _, a in points], 1)
    return math.exp(intercept), -slope


def answers_for(agreement: float, c: float, b: float) -> float:
    """The answers at which the fitted law reaches `agreement`."""
    return (c / (1 - agreement)) ** (1 / b)


def acceptance_at(agreement: float, k: int) -> float:
    """accepted/proposed at a fixed k when each drafted token is right with this probability."""
    return sum(agreement ** i for i in range(1, k + 1)) / k


def agreement_for(acceptance: float, k: int) -> float:
    """The per-token agreement whose `acceptance_at(., k)` is `acceptance` (bisection)."""
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if acceptance_at(mid, k) < acceptance else (low, mid)
    return (low + high) / 2


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m server.model_files.training.data_scaling",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("drafts", nargs="+", type=Path, help="Folders distill wrote (training.json).")
    p.add_argument("--acceptance", type=float, default=0.6, help="Accepted/proposed to reach.")
    p.add_argument("--k", type=int, default=4, help="The fixed draft length it is measured at.")
    p.add_argument("--agreement", type=float, nargs="*", default=[],
                   help="Further agreements to price.")
    p.add_argument("--answers-per-hour", type=float, default=None,
                   help="The target's decoding rate, to price the missing answers in hours.")
    args = p.parse_args(argv)

    points = sorted(point(json.loads((d / "training.json").read_text())) for d in args.drafts)
    print(aligned([["answers trained on", "held-out agreement", "train min / answer"]]
                  + [[f"{n:,}", f"{a:.3f}", f"{m:.4f}"] for n, a, m in points]))
    c, b = fit_power_law([(n, a) for n, a, _ in points])
    print(f"\nfit: 1 - agreement = {c:.3f} * answers^-{b:.3f}")
    have, minutes_per_answer = points[-1][0], max(m for _, _, m in points)
    needed = agreement_for(args.acceptance, args.k)
    print(f"acceptance {args.acceptance:g} at k = {args.k} needs agreement {needed:.3f} "
          f"(tokens accepted independently)")
    rows = [["agreement", "answers", "x the most here", "decode h", "train h / epoch"]]
    for a in [needed, *args.agreement]:
        n = answers_for(a, c, b)
        hours = (f"{(n - have) / args.answers_per_hour:.0f}" if args.answers_per_hour else "-")
        rows.append([f"{a:.3f}", f"{n:,.0f}", f"{n / have:.1f}x", hours,
                     f"{n * minutes_per_answer / 60:.1f}"])
    print(aligned(rows))


if __name__ == "__main__":
    main()
