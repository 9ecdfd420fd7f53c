"""The speculation policy, in one place: server defaults -> request -> loaded draft -> batch.

`for_request` runs when a request arrives (event loop; reads only immutable facts);
`round_options`, then `choose`, run on the MLX thread before every decoding round (the
scheduler drops in between the rows whose draft cannot keep up this round).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from server.engine.errors import InvalidRequest
from server.engine.params import DraftSource, SpeculationParams
from server.engine.speculation.cost_model import (
    PRIOR_ACCEPTANCE,
    DrafterRates,
    RowOption,
    StepCosts,
    choose_draft_lengths,
    decision_rate,
)

if TYPE_CHECKING:
    from server.engine.speculation.yield_learner import YieldLearner

# The caps within which the cost model (`server.engine.speculation.cost_model`) chooses each row's
# k per
# round; with no cost model (no measured forward times), rows draft up to the caps. No caps by
# default: the measured forward times decide. Lower them to bound the draft work per round.
DEFAULT_SPEC_MAX_BATCH = 256  # the largest batch in which rows still speculate
DEFAULT_BATCH_DRAFT_TOKENS = DEFAULT_NUM_DRAFT_TOKENS = 4  # k per round (the most: a cap)
# Alone, a request that leaves k to the server and adapts it drafts up to this many tokens in a
# prompt-lookup or prediction round (no draft forward: on one row a verify position costs
# little next to a forward's fixed cost). On the default pair, against 4: a JSON edit 1.74x,
# a code edit 1.11x, general requests 1.00x; in a batch `batch_draft_tokens` caps it.
LOOKUP_DRAFT_TOKENS = 16


@dataclass(frozen=True)
class SpeculationPolicy:
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS  # the server's k (changeable at load)
    spec_max_batch: int = DEFAULT_SPEC_MAX_BATCH  # speculate only while the batch is this small
    batch_draft_tokens: int = DEFAULT_BATCH_DRAFT_TOKENS  # the most k while others decode too

    def for_request(self, *, use_draft: bool | None, num_draft_tokens: int | None,
                    draft: DraftSource | None, defaults: SpeculationParams,
                    draft_loaded: bool, suffix: bool = False) -> SpeculationParams:
        """How this request drafts. `draft` is the request's own choice (None: the server's,
        `defaults.source`); `suffix`: the server keeps a suffix index.

        One rule: a drafter the request asks for explicitly (`draft` "model", "hybrid" or
        "suffix", `use_draft: true`, `num_draft_tokens > 0`) must be available now, else
        InvalidRequest naming the drafters that are. The server's default falls back quietly
        when it is not: hybrid without the draft model to the host drafters (prompt lookup,
        and suffix drafting when on), suffix to prompt lookup, model to no drafting. Turning
        drafting off (`use_draft: false`, `num_draft_tokens: 0`) always wins.
        """
        source = draft or defaults.source
        if use_draft is False or num_draft_tokens == 0:
            return replace(defaults, source=source, num_draft_tokens=0)
        available = available_drafters(draft_loaded, suffix)
        if draft is None and source not in available:
            source = _fallback(source, suffix)
        required = draft is not None or bool(use_draft) or bool(num_draft_tokens)
        # The default hybrid without its draft model: on with the host drafters, unless asked.
        host_hybrid = draft is None and source == DraftSource.HYBRID and not required
        if source in available or host_hybrid:
            k = num_draft_tokens if num_draft_tokens is not None else self.num_draft_tokens
            lookup_k = LOOKUP_DRAFT_TOKENS if num_draft_tokens is None and defaults.adaptive \
                else 0
            return replace(defaults, source=source, num_draft_tokens=k, required=required,
                           lookup_draft_tokens=lookup_k)
        if required:
            param = "draft" if draft else "num_draft_tokens" if num_draft_tokens else "use_draft"
            asked = f"draft={draft!r}" if draft else f"{param}={num_draft_tokens or 'true'}"
            raise InvalidRequest(
                f"{asked} {_missing(source)}. Drafters available now: "
                f"{', '.join(available)} (\"draft\": \"prompt_lookup\"); "
                f"{_remedy(source)}, or omit the field", param)
        return replace(defaults, num_draft_tokens=0)

    def round_options(self, rows, batch_size: int, rates: DrafterRates | None = None,
                      draft_cost: float = 0.0, learned: bool = False) -> list[RowOption]:
        """Each row that may draft this round, with its cap and the acceptance its k is chosen
        with (`choose`). Each drafting row chooses its drafter for the round first
        (`Sequence.plan_round`); its cap is its own (adaptive) k, at most `batch_draft_tokens`
        in a batch, and none once the batch is larger than `spec_max_batch`. `batch_size`
        counts the requests still prefilling too: they join within a few rounds; `rates` give
        the prior of rows new to a drafter; `draft_cost`, a draft forward's time over the
        target's, weighs a hybrid row's drafters. `learned`: the round's k is chosen from what
        each k measurably yielded (`YieldLearner`), so an adaptive row's cap is the most k it
        allows, not its schedule's halved-after-a-rejection k (on the generated pair, one
        stream, that schedule held k at 1 where k = 4 yielded 1.1x its tokens per second).

        Except seeded sampled requests: speculative sampling draws its randomness differently
        from plain sampling, and with each k differently, so they always speculate at their own
        k, and their text does not depend on what else runs (greedy output is the same either
        way).
        """
        return [self._option(r, batch_size, rates, draft_cost, learned) for r in rows
                if self.drafts(r, batch_size)]

    @staticmethod
    def choose(options: list[RowOption], batch_rows: int, draft_rows: int,
               costs: StepCosts | None, learner: YieldLearner | None = None) -> dict[int, int]:
        """Draft length per row this round (keyed by id; rows that do not draft are absent),
        `batch_rows` rows in the target's forward and `draft_rows` in the draft model's. Within
        the caps, the round with the most tokens per second: as `learner` measured each round
        shape to yield, from `costs` (the forward times) and each row's acceptance as its
        prior (`decision_rate`, `choose_draft_lengths`); without `costs` every row drafts its
        cap."""
        # A lookup row that found nothing still has its round counted (k > 0, nothing proposed).
        ks = {o.key: o.requested for o in options if o.cap == 0 and o.requested > 0}
        options = [o for o in options if o.cap > 0]
        if costs is None:
            return ks | {o.key: o.cap for o in options}
        return ks | choose_draft_lengths(options, batch_rows, draft_rows, costs, learner)

    def _option(self, row, batch_size: int, rates: DrafterRates | None,
                draft_cost: float, learned: bool) -> RowOption:
        row.plan_round(rates, draft_cost)
        forced = speculates_at_own_k(row)
        fixed = not row.params.speculation.adaptive
        cap = (row.schedule.most if learned and not (forced or fixed)
               else row.schedule.next)(row.remaining)
        if batch_size > 1 and not forced:
            cap = min(cap, max(self.batch_draft_tokens, 1))
        by_model = row.round_drafter == "model"
        requested = cap
        if not by_model:
            cap = min(cap, len(row.looked_up))
        accepted, trials = row.tried[row.drafted_by]
        prior = rates.prior(row.drafted_by) if rates is not None else PRIOR_ACCEPTANCE
        return RowOption(id(row), cap, decision_rate(accepted, trials, prior, batch_size),
                         by_model, forced=forced, requested=requested, fixed=fixed)

    def drafts(self, row, batch_size: int) -> bool:
        """Whether `row` may draft in a round of `batch_size` rows."""
        large = batch_size > self.spec_max_batch
        return row.drafter is not None and (not large or speculates_at_own_k(row))


def available_drafters(draft_loaded: bool, suffix: bool = False) -> tuple[DraftSource, ...]:
    """What can draft now: prompt lookup always; the draft model and hybrid with a draft;
    suffix drafting while the server keeps its index."""
    return tuple(s for s in DraftSource
                 if s == DraftSource.PROMPT_LOOKUP or (s == DraftSource.SUFFIX and suffix)
                 or (s in (DraftSource.MODEL, DraftSource.HYBRID) and draft_loaded))


def _fallback(source: DraftSource, suffix: bool) -> DraftSource | None:
    """What the server's default drafter becomes when it cannot draft now: hybrid without the
    draft model goes on with the host drafters (prompt lookup and suffix drafting: a hybrid
    row that loses its draft model, `Sequence.lose_draft_model`), suffix without its index
    with prompt lookup; the draft model without one does not draft."""
    if source == DraftSource.HYBRID and suffix:
        return DraftSource.HYBRID
    if source in (DraftSource.HYBRID, DraftSource.SUFFIX):
        return DraftSource.PROMPT_LOOKUP
    return None


def _missing(source: DraftSource | None) -> str:
    if source == DraftSource.SUFFIX:
        return "needs suffix drafting, which this server has turned off (engine.suffix_max_mb)"
    return "needs a draft model and none is loaded"


def _remedy(source: DraftSource | None) -> str:
    if source == DraftSource.SUFFIX:
        return "ask for another drafter"
    return "load a draft model with POST /v1/models/draft"


def speculates_at_own_k(row) -> bool:
    """A seeded sampled request: its text depends on its k in every round, so it always drafts
    its own k, whatever the batch (see `SpeculationPolicy.round_options`)."""
    sampling = row.params.sampling
    return sampling.seed is not None and not sampling.greedy
