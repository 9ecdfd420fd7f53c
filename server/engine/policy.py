"""The speculation policy, in one place: server defaults -> request -> loaded draft -> batch.

`for_request` runs when a request arrives (event loop; reads only immutable facts);
`for_round` runs on the MLX thread before every decoding round.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from server.engine.params import DraftSource, SpeculationParams


class InvalidRequest(ValueError):
    """A request the engine cannot serve as asked (maps to HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# Measured on the generated fp32 pair, 2-core CPU, every row decoding (`python -m
# server.bench.spec_batch`, RESULTS/spec-batch.txt). A CPU's matmuls grow with the rows fed, so
# verifying k + 1 tokens per row is not free in a batch: k = 1 gives 1.31x plain decoding's
# tok/s alone, 1.28x at 2 rows, 1.19x at 4, 1.11x at 8, 1.07x at 12 and 0.96x at 16; k = 2
# gives more alone and at 2 rows (1.41x, 1.50x) and less from 4 on (1.09x, 1.00x at 8). So: the
# row's own (adaptive) k alone, k = 1 in a batch, plain decoding above 4 rows: through the
# server, where new requests' prefills (the draft's too) share the time, 8 streams measured
# 0.93x with k = 1 against 0.99x plain (`scripts/reproduce_figures.sh load`), while 2 and 4
# streams gained (RESULTS/load-20261201-052424-*). On a GPU the crossover is higher: raise
# `engine.spec_max_batch` and `engine.spec_batch_draft_tokens`.
DEFAULT_SPEC_MAX_BATCH = 4
DEFAULT_BATCH_DRAFT_TOKENS = 1
DEFAULT_NUM_DRAFT_TOKENS = 4  # k per round (the most, when adaptive)


@dataclass(frozen=True)
class SpeculationPolicy:
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS  # the server's k (changeable at load)
    spec_max_batch: int = DEFAULT_SPEC_MAX_BATCH  # speculate only while the batch is this small
    batch_draft_tokens: int = DEFAULT_BATCH_DRAFT_TOKENS  # the most k while others decode too

    def for_request(self, *, use_draft: bool | None, num_draft_tokens: int | None,
                    draft: DraftSource | None, defaults: SpeculationParams,
                    draft_loaded: bool) -> SpeculationParams:
        """How this request drafts. `draft` is the request's own choice (None: the server's,
        `defaults.source`).

        One rule: a drafter the request asks for explicitly (`draft` "model" or "hybrid",
        `use_draft: true`, `num_draft_tokens > 0`) must be available now, else InvalidRequest
        naming the drafters that are. The server's default falls back quietly when it names
        the draft model and none is loaded: hybrid to prompt lookup, model to no drafting.
        Turning drafting off (`use_draft: false`, `num_draft_tokens: 0`) always wins.
        """
        source = draft or defaults.source
        if use_draft is False or num_draft_tokens == 0:
            return replace(defaults, source=source, num_draft_tokens=0)
        available = available_drafters(draft_loaded)
        if draft is None and source not in available:
            source = "prompt_lookup" if source == "hybrid" else None
        required = draft is not None or bool(use_draft) or bool(num_draft_tokens)
        if source in available:
            k = num_draft_tokens if num_draft_tokens is not None else self.num_draft_tokens
            return replace(defaults, source=source, num_draft_tokens=k, required=required)
        if required:
            param = "draft" if draft else "num_draft_tokens" if num_draft_tokens else "use_draft"
            asked = f"draft={draft!r}" if draft else f"{param}={num_draft_tokens or 'true'}"
            raise InvalidRequest(
                f"{asked} needs a draft model and none is loaded. Drafters available now: "
                f"{', '.join(available)} (\"draft\": \"prompt_lookup\"); load a draft model "
                "with POST /v1/models/draft, or omit the field", param)
        return replace(defaults, num_draft_tokens=0)

    def for_round(self, rows, batch_size: int) -> dict[int, int]:
        """Draft length per row this round (keyed by id): the row's own (adaptive) k alone, at
        most `batch_draft_tokens` in a batch, none once the batch is large. Each drafting row
        chooses its drafter for the round first (`Sequence.plan_round`).

        `batch_size` counts the requests still prefilling too: they join within a few rounds.

        Except seeded sampled requests: speculative sampling draws its randomness differently
        from plain sampling, and with each k differently, so they always speculate at their own
        k, and their text does not depend on what else runs (greedy output is the same either
        way).
        """
        return {id(r): self._k(r, batch_size) for r in rows if self.drafts(r, batch_size)}

    def _k(self, row, batch_size: int) -> int:
        row.plan_round()
        k = row.schedule.next(row.remaining)
        if batch_size > 1 and not _seeded_sampling(row):
            k = min(k, max(self.batch_draft_tokens, 1))
        return k

    def drafts(self, row, batch_size: int) -> bool:
        """Whether `row` drafts in a round of `batch_size` rows."""
        large = batch_size > self.spec_max_batch
        return row.drafter is not None and (not large or _seeded_sampling(row))


def available_drafters(draft_loaded: bool) -> tuple[DraftSource, ...]:
    """What can draft now: prompt lookup always; the draft model and hybrid with a draft."""
    return ("model", "prompt_lookup", "hybrid") if draft_loaded else ("prompt_lookup",)


def _seeded_sampling(row) -> bool:
    sampling = row.params.sampling
    return sampling.seed is not None and not sampling.greedy
