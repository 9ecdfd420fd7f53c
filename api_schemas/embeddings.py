"""`POST /v1/embeddings`, in OpenAI's shape."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from api_schemas.openai import OpenAIBaseModel, RequestModel, one_or_many

MAX_INPUTS = 2048  # OpenAI's limit per request


class EmbeddingRequest(RequestModel):
    model: str | None = Field(None, max_length=1024)
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="A text, a list of texts, a list of token ids, or a list of those;"
        f" at most {MAX_INPUTS} inputs, none empty.")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(
        None, ge=1, description="Keep the first this-many components (normalized again).")
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _inputs(cls, v):
        inputs = one_or_many(v)
        if len(inputs) > MAX_INPUTS:
            raise ValueError(f"at most {MAX_INPUTS} inputs per request")
        if any(len(i) == 0 for i in inputs):
            raise ValueError("an input must not be empty")
        return v

    def inputs(self) -> list[str | list[int]]:
        return one_or_many(self.input)


class Embedding(OpenAIBaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="Floats, or base64 of little-endian"
                                         " float32 with encoding_format base64.")


class EmbeddingUsage(OpenAIBaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
