"""What the engine yields while generating: one TokenEvent per token, then one Finished."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class TokenEvent:
    token: int
    text: str  # may be "" while the detokenizer or a stop sequence holds text back
    from_draft: bool
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclass
class DraftCounters:
    """Filled in by the token generator as it drafts: one round = one target verification."""

    proposed: int = 0
    accepted: int = 0
    prediction_accepted: int = 0  # accepted tokens that the request's prediction drafted
    rounds: int = 0
    model_rounds: int = 0  # rounds the draft model drafted (the others: prompt lookup)
    k_histogram: Counter = field(default_factory=Counter)

    def record_round(self, num_drafted: int, *, by_model: bool = False) -> None:
        self.rounds += 1
        self.model_rounds += by_model
        self.proposed += num_drafted
        self.k_histogram[num_drafted] += 1


@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int
    generation_tokens: int
    ttft_s: float
    prompt_tps: float
    generation_tps: float
    total_s: float
    peak_memory_gb: float
    draft_model: str | None
    num_draft_tokens: int
    draft_tokens_proposed: int
    draft_tokens_accepted: int
    acceptance_rate: float | None
    from_draft_fraction: float
    mean_accepted_length: float | None = None
    k_histogram: dict[int, int] | None = None
    cached_tokens: int = 0
    # With a prediction (OpenAI's names): its tokens the answer took, and the rest of them.
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" | "length" (| "cancelled": generate_events' caller stopped)
    stats: GenerationStats
    stop_sequence: str | None = None  # the stop string that ended it (Anthropic reports it)
