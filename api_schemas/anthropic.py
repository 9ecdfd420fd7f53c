"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): the subset
this server serves, with our extensions (`from_draft` on text deltas, `stats` on the message)
as documented extra fields. Fields we do not use (`service_tier`, `cache_control` on blocks,
...) are accepted and ignored.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from api_schemas.openai import EngineExtensions, OpenAIBaseModel, RequestModel, Stats

# The most stop sequences a request may send (the engine's matcher is the chat path's).
MAX_STOP_SEQUENCES = 4


def message_id(prefix: str = "msg") -> str:
    """`msg_...` and `toolu_...`, as Anthropic's ids look."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# ------------------------------------------------------------------------------ content blocks
class TextBlock(RequestModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(RequestModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(block.text for block in self.content)
        return self.content or ""


class ThinkingBlock(RequestModel):
    """An earlier assistant turn's reasoning (`thinking` or `redacted_thinking`): accepted and
    left out of the prompt, as Anthropic leaves earlier turns' thinking out of the context."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


def _block_kind(block: Any) -> str | None:
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    return "thinking" if kind == "redacted_thinking" else kind


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")],
    Discriminator(_block_kind, custom_error_type="content_block",
                  custom_error_message="content blocks must be text, tool_use, tool_result or"
                  " (in assistant turns) thinking (image and document input are not"
                  " supported)"),
]


class InputMessage(RequestModel):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    @model_validator(mode="after")
    def _blocks_fit_the_role(self):
        blocks = [] if isinstance(self.content, str) else self.content
        if self.role == "system" and any(not isinstance(b, TextBlock) for b in blocks):
            raise ValueError("a system message holds text blocks only")
        if self.role != "assistant" and any(isinstance(b, ThinkingBlock) for b in blocks):
            raise ValueError("thinking blocks belong to assistant messages")
        return self

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content if isinstance(b, TextBlock))


# ------------------------------------------------------------------------------ tools
class Tool(RequestModel):
    type: Literal["custom"] | None = None
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    input_schema: dict[str, Any] = Field(..., description="A JSON schema object.")


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice needs 'name' exactly when its type is 'tool'")
        return self


class OutputFormat(RequestModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(..., alias="schema")


class OutputConfig(RequestModel):
    """Structured output (`format`); `effort` is accepted and ignored."""

    format: OutputFormat | None = None


# ------------------------------------------------------------------------------ the requests
class ThinkingConfig(RequestModel):
    """A thinking model: "disabled" asks its template not to think; "enabled" and "adaptive"
    let it, "enabled" within `budget_tokens` of reasoning (then it must close it)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)


class CountTokensRequest(RequestModel):
    """The prompt of a request: what `/v1/messages/count_tokens` counts."""

    model: str = Field(..., max_length=1024)
    messages: list[InputMessage] = Field(..., min_length=1)
    system: str | list[TextBlock] | None = None
    thinking: ThinkingConfig | None = None
    tool_choice: ToolChoice | None = None
    tools: list[Tool] | None = Field(None, max_length=128)

    @model_validator(mode="after")
    def _tools_checks(self):
        if self.tool_choice is not None and self.tool_choice.type != "none" and not self.tools:
            raise ValueError("tool_choice needs 'tools'")
        named = self.tool_choice.name if self.tool_choice else None
        if named is not None and named not in {t.name for t in self.tools}:
            raise ValueError(f"tool_choice names {named!r}, which is not in 'tools'")
        return self

    @model_validator(mode="after")
    def _prefill(self):
        final = self.messages[-1]
        if final.role == "assistant" and final.text() != final.text().rstrip():
            raise ValueError("final assistant content cannot end with trailing whitespace")
        return self

    def system_text(self) -> str | None:
        if isinstance(self.system, list):
            return "\n\n".join(block.text for block in self.system)
        return self.system


class _MessagesFields(CountTokensRequest):
    """Anthropic's generation fields, in the order of its reference."""

    max_tokens: int = Field(..., ge=1, description="At most the model's context length minus"
                            " the prompt's tokens.")
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, description="Keep the k most likely tokens; 0 = off;"
                              " at most the vocabulary size.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)


class MessagesRequest(EngineExtensions, _MessagesFields):
    """`POST /v1/messages`: Anthropic's fields, then our extensions."""

    @field_validator("stop_sequences")
    @classmethod
    def _no_empty_stop(cls, v):
        if v and any(not s for s in v):
            raise ValueError("stop sequences must not be empty")
        return v


# ------------------------------------------------------------------------------ the response
class TextContent(OpenAIBaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingContent(OpenAIBaseModel):
    """A thinking model's reasoning (`signature` is empty: nothing here is encrypted)."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseContent(OpenAIBaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(OpenAIBaseModel):
    """Anthropic's split: `input_tokens` were prefilled, `cache_read_input_tokens` came from the
    prefix cache; their sum is the prompt."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(OpenAIBaseModel):
    id: str = Field(default_factory=message_id)
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingContent | TextContent | ToolUseContent] = Field(default_factory=list)
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None = None
    stop_sequence: str | None = None
    usage: MessageUsage
    # --- extension (not in Anthropic's API) ------------------------------------------------
    stats: Stats | None = Field(None, description="How the generation went, draft included.")


class TokenCount(OpenAIBaseModel):
    input_tokens: int


class MessageStreamEvent(OpenAIBaseModel):
    """One event of a streamed message: `type` names it (message_start, content_block_start,
    content_block_delta with our `from_draft` on text deltas, ..., message_delta with our
    `stats`, message_stop, ping); see Anthropic's docs."""

    type: str


class ModelInfo(OpenAIBaseModel):
    """Anthropic's model object (`GET /v1/models` from an Anthropic client), plus our `role` and
    `path`."""

    type: Literal["model"] = "model"
    id: str
    display_name: str
    created_at: str = Field(description="When this server loaded it (RFC 3339).")
    max_input_tokens: int | None = Field(None, description="The model's context length.")
    lifecycle: Literal["active", "deprecated", "retired"] = "active"
    role: Literal["target", "draft", "embedding", "standby"] = Field(
        description="standby: one of `models.more_targets`, served once a request names it.")
    path: str


class ModelInfoList(OpenAIBaseModel):
    data: list[ModelInfo]
    first_id: str | None
    last_id: str | None
    has_more: bool = False


class AnthropicErrorBody(OpenAIBaseModel):
    type: str
    message: str


class AnthropicError(OpenAIBaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorBody


# ------------------------------------------------------------------------------ message batches
class BatchRequest(RequestModel):
    custom_id: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    params: dict[str, Any] = Field(..., description="A `POST /v1/messages` body (no stream).")


class MessageBatchCreate(RequestModel):
    requests: list[BatchRequest] = Field(..., min_length=1, max_length=100_000)


class MessageBatchRequestCounts(OpenAIBaseModel):
    processing: int = 0
    succeeded: int = 0
    errored: int = 0
    canceled: int = 0
    expired: int = 0


class MessageBatch(OpenAIBaseModel):
    id: str
    type: Literal["message_batch"] = "message_batch"
    processing_status: Literal["in_progress", "canceling", "ended"]
    request_counts: MessageBatchRequestCounts
    ended_at: str | None = None
    created_at: str
    expires_at: str
    archived_at: str | None = None
    cancel_initiated_at: str | None = None
    results_url: str | None = Field(None, description="Once ended: where its results are.")


class MessageBatchList(OpenAIBaseModel):
    data: list[MessageBatch]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class DeletedMessageBatch(OpenAIBaseModel):
    id: str
    type: Literal["message_batch_deleted"] = "message_batch_deleted"
