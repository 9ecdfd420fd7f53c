"""What each drafter offers a row for its next round, and how `hybrid` picks one.

A `DraftCandidate` is one drafter's offer: the tokens of a host drafter (prompt lookup, suffix;
none for the draft model, which drafts on the device once chosen) and, per position, the chance
that the draft is accepted up to there. `expected_accepted(k)` is what a round drafting its
first k tokens is expected to gain: the interface through which a k controller can weigh any
drafter's offer, whatever it is based on (the counts of suffix drafting, a measured acceptance
rate for the others).

`hybrid` drafts, each round, with the candidate expected to have the most tokens accepted, per
unit of round time where the draft model's forwards have a known cost (`best_candidate`); on a
tie a host drafter wins (it costs no draft forward).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from server.engine.speculation.cost_model import hopeful_rate

MODEL = "model"
PROMPT_LOOKUP = "prompt_lookup"
SUFFIX = "suffix"
HOST_DRAFTERS = (SUFFIX, PROMPT_LOOKUP)  # draft on the host, no draft forward; tie order


@dataclass(frozen=True)
class DraftCandidate:
    source: str  # MODEL, PROMPT_LOOKUP or SUFFIX
    tokens: tuple[int, ...]  # a host drafter's proposal (the draft model's come later)
    confidence: tuple[float, ...]  # [j]: the chance that the first j + 1 are all accepted
    forwards: int = 0  # draft-model forwards the round takes to draft it

    def expected_accepted(self, k: int | None = None) -> float:
        """Expected accepted tokens of a round that drafts the first k (all) positions."""
        return sum(self.confidence[:k])


def rate_candidate(source: str, tokens: Iterable[int], k: int, accepted: int, trials: int,
                   prior: float) -> DraftCandidate:
    """A candidate judged by its drafter's measured acceptance on this row (`accepted` of
    `trials` tokens, shrunk towards `prior` and given the benefit of the doubt while trials are
    few: `hopeful_rate`), each position accepted at that rate given the ones before: k
    positions for the draft model, the proposal's first k for prompt lookup."""
    tokens = () if source == MODEL else tuple(tokens)[:k]
    rate = hopeful_rate(accepted, trials, prior)
    positions = k if source == MODEL else len(tokens)
    return DraftCandidate(source, tokens, tuple(rate ** j for j in range(1, positions + 1)),
                          k if source == MODEL else 0)


def counted_candidate(tokens: list[int], confidence: list[float], k: int,
                      calibration: float = 1.0) -> DraftCandidate:
    """Suffix drafting's candidate: its first k tokens with their confidence from counts,
    scaled by `calibration` (`suffix.SuffixCalibration.factor`)."""
    return DraftCandidate(SUFFIX, tuple(tokens[:k]),
                          tuple(min(c * calibration, 1.0) for c in confidence[:k]))


def best_candidate(candidates: list[DraftCandidate],
                   forward_cost: float = 0.0) -> DraftCandidate | None:
    """The candidate whose round is expected to emit the most tokens (1 + its expected
    accepted tokens) per unit of round time, a round costing 1 + `forward_cost` per draft
    forward (a draft forward's time over the target's; 0: unknown, the expected accepted
    tokens alone decide); a host drafter on a tie (in `HOST_DRAFTERS` order), then the draft
    model. Empty host proposals are no candidates."""
    order = {source: i for i, source in enumerate((*HOST_DRAFTERS, MODEL))}
    offers = [c for c in candidates if c.tokens or c.source == MODEL]
    if not offers:
        return None

    def score(c: DraftCandidate) -> float:
        return round((1 + c.expected_accepted()) / (1 + c.forwards * forward_cost), 9)

    return max(sorted(offers, key=lambda c: order[c.source]), key=score)

