"""What a caller asks the engine to generate: plain dataclasses, no MLX, no HTTP."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

Acceptance = Literal["exact", "rejection"]


class DraftSource(str, Enum):
    """Who proposes the drafts: the draft model; prompt lookup (n-grams of the prompt and
    output, no second model); suffix drafting (the continuation of the context's end in the
    texts this server served and in the request's own, `speculation.suffix`); or "hybrid",
    each round the one of prompt lookup (where the context's last `hybrid_min_match` tokens
    occurred before), suffix drafting and the draft model expected to have the most tokens
    accepted (`Sequence.plan_round`). Members compare equal to their names' strings."""

    MODEL = "model"
    PROMPT_LOOKUP = "prompt_lookup"
    HYBRID = "hybrid"
    SUFFIX = "suffix"

    def __str__(self) -> str:
        return self.value


# Hybrid drafts by lookup from a 2-token match: for SmolLM2 with its draft, on 32 requests no
# draft trained on, it beat a 1-token match (1.38-1.42x against 1.35x plain decoding's tok/s on
# code; docs/benchmarks.md, "What did not pay").
HYBRID_MIN_MATCH = 2


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # The tokens each penalty looks back over (`mlx_lm`'s defaults).
    repetition_context_size: int = 20
    presence_context_size: int = 20
    frequency_context_size: int = 20
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    # XTC ("exclude top choices", `mlx_lm`'s): with this probability a step drops every token
    # above the threshold but the least likely of them; the special tokens are never dropped.
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_special_tokens: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SpeculationParams:
    """How to draft. `num_draft_tokens == 0` means no speculation at all."""

    num_draft_tokens: int = 0
    source: DraftSource = DraftSource.MODEL
    acceptance: Acceptance = "rejection"
    adaptive: bool = True
    draft_p_min: float = 0.0
    hybrid_min_match: int = HYBRID_MIN_MATCH  # 1-3 (prompt lookup's longest n-gram is 3)
    # The request asked for drafting explicitly (num_draft_tokens > 0 or use_draft=true): it
    # fails with a 400 if the draft is gone when it starts, instead of running without one.
    required: bool = False
    # The most tokens a prompt-lookup or prediction round drafts, when more than
    # num_draft_tokens (`policy.LOOKUP_DRAFT_TOKENS`, for requests that leave k to the server).
    lookup_draft_tokens: int = 0


@dataclass(frozen=True)
class GenerationParams:
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speculation: SpeculationParams = field(default_factory=SpeculationParams)
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False  # vLLM's name: EOS is never sampled
    min_tokens: int = 0  # vLLM's name: EOS and stop strings are held off until this many tokens
    cache_prompt: bool = True  # llama.cpp's name: reuse (and store) the prefix cache
    stop_token_ids: tuple[int, ...] = ()  # vLLM's name: more tokens that end it as EOS does
    prediction: tuple[int, ...] = ()  # OpenAI's Predicted Outputs: a guess of the answer
    priority: int = 0  # vLLM's: waiting requests are admitted lowest first, then oldest
    # The fingerprint of the target the prompt was tokenized for ("": any): a request that
    # reaches the scheduler after the target was replaced is refused (ModelReplaced).
    target: str = ""
    # Whose texts suffix drafting may draft from, and whose this request's text becomes: an
    # opaque id of the API key that sent it ("": every request, when the server has no keys).
    tenant: str = ""
    # Builds this request's grammar state (a server.engine.structured.constraints.TokenConstraint).
    constraint: Callable[[], Any] | None = field(default=None, compare=False)
