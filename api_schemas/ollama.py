"""Ollama's API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`,
`/api/embed`, `/api/version`): the subset this server serves, for the apps that speak Ollama.
Our extensions (`num_draft_tokens`, `draft`, ...) are accepted at the top level as in the other
APIs; answers add `from_draft` to each streamed line and `stats` to the last. OllamaOptions and
fields that do not apply to MLX (`num_ctx`, `num_gpu`, `keep_alive`, ...) are accepted and
ignored, as Ollama ignores the options a model does not use.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api_schemas.openai import EngineExtensions, RequestModel

# The Ollama version whose API this follows (`GET /api/version`; clients compare it).
OLLAMA_API_VERSION = "0.12.6"


class OllamaOptions(RequestModel):
    """The options that change generation; any other option is accepted and ignored."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    num_predict: int | None = Field(
        None, ge=-2, description="Tokens to generate; -1 or -2 (or none): up to the end of the"
        " context.")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: list[str] | None = Field(None, max_length=4)
    repeat_penalty: float | None = Field(None, ge=0.01, le=10.0)
    repeat_last_n: int | None = Field(None, ge=-1, description="0: off; -1: the whole context.")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)


class OllamaCallFunction(RequestModel):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(RequestModel):
    function: OllamaCallFunction


class OllamaMessage(RequestModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None
    images: list[str] | None = Field(None, description="Not supported: a 400 when not empty.")
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None


class _OllamaGeneration(EngineExtensions):
    model: str = Field(min_length=1, max_length=1024)
    format: Literal["", "json"] | dict[str, Any] | None = Field(
        None, description='"json": a JSON object; a JSON schema: an object that follows it.')
    options: OllamaOptions | None = None
    stream: bool = True
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    keep_alive: float | str | None = Field(None, description="Accepted and ignored: the"
                                           " models stay loaded.")


class OllamaChatRequest(_OllamaGeneration):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    truncate: bool | None = Field(
        None, description="A chat longer than the context loses its earliest exchanges (the"
        " default, as in Ollama); false: a 400.")


class OllamaGenerateRequest(_OllamaGeneration):
    prompt: str = ""
    suffix: str | None = Field(None, description="Fill in the middle (code models with FIM"
                               " tokens): the text after the completion.")
    system: str | None = None
    raw: bool = False
    images: list[str] | None = Field(None, description="Not supported: a 400 when not empty.")
    template: str | None = Field(None, description="Not supported: a 400 when set.")
    context: list[int] | None = Field(None, description="Not supported (deprecated by Ollama):"
                                      " a 400 when set.")


class OllamaShowRequest(RequestModel):
    model: str | None = Field(None, max_length=1024)
    name: str | None = Field(None, max_length=1024, description="Older clients' `model`.")
    verbose: bool | None = None


class OllamaEmbedRequest(RequestModel):
    model: str = Field(min_length=1, max_length=1024)
    input: str | list[str]
    truncate: bool | None = None
    dimensions: int | None = Field(None, ge=1)
    options: OllamaOptions | None = None
    keep_alive: float | str | None = None


class OllamaError(BaseModel):
    """Ollama's error body."""

    error: str


class OllamaAnswer(BaseModel):
    """What `/api/chat` and `/api/generate` answer: one object, or with `"stream": true` one
    per line (`done: false` while the text comes, then `done: true` with the counts)."""

    model_config = ConfigDict(extra="allow")

    model: str
    created_at: str
    done: bool
