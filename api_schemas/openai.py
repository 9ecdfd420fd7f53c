"""Request and response bodies of the OpenAI API, with our extensions fenced below them.

Request fields follow the order of OpenAI's docs. A field left out is None here; the server's
settings supply the default, so each default lives in one place.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


def response_id(prefix: str) -> str:
    """A completion's id, `chatcmpl-...` or `cmpl-...` (24 hex digits, as OpenAI's): the one
    place ids are made, for collected responses and for every chunk of a stream."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class OpenAIBaseModel(BaseModel):
    # Clients send fields we do not use (user, metadata, store, ...): accept and ignore them.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class TextPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


NonNegInt = Annotated[int, Field(ge=0)]


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by chat and text completions."""

    model: str | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=1, description="Only 1 is supported.")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    user: str | None = None

    # --- extensions (not in OpenAI's API) ---------------------------------------------
    num_draft_tokens: NonNegInt | None = Field(
        None, le=64, description="Draft tokens per round (the maximum when adaptive); 0 = off."
    )
    use_draft: bool | None = Field(None, description="Default: true when a drafter is loaded.")
    draft: Literal["model", "prompt_lookup"] | None = Field(
        None, description="Where drafts come from: the draft model or prompt lookup."
    )
    acceptance: Literal["exact", "rejection"] | None = Field(
        None, description="Acceptance rule at temperature > 0."
    )
    adaptive: bool | None = Field(None, description="Adapt the draft length per round.")
    draft_p_min: float | None = Field(
        None, ge=0.0, le=1.0, description="Stop drafting a round below this draft probability."
    )
    top_k: NonNegInt | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v):
        for key, value in (v or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError("logit_bias values must be in [-100, 100]")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _checks(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported")
        if self.tools:
            raise ValueError("tools are not supported by this server")
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if len(v) == 0:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], str):
                if len(v) != 1:
                    raise ValueError("only one prompt per request is supported")
                return v[0]
        elif v == "":
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _checks(self):
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def token_limit(self) -> int | None:
        return self.max_tokens


# ------------------------------------------------------------------------------ responses
class Usage(OpenAIBaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Stats(OpenAIBaseModel):
    """Our extension: how the generation went, draft included."""

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


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIBaseModel):
    content: list[TokenLogprob]


class CompletionLogprobs(OpenAIBaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = Field(default_factory=list)


class AssistantMessage(OpenAIBaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(OpenAIBaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: response_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    stats: Stats


class Delta(OpenAIBaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(OpenAIBaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    from_draft: bool | None = None


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    stats: Stats | None = None


class CompletionChoice(OpenAIBaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    from_draft: bool | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: response_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    stats: Stats | None = None


class ErrorBody(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorBody
