"""Bodies of the tokenizer endpoints, in vLLM's shape (`/tokenize`, `/detokenize`,
`/tokenizer_info`): the shape lm-evaluation-harness's remote tokenizer and other tools speak."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from api_schemas.openai import (
    ChatMessage,
    ChatRendering,
    OpenAIBaseModel,
    RequestModel,
    ToolDefinition,
)


class TokenizeRequest(ChatRendering):
    """A raw `prompt` (as `/v1/completions` tokenizes it), or chat `messages` (and `tools`),
    tokenized as `/v1/chat/completions` prefills them."""

    model: str | None = Field(None, max_length=1024)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    add_special_tokens: bool = Field(
        True, description="`prompt` only: add the tokenizer's special tokens (its BOS).")
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="`messages` only: variables for the chat template.")

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of 'prompt' and 'messages'")
        if self.tools is not None and self.messages is None:
            raise ValueError("'tools' needs 'messages'")
        return self

    def template_kwargs(self) -> dict:
        return dict(self.chat_template_kwargs or {})

    def active_tools(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = Field(None, max_length=1024)
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class TokenizerInfo(OpenAIBaseModel):
    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    model_max_length: int | None
    chat_template: str | None
