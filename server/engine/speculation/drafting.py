"""How many tokens a request drafts next round, and prompt lookup's proposals."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

from server.engine.params import SpeculationParams
from server.engine.speculation.prompt_lookup import DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM, find_match


class DraftSchedule:
    """How many tokens to draft next round.

    Fixed: `num_draft_tokens` every round. Adaptive: one more (twice as many with `doubling`)
    after a round that accepted a full block, half as many after a rejection in the first half
    of the block, one fewer after a later rejection; always within [1, num_draft_tokens].
    """

    def __init__(self, speculation: SpeculationParams, *, doubling: bool = False):
        self.max_k = max(0, speculation.num_draft_tokens)
        self.adaptive = speculation.adaptive
        self.doubling = doubling
        self.k = self.max_k

    def next(self, remaining: float) -> int:
        return int(max(0, min(self.k, remaining)))

    def most(self, remaining: float) -> int:
        """The largest k the request allows (what a learned choice picks within)."""
        return int(max(0, min(self.max_k, remaining)))

    def update(self, requested: int, proposed: int, accepted: int) -> None:
        if not self.adaptive or proposed == 0:
            return
        if accepted == proposed:
            if proposed == requested == self.k:
                self.k = min(self.max_k, 2 * self.k if self.doubling else self.k + 1)
        elif accepted < proposed // 2:
            self.k = max(1, self.k // 2)
        else:
            self.k = max(1, self.k - 1)


def lookup_proposal(context: list[int], num_tokens: int,
                    min_ngram: int = DEFAULT_MIN_NGRAM) -> list[int]:
    """Prompt lookup: the continuation of the last n-gram's earlier occurrence (an n-gram of at
    least `min_ngram` tokens)."""
    return lookup_match(context, num_tokens, min_ngram)[0]


def lookup_match(context: list[int], num_tokens: int,
                 min_ngram: int = DEFAULT_MIN_NGRAM) -> tuple[list[int], int]:
    """`lookup_proposal`, and the length of the n-gram it continues (0: no match)."""
    return find_match(context, num_tokens, max_ngram=DEFAULT_MAX_NGRAM, min_ngram=min_ngram)


def confident_count(probabilities: Iterable[float], k: int, p_min: float) -> int:
    """How many of a round's first k draft tokens it proposes under `draft_p_min`: those before
    the first one the draft gives a probability below p_min (all k when none is)."""
    return next((j for j, p in enumerate(islice(probabilities, k)) if p < p_min), k)
