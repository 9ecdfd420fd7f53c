"""Request and response bodies of the OpenAI API, with our extensions fenced below them.

Request fields follow the order of OpenAI's docs. A field left out is None here; the server's
settings supply the default, so each default lives in one place.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError


def response_id(prefix: str) -> str:
    """A completion's id, `chatcmpl-...` or `cmpl-...` (24 hex digits, as OpenAI's): the one
    place ids are made, for collected responses and for every chunk of a stream."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class OpenAIBaseModel(BaseModel):
    # Clients send fields we do not use (user, metadata, store, ...): accept and ignore them.
    model_config = ConfigDict(extra="ignore")


class RequestModel(OpenAIBaseModel):
    """A request body: strict JSON types (`"n": "1"`, `"stream": "yes"` are 400s, as at OpenAI)
    and finite numbers only (Python's JSON parser would let `NaN` and `Infinity` through)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        # JSON's "\ud800" decodes to a lone surrogate, which no tokenizer or UTF-8 encoder takes.
        where = _lone_surrogate(data)
        if where is not None:
            raise ValueError(f"strings must be valid Unicode: a lone surrogate in {where}")
        return data


def _lone_surrogate(data) -> str | None:
    """The dotted path of a string holding a lone UTF-16 surrogate, or None.

    A loop, not recursion: bodies nest as deep as the JSON parser allows."""
    stack = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path or "body"
        elif isinstance(value, dict):
            if any(_SURROGATE.search(str(k)) for k in value):
                return f"{path or 'body'} (a key)"
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}" if path else str(i), v) for i, v in enumerate(value))
    return None


_SURROGATE = re.compile("[\ud800-\udfff]")

# Below this a temperature's 1/T overflows float32 and sampling returns garbage: a 400.
MIN_TEMPERATURE = 1e-5
# OpenAI sends this for a token the model gives no probability (log 0 = -inf is not JSON).
LOGPROB_FLOOR = -9999.0
_TOKEN_ID = re.compile(r"^[0-9]{1,10}$")
# At most this many choices in one response (`n` times the prompts), OpenAI's bound on `n`.
MAX_CHOICES = 128


def _json_logprob(value: float) -> float:
    if math.isfinite(value):
        return value
    return 0.0 if value > 0 else LOGPROB_FLOOR  # -inf and NaN: "no probability"


LogProb = Annotated[float, PlainSerializer(_json_logprob, return_type=float)]


class StreamOptions(RequestModel):
    include_usage: bool = False


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


IMAGE_PART_TYPES = ("image_url", "input_image", "image")


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str = Field(description="The arguments as a JSON string.")


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant's earlier calls.")
    tool_call_id: str | None = Field(None, description="The call a `tool` message answers.")
    reasoning_content: str | None = Field(
        None, description="An assistant turn's reasoning, for templates that render it.")
    reasoning: str | None = Field(None, description="The same, as vLLM and mlx_lm name it.")

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v):
        for part in v if isinstance(v, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in IMAGE_PART_TYPES:
                raise PydanticCustomError("image_input",
                                          "image input is not supported by this model")
            if isinstance(kind, str) and kind != "text":
                raise PydanticCustomError("content_part", "content part type '{kind}' is not "
                                          "supported; send text", {"kind": kind[:40]})
        return v

    @model_validator(mode="after")
    def _tool_answers_a_call(self):
        if self.role == "tool" and not self.tool_call_id:
            raise PydanticCustomError(
                "missing_tool_call_id",
                "a 'tool' message needs tool_call_id: the id of the assistant's tool call it "
                "answers")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def template_dict(self) -> dict:
        """The message as chat templates and `server.http.common.tools` take it."""
        out = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        reasoning = self.reasoning_content or self.reasoning
        if reasoning and self.role == "assistant":
            out["reasoning_content"] = reasoning
        return out


class FunctionDefinition(RequestModel):
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema object.")
    strict: bool | None = None


class ToolDefinition(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName


class JSONSchemaSpec(RequestModel):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format json_schema needs a 'json_schema' object")
        return self


NonNegInt = Annotated[int, Field(ge=0)]


def _documented(json_type: str, **keywords):
    """json_schema_extra: add what a validator below enforces to the `json_type` branch of an
    optional field's schema, so the OpenAPI document describes what is accepted."""

    def patch(schema: dict) -> None:
        for branch in schema.get("anyOf", [schema]):
            if branch.get("type") == json_type:
                branch.update(keywords)

    return patch


MAX_GRAMMAR_CHARS = 65_536
MAX_CHOICE_OPTIONS = 256


class StructuredOutputs(RequestModel):
    """vLLM's `structured_outputs`: a grammar the whole output follows, exactly one of these."""

    json_: dict[str, Any] | None = Field(None, alias="json", description="A JSON schema.")
    json_object: bool | None = Field(None, description="true: any JSON object.")
    regex: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS,
                              description="A regular expression the whole output matches.")
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, min_length=1, max_length=MAX_CHOICE_OPTIONS,
        description="The output is exactly one of these strings.")
    grammar: str | None = Field(
        None, min_length=1, max_length=MAX_GRAMMAR_CHARS,
        description="A Lark grammar in llguidance's dialect (rule `start`; `%json {schema}`"
        " embeds a JSON schema), or llama.cpp's GBNF (rule `root`).")

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [name for name in ("json_", "json_object", "regex", "choice", "grammar")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, json_object, regex,"
                             " choice and grammar")
        return self


class EngineExtensions(RequestModel):
    """Our extensions (not in OpenAI's or Anthropic's API), the same in every generation API.
    llama.cpp's `grammar` (GBNF) and `json_schema` are read as `structured_outputs`."""

    @model_validator(mode="before")
    @classmethod
    def _llama_cpp_grammar(cls, data):
        if not isinstance(data, dict) or not ({"grammar", "json_schema"} & data.keys()):
            return data
        data = dict(data)
        given = {name: data.pop(name) for name in ("grammar", "json_schema") if name in data}
        given = {name: value for name, value in given.items() if value is not None}
        if not given:
            return data
        if len(given) > 1 or data.get("structured_outputs") is not None:
            raise ValueError("grammar, json_schema (llama.cpp's) and structured_outputs are"
                             " ways to give one grammar: send one of them")
        [(name, value)] = given.items()
        data["structured_outputs"] = {"grammar" if name == "grammar" else "json": value}
        return data

    num_draft_tokens: NonNegInt | None = Field(
        None, le=64, description="Draft tokens per round (the maximum when adaptive); 0 = off."
    )
    use_draft: bool | None = Field(None, description="Default: true when a drafter is loaded.")
    draft: Literal["model", "prompt_lookup", "hybrid", "suffix"] | None = Field(
        None, description="Where drafts come from: the draft model, prompt lookup, suffix (what"
        " this server served before, and the request's own text), or hybrid (each round the one"
        " of prompt lookup (after a match of hybrid_min_match tokens), suffix and the draft"
        " model expected to have the most tokens accepted)."
    )
    acceptance: Literal["exact", "rejection"] | None = Field(
        None, description="Acceptance rule at temperature > 0."
    )
    adaptive: bool | None = Field(None, description="Adapt the draft length per round.")
    draft_p_min: float | None = Field(
        None, ge=0.0, le=1.0, description="Stop drafting a round below this draft probability."
    )
    hybrid_min_match: int | None = Field(
        None, ge=1, le=3, description="Hybrid drafts by prompt lookup only where the last"
        " this-many tokens occurred before (1-3); elsewhere the draft model drafts."
    )
    top_k: NonNegInt | None = Field(
        None, description="Keep the k most likely tokens; 0 = off; at most the vocabulary size."
    )
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=0.01, le=10.0)
    repetition_context_size: int | None = Field(
        None, ge=1, le=1_000_000, description="mlx_lm's: the tokens repetition_penalty looks"
        " back over (default 20).")
    presence_context_size: int | None = Field(
        None, ge=1, le=1_000_000, description="mlx_lm's: the same for presence_penalty.")
    frequency_context_size: int | None = Field(
        None, ge=1, le=1_000_000, description="mlx_lm's: the same for frequency_penalty.")
    xtc_probability: float | None = Field(
        None, ge=0.0, le=1.0, description="mlx_lm's XTC (exclude top choices): the chance that"
        " a step drops every token above xtc_threshold but the least likely of them.")
    xtc_threshold: float | None = Field(None, ge=0.0, le=0.5, description="mlx_lm's XTC"
                                        " threshold (default 0.1).")
    ignore_eos: bool | None = Field(None, description="vLLM's: never stop at EOS.")
    cache_prompt: bool | None = Field(
        None, description="llama.cpp's: reuse (and store) the prefix cache; default true."
    )
    min_tokens: NonNegInt | None = Field(
        None, le=1_000_000, description="vLLM's: EOS and stop strings wait this many tokens."
    )
    stop_token_ids: list[NonNegInt] | None = Field(
        None, max_length=64, description="vLLM's: tokens that end the output as EOS does.")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's: the output follows a JSON schema, a regular expression, one"
        " of a list of strings, or a Lark grammar.")
    priority: int | None = Field(
        None, ge=-1_000_000, le=1_000_000, description="vLLM's: when requests wait for a batch"
        " slot, the lowest priority goes first, then the oldest (default 0; a batch's requests:"
        " 1, after the others).")

    def extensions(self) -> dict:
        """The extension fields this request set, to pass on to a chat completion request."""
        return self.model_dump(include=set(EngineExtensions.model_fields), exclude_none=True,
                               by_alias=True)


class _OpenAISampling(RequestModel):
    """OpenAI's fields shared by chat and text completions, in the order of its docs."""

    model: str | None = Field(None, max_length=1024)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra=_documented(
        "object", propertyNames={"pattern": _TOKEN_ID.pattern},
        additionalProperties={"type": "number", "minimum": -100, "maximum": 100}))
    max_tokens: int | None = Field(
        None, ge=1, description="At most the model's context length minus the prompt's tokens."
    )
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="Choices to generate for each prompt.")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = Field(
        None, json_schema_extra=_documented("array", maxItems=4))
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(
        None, ge=0.0, le=2.0, description=f"0 (greedy) or at least {MIN_TEMPERATURE}.",
        json_schema_extra=_documented("number", anyOf=[{"const": 0},
                                                       {"minimum": MIN_TEMPERATURE}]),
    )
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    user: str | None = None


class SamplingRequest(EngineExtensions, _OpenAISampling):
    """Chat and text completions: OpenAI's fields, then our extensions."""

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v):
        if v is not None and 0.0 < v < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return v

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
            if not _TOKEN_ID.fullmatch(key):
                raise ValueError(f"logit_bias keys must be token ids (digits), got {key[:20]!r}")
            if not -100 <= value <= 100:
                raise ValueError("logit_bias values must be in [-100, 100]")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class Prediction(RequestModel):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat (a file to edit)."""

    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content


class ChatRendering(RequestModel):
    """vLLM's switches for how `messages` are rendered (chat completions and `/tokenize`)."""

    add_generation_prompt: bool | None = Field(
        None, description="Open the assistant's turn after the messages (default true; false"
        " with continue_final_message).")
    continue_final_message: bool = Field(
        False, description="Continue the final message, an assistant's, instead of starting a"
        " new turn: an assistant prefill, as in Anthropic's API.")

    @model_validator(mode="after")
    def _final_message(self):
        if not self.continue_final_message:
            return self
        if self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be"
                             " true")
        messages = getattr(self, "messages", None)
        if not messages or messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs a final assistant message")
        return self

    def generation_prompt(self) -> bool:
        if self.add_generation_prompt is None:
            return not self.continue_final_message
        return self.add_generation_prompt


class ChatCompletionRequest(SamplingRequest, ChatRendering):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="A thinking model: \"none\" asks its template not to think; the"
        " others let it think (its template decides how much).")
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    prediction: Prediction | None = Field(
        None, description="A guess of the answer, which drafts it (the target still verifies"
        " every token); drafting must not be off.")
    reasoning_budget: NonNegInt | None = Field(
        None, description="A thinking model: end its reasoning after this many tokens (the"
        " end marker is then the only token allowed); Anthropic's `thinking.budget_tokens`.")
    # vLLM's and mlx_lm's extension: variables for the chat template (`enable_thinking`, ...).
    chat_template_kwargs: dict[str, Any] | None = None
    # Deprecated by OpenAI: refused with a 400 that names the replacement.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    @model_validator(mode="after")
    def _checks(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.functions is not None or self.function_call is not None:
            raise ValueError("'functions' and 'function_call' are deprecated and not supported: "
                             "send 'tools' and 'tool_choice' instead")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice needs 'tools'")
        named = self.named_tool()
        if named is not None and named not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names {named!r}, which is not in 'tools'")
        fmt = self.response_format
        if self.structured_outputs is not None and (
                self.forced_functions() is not None or fmt is not None and fmt.type != "text"):
            raise ValueError("structured_outputs cannot be combined with a response_format or a"
                             " forced tool call: one grammar holds the output")
        return self

    def template_kwargs(self) -> dict:
        """What the chat template is rendered with besides the messages and tools. A grammar
        holds the whole reply (structured output, a forced call), leaving no room to think:
        a thinking model is asked not to, unless the request says otherwise."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        if self.constrains_output():
            kwargs.setdefault("enable_thinking", False)
        return kwargs

    def constrains_output(self) -> bool:
        fmt = self.response_format
        return (self.forced_functions() is not None or (fmt is not None and fmt.type != "text")
                or self.structured_outputs is not None)

    def named_tool(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice,
                                                            NamedToolChoice) else None

    def active_tools(self) -> list[dict] | None:
        """The tools offered to the model (None with tool_choice "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def forced_functions(self) -> list[dict] | None:
        """The functions a call must be made to (tool_choice required or named), else None."""
        if not self.tools or self.tool_choice not in ("required",) and self.named_tool() is None:
            return None
        named = self.named_tool()
        return [t.function.model_dump(exclude_none=True) for t in self.tools
                if named is None or t.function.name == named]

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def one_or_many(value: str | list) -> list[str | list[int]]:
    """A text or token list, or a list of those (a prompt, an embedding input), as the list."""
    return list(value) if isinstance(value, list) and value and \
        isinstance(value[0], (str, list)) else [value]


class CompletionRequest(SamplingRequest):
    # One prompt (a string or token ids) or several (a list of either): a choice per prompt,
    # or `n` per prompt, prompt i's j-th at index i * n + j.
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    max_tokens: int | None = Field(
        None, ge=0, description="At most the model's context length minus the prompt's tokens;"
        " 0 (with echo) only scores the prompt.")
    suffix: str | None = Field(
        None, description="Fill in the middle: the text after the completion, the prompt being"
        " the text before it; for code models with fill-in-the-middle tokens.")

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        if len(one_or_many(v)) > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} prompts per request")
        return v

    @model_validator(mode="after")
    def _checks(self):
        if self.suffix and self.echo:
            raise ValueError("echo cannot be combined with suffix")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens may be 0 only with echo (to score the prompt)")
        if self.n * len(self.prompts()) > MAX_CHOICES:
            raise ValueError(f"n times the number of prompts may be at most {MAX_CHOICES}")
        return self

    def prompts(self) -> list[str | list[int]]:
        return one_or_many(self.prompt)

    def token_limit(self) -> int | None:
        return self.max_tokens


# ------------------------------------------------------------------------------ responses
class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(OpenAIBaseModel):
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(OpenAIBaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None, exclude_if=lambda v: v is None, description="With a `prediction`.")


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
    cached_tokens: int = Field(0, description="Prompt tokens reused from the prefix cache.")
    accepted_prediction_tokens: int | None = Field(
        None, exclude_if=lambda v: v is None,
        description="With a `prediction`: its tokens the answer took.")
    rejected_prediction_tokens: int | None = Field(
        None, exclude_if=lambda v: v is None,
        description="With a `prediction`: its tokens the answer did not take.")


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: LogProb
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIBaseModel):
    content: list[TokenLogprob]


class CompletionLogprobs(OpenAIBaseModel):
    """With `echo`, the prompt's tokens come first; its first token has no logprob (null)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[LogProb | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, LogProb] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


def _reasoning_field():
    return Field(None, exclude_if=lambda v: v is None,
                 description="A thinking model's reasoning (the same text in `reasoning`, as"
                 " vLLM and mlx_lm name it, and `reasoning_content`, as DeepSeek does).")


class AssistantMessage(OpenAIBaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning: str | None = _reasoning_field()
    reasoning_content: str | None = _reasoning_field()
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=lambda v: v is None)


class ToolCallDelta(ToolCall):
    index: int


class ChatChoice(OpenAIBaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str
    stats: Stats | None = Field(None, exclude_if=lambda v: v is None,
                                description="Of this choice, when a response has several.")


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: response_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    stats: Stats | None = Field(None, description="None when there are several choices: each"
                                " then has its own.")


class Delta(OpenAIBaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = _reasoning_field()
    reasoning_content: str | None = _reasoning_field()
    tool_calls: list[ToolCallDelta] | None = Field(None, exclude_if=lambda v: v is None)


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
    stats: Stats | None = Field(None, exclude_if=lambda v: v is None,
                                description="Of this choice, when a response has several.")


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
