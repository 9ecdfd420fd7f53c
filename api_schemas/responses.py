"""OpenAI's Responses API (`POST /v1/responses`): the subset this server serves, with our
extensions (`from_draft` on text deltas, `stats` on the response) as documented extra fields.

Request fields follow the order of OpenAI's reference; fields we do not use (`user`,
`service_tier`, ...) are accepted and ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

from api_schemas.openai import (
    IMAGE_PART_TYPES,
    MIN_TEMPERATURE,
    EngineExtensions,
    OpenAIBaseModel,
    RequestModel,
    Stats,
)


def item_id(prefix: str) -> str:
    """`resp_...`, `msg_...`, `fc_...`: OpenAI's ids in the Responses API (an underscore)."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ------------------------------------------------------------------------------ input items
class InputText(RequestModel):
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(RequestModel):
    """A message item; `type` may be left out (OpenAI's "easy" input message)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v):
        for part in v if isinstance(v, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in IMAGE_PART_TYPES or kind == "input_file":
                raise PydanticCustomError("unsupported_input",
                                          "image and file input are not supported by this model")
        return v

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallInput(RequestModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None
    id: str | None = None
    status: str | None = None


class CustomToolCallInput(RequestModel):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    namespace: str | None = None
    id: str | None = None


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningInput(RequestModel):
    """An earlier turn's reasoning: listed by input_items; its text (`content`, as this server
    writes it) goes to the assistant turn after it, for templates that render reasoning."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None

    def text(self) -> str:
        return "".join(part.text for part in self.content or ())


class FunctionCallOutput(RequestModel):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


def _item_kind(item: Any) -> str | None:
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None)


def _input_item_kind(item: Any) -> str | None:
    kind = _item_kind(item)
    return "tool_output" if kind in ("function_call_output", "custom_tool_call_output") else kind


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallInput, Tag("function_call")]
    | Annotated[CustomToolCallInput, Tag("custom_tool_call")]
    | Annotated[FunctionCallOutput, Tag("tool_output")]
    | Annotated[ReasoningInput, Tag("reasoning")],
    Discriminator(_input_item_kind, custom_error_type="input_item",
                  custom_error_message="input items must be messages, function_call,"
                  " custom_tool_call, function_call_output, custom_tool_call_output or"
                  " reasoning items"),
]


# ------------------------------------------------------------------------------ tools, format
class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema object.")
    strict: bool | None = None


TOOL_NAME = r"^[A-Za-z0-9_.\-]+$"
# Tools OpenAI runs on its side: accepted (a client may list them), never offered to the model.
HOSTED_TOOL_TYPES = ("web_search", "web_search_preview", "web_search_preview_2025_03_11",
                     "web_search_2025_08_26", "file_search", "code_interpreter",
                     "image_generation", "mcp")


class CustomToolFormat(RequestModel):
    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None

    @model_validator(mode="after")
    def _grammar_given(self):
        if self.type == "grammar" and (self.syntax is None or not self.definition):
            raise ValueError("a grammar format needs 'syntax' and 'definition'")
        return self


class CustomTool(RequestModel):
    """A tool that takes free text (`input`), not JSON arguments."""

    type: Literal["custom"]
    name: str = Field(..., min_length=1, max_length=64, pattern=TOOL_NAME)
    description: str | None = None
    format: CustomToolFormat | None = Field(
        None, description="text (the default), or a grammar: shown to the model in the tool's"
        " description, not enforced.")


class NamespaceTool(RequestModel):
    """Function and custom tools grouped under a name; calls to them carry `namespace`."""

    type: Literal["namespace"]
    name: str = Field(..., min_length=1, max_length=64, pattern=TOOL_NAME)
    description: str = ""
    tools: list[Annotated[FunctionTool | CustomTool, Field(discriminator="type")]] = Field(
        ..., min_length=1, max_length=128)


class HostedTool(RequestModel):
    """A tool OpenAI would run (web search, file search, ...): accepted and not run."""

    type: Literal[HOSTED_TOOL_TYPES]  # type: ignore[valid-type]


def _tool_kind(tool: Any) -> str | None:
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    return "hosted" if kind in HOSTED_TOOL_TYPES else kind


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[CustomTool, Tag("custom")]
    | Annotated[NamespaceTool, Tag("namespace")] | Annotated[HostedTool, Tag("hosted")],
    Discriminator(_tool_kind, custom_error_type="tool",
                  custom_error_message="tools must be function, custom or namespace tools, or"
                  " hosted tools (" + ", ".join(HOSTED_TOOL_TYPES[:2]) + ", ...), which are"
                  " accepted and not run"),
]


class FunctionToolChoice(RequestModel):
    type: Literal["function", "custom"]
    name: str


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str = Field("response", max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("text.format json_schema needs a 'schema' object")
        return self


class TextConfig(RequestModel):
    format: TextFormat | None = None


# ------------------------------------------------------------------------------ the request
class ReasoningConfig(RequestModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="A thinking model: \"none\" asks its template not to think.")
    summary: str | None = Field(None, description="Accepted; this server writes no summaries.")


class ConversationRef(RequestModel):
    id: str = Field(..., max_length=256)


class _ResponsesFields(RequestModel):
    """OpenAI's request fields, in the order of its reference."""

    model: str | None = Field(None, max_length=1024)
    input: str | list[InputItem] = Field(..., description="Text, or a list of input items.")
    instructions: str | None = Field(
        None, description="A system message before the input (not carried over by"
        " previous_response_id).")
    include: list[str] | None = Field(
        None, max_length=16, description="`message.output_text.logprobs`: the output text's"
        " token log-probabilities (with `top_logprobs` alternatives); other values are accepted"
        " and ignored.")
    max_output_tokens: int | None = Field(
        None, ge=1, description="At most the model's context length minus the prompt's tokens.")
    metadata: dict[str, str] | None = Field(None, max_length=16)
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = Field(None, max_length=256)
    conversation: str | ConversationRef | None = Field(
        None, description="A conversation (POST /v1/conversations): its items come before the"
        " input, and the input and the output are added to it.")
    reasoning: ReasoningConfig | None = None
    store: bool = Field(True, description="Keep the response for GET and previous_response_id"
                        " (a bounded in-memory store: server.responses_store_size).")
    stream: bool = False
    background: bool | None = Field(
        None, description="Answer at once with a `queued` response and run it in the"
        " background: poll GET /v1/responses/{id}, cancel with POST /v1/responses/{id}/cancel"
        " (needs store). With stream: its events, which GET /v1/responses/{id}?stream=true"
        "&starting_after=N resumes.")
    temperature: float | None = Field(
        None, ge=0.0, le=2.0, description=f"0 (greedy) or at least {MIN_TEMPERATURE}.")
    text: TextConfig | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    top_logprobs: int | None = Field(None, ge=0, le=20, description="With `include`'s"
                                     " `message.output_text.logprobs`: the most likely"
                                     " tokens at each position.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description="auto: a conversation longer than the context loses its earliest"
        " exchanges (whole, from a user message on) instead of failing; disabled (the"
        " default): a 400.")

    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or ())


class ResponsesRequest(EngineExtensions, _ResponsesFields):
    """`POST /v1/responses`: OpenAI's fields, then our extensions."""

    @model_validator(mode="after")
    def _checks(self):
        if self.input == "" or self.input == [] and self.previous_response_id is None:
            raise ValueError("input must not be empty")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice needs 'tools'")
        if self.conversation is not None and self.previous_response_id is not None:
            raise ValueError("conversation and previous_response_id cannot both be given")
        if self.background and not self.store:
            raise ValueError("background needs store (true): its response is read with"
                             " GET /v1/responses/{id}")
        if self.tool_choice == "required" and not self.offers_tools():
            raise ValueError("tool_choice 'required' needs a function, custom or namespace tool"
                             " (hosted tools are not run here)")
        named = self.named_tool()
        kinds = {(t.type, t.name) for t in self.tools or () if t.type in ("function", "custom")}
        if named is not None and (self.tool_choice.type, named) not in kinds:
            raise ValueError(f"tool_choice names the {self.tool_choice.type} tool {named!r},"
                             " which is not in 'tools'")
        return self

    def named_tool(self) -> str | None:
        return self.tool_choice.name if isinstance(self.tool_choice, FunctionToolChoice) else None

    def conversation_id(self) -> str | None:
        if isinstance(self.conversation, ConversationRef):
            return self.conversation.id
        return self.conversation

    def offers_tools(self) -> bool:
        """Whether any tool is offered to the model (hosted tools are not)."""
        return any(t.type in ("function", "custom", "namespace") for t in self.tools or ())


class InputTokensRequest(ResponsesRequest):
    """`POST /v1/responses/input_tokens`: a response's request, counted instead of run."""

    input: str | list[InputItem] | None = Field(
        None, description="Text, or a list of input items; may be left out after a"
        " previous_response_id.")

    @model_validator(mode="after")
    def _something_to_count(self):
        if self.input is None and self.previous_response_id is None:
            raise ValueError("input or previous_response_id is required")
        return self


class InputTokenCount(OpenAIBaseModel):
    object: Literal["response.input_tokens"] = "response.input_tokens"
    input_tokens: int


# ------------------------------------------------------------------------------ the response
class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class OutputMessage(OpenAIBaseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: item_id("msg"))
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(OpenAIBaseModel):
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: item_id("fc"))
    call_id: str
    name: str
    arguments: str
    namespace: str | None = Field(None, description="The namespace tool it belongs to.")
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class CustomToolCallItem(OpenAIBaseModel):
    type: Literal["custom_tool_call"] = "custom_tool_call"
    id: str = Field(default_factory=lambda: item_id("ctc"))
    call_id: str
    name: str
    input: str
    namespace: str | None = Field(None, description="The namespace tool it belongs to.")
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = Field(0, description="Tokens written to a cache the client pays"
                                    " for: none here (the prefix cache keeps prompts unasked).")


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens"]


class ReasoningItem(OpenAIBaseModel):
    """A thinking model's reasoning (its text in `content`), or an input's reasoning item."""

    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: item_id("rs"))
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningText] | None = Field(None, exclude_if=lambda v: v is None)
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = Field(
        None, exclude_if=lambda v: v is None)


class ResponseObject(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: item_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]
    background: bool | None = None
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[ReasoningItem | OutputMessage | FunctionCallItem | CustomToolCallItem] = Field(
        default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    conversation: dict[str, str] | None = None
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    usage: ResponseUsage | None = None
    # --- extension (not in OpenAI's API) ---------------------------------------------------
    stats: Stats | None = Field(None, description="How the generation went, draft included.")


class InputMessageItem(OpenAIBaseModel):
    """A message of a response's input, as `GET /v1/responses/{id}/input_items` lists it."""

    type: Literal["message"] = "message"
    id: str
    status: Literal["completed"] = "completed"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[InputText]


class FunctionCallOutputItem(OpenAIBaseModel):
    type: Literal["function_call_output", "custom_tool_call_output"] = "function_call_output"
    id: str
    call_id: str
    output: str
    status: Literal["completed"] = "completed"


# An item a response was made from: its input, and the history that previous_response_id
# brought (earlier inputs, and earlier outputs as they were).
ResponseItem = (InputMessageItem | OutputMessage | FunctionCallItem | CustomToolCallItem
                | FunctionCallOutputItem | ReasoningItem)


class ResponseItemList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ResponseItem]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedResponse(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class ResponseStreamEvent(OpenAIBaseModel):
    """One event of a streamed response: `type` names it (response.created, ...,
    response.output_text.delta with our `from_draft`, response.completed); see OpenAI's docs."""

    type: str
    sequence_number: int


# ------------------------------------------------------------------------------ conversations
class ConversationCreate(RequestModel):
    items: list[InputItem] | None = Field(None, max_length=20, description="Its first items.")
    metadata: dict[str, str] | None = Field(None, max_length=16)


class ConversationUpdate(RequestModel):
    metadata: dict[str, str] = Field(..., max_length=16)


class ConversationItemsCreate(RequestModel):
    items: list[InputItem] = Field(..., min_length=1, max_length=20)


class ConversationObject(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: item_id("conv"))
    object: Literal["conversation"] = "conversation"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    metadata: dict[str, str] = Field(default_factory=dict)


class ConversationDeleted(OpenAIBaseModel):
    id: str
    object: Literal["conversation.deleted"] = "conversation.deleted"
    deleted: bool = True
