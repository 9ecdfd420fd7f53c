"""Robust summaries of repeated runs, the speculative-decoding speedup model, and the verdicts."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

# IQR / 1.349 estimates the standard deviation of a normal distribution.
IQR_TO_SIGMA = 1.349
NOISY_CV = 0.10


@dataclass(frozen=True)
class Summary:
    median: float | None
    iqr: float | None
    cv: float | None  # robust coefficient of variation: IQR / median / 1.349
    q1: float | None = None
    q3: float | None = None

    @property
    def noisy(self) -> bool:
        return self.cv is not None and self.cv > NOISY_CV


def summarize(values: Sequence[float | None]) -> Summary:
    """Median, quartiles (linear interpolation, numpy's default), IQR and robust CV."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return Summary(None, None, None)
    q1, med, q3 = (float(x) for x in np.percentile(vals, [25, 50, 75]))
    iqr = q3 - q1
    cv = iqr / med / IQR_TO_SIGMA if med else None
    return Summary(med, iqr, cv, q1, q3)


def theoretical_speedup(a: float, k: float, c: float) -> float:
    """Expected speedup of speculative decoding (Leviathan et al. 2023, eq. 1 / Thm 3.8).

    `a`: the probability that a drafted token is accepted (i.i.d. per token); `k`: tokens
    drafted per round; `c`: the cost of one draft-model forward relative to the target's.
    A round costs 1 + k*c target-forwards and yields (1 - a^(k+1)) / (1 - a) tokens.
    """
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {a}")
    tokens_per_round = k + 1 if a == 1.0 else (1 - a ** (k + 1)) / (1 - a)
    return tokens_per_round / (1 + k * c)


def per_token_acceptance(rate: float, k: float) -> float:
    """The `a` of `theoretical_speedup` from a measured accepted/proposed `rate`.

    accepted/proposed is not `a`: a round stops at its first rejection, so the drafts after it
    count as proposed but never had a chance. Under the model, accepted/proposed =
    a (1 - a^k) / (k (1 - a)); this inverts that (it is increasing in a) by bisection.
    Then theoretical_speedup(a, k, c) == (1 + rate * k) / (1 + k * c), the measured tokens per
    round over the modelled cost of a round.
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must be in [0, 1], got {rate}")
    if rate in (0.0, 1.0) or k <= 1:
        return rate

    def accepted_fraction(a: float) -> float:
        return a * (1 - a**k) / (k * (1 - a))

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if accepted_fraction(mid) < rate else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Verdict:
    id: str
    claim: str
    verdict: str  # PASS | FAIL | N-A
    detail: str
    server: str | None = None  # set when a sweep compared two servers

    def line(self) -> str:
        where = f" [{self.server}]" if self.server else ""
        return f"{self.id} {self.verdict:<4}  {self.claim}{where}: {self.detail}"


def _ok(rows: list[dict], *, baseline: bool | None = None) -> list[dict]:
    return [r for r in rows if r.get("error") is None and r.get("tps_median") is not None
            and (baseline is None or (r["k"] == 0) == baseline)]


def verdict_beats_baseline(rows: list[dict]) -> Verdict:
    """P1: some k is faster than the baseline of its kind, their IQRs not overlapping."""
    claim = "some k beats the baseline"
    base = {r["kind"]: r for r in _ok(rows, baseline=True)}
    spec = [r for r in _ok(rows, baseline=False) if r["kind"] in base]
    if not spec:
        return Verdict("P1", claim, "N-A", "no baseline and speculative cells to compare")
    best = max(spec, key=lambda r: r["tps_median"] / base[r["kind"]]["tps_median"])
    b = base[best["kind"]]
    ratio = best["tps_median"] / b["tps_median"]
    wins = best["tps_q1"] > b["tps_q3"]
    detail = (f"best {best['kind']} k={best['k']}: {best['tps_median']:.1f} tok/s "
              f"[Q1 {best['tps_q1']:.1f}] vs baseline {b['tps_median']:.1f} "
              f"[Q3 {b['tps_q3']:.1f}], {ratio:.2f}x")
    return Verdict("P1", claim, "PASS" if wins else "FAIL", detail)


def verdict_interior_maximum(rows: list[dict]) -> Verdict:
    """P2: per kind, the fastest k is neither the smallest nor the largest k swept."""
    claim = "tok/s vs k has an interior maximum"
    by_kind: dict[str, list[dict]] = {}
    for r in _ok(rows, baseline=False):
        by_kind.setdefault(r["kind"], []).append(r)
    parts, results = [], []
    for kind, cells in by_kind.items():
        if len(cells) < 3:
            parts.append(f"{kind}: fewer than 3 k values")
            continue
        ks = sorted(r["k"] for r in cells)
        best = max(cells, key=lambda r: r["tps_median"])
        interior = ks[0] < best["k"] < ks[-1]
        results.append(interior)
        parts.append(f"{kind}: best k={best['k']} of {ks[0]}..{ks[-1]} "
                     f"({best['tps_median']:.1f} tok/s)")
    if not results:
        verdict = "N-A"
    else:
        verdict = "PASS" if all(results) else "FAIL"
    return Verdict("P2", claim, verdict, "; ".join(parts) or "no speculative cells")


def verdict_structured_accepts_more(rows: list[dict]) -> Verdict:
    """P3: accepted/proposed, pooled over every k, is higher on `structured` than `open_ended`."""
    claim = "acceptance on structured > open_ended"
    pooled = {}
    for kind in ("structured", "open_ended"):
        cells = [r for r in _ok(rows, baseline=False) if r["kind"] == kind]
        proposed = sum(r.get("proposed") or 0 for r in cells)
        accepted = sum(r.get("accepted") or 0 for r in cells)
        if proposed:
            pooled[kind] = (accepted / proposed, accepted, proposed)
    if len(pooled) < 2:
        return Verdict("P3", claim, "N-A", "needs accepted/proposed on both kinds")
    s, o = pooled["structured"], pooled["open_ended"]
    detail = f"structured {s[0]:.3f} ({s[1]}/{s[2]}) vs open_ended {o[0]:.3f} ({o[1]}/{o[2]})"
    return Verdict("P3", claim, "PASS" if s[0] > o[0] else "FAIL", detail)


def verdicts(rows: list[dict]) -> list[Verdict]:
    """P1-P3, for each server separately when a sweep compared two."""
    servers = list(dict.fromkeys(r["server"] for r in rows))
    out = []
    for server in servers or [None]:
        mine = [r for r in rows if r["server"] == server]
        for v in (verdict_beats_baseline(mine), verdict_interior_maximum(mine),
                  verdict_structured_accepts_more(mine)):
            out.append(replace(v, server=server) if len(servers) > 1 else v)
    return out


def finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None
