"""llama.cpp server's native `POST /completion` and `POST /infill` (what llama.vscode and
llama.vim send for code completion): the subset this server serves. Fields it does not use
(`n_indent`, `t_max_prompt_ms`, `samplers`, `mirostat`, ...) are accepted and ignored; our
extensions are accepted as in the other APIs."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from api_schemas.openai import EngineExtensions, RequestModel


class ExtraChunk(RequestModel):
    text: str = ""
    filename: str = Field("tmp", max_length=4096)


class _LlamaCppGeneration(EngineExtensions):
    model: str | None = Field(None, max_length=1024)
    n_predict: int = Field(-1, ge=-1, description="Tokens to write; -1: up to the context; 0:"
                           " only prefill the prompt into the prefix cache (a warm-up).")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-1, lt=2**64, description="-1: random.")
    stop: list[str] | None = Field(None, max_length=4, description="Up to 4, as in the other"
                                   " APIs here.")
    stream: bool = False


class CompletionNativeRequest(_LlamaCppGeneration):
    prompt: str | list[int] = Field(..., description="Text (special tokens in it are read as"
                                    " such) or token ids.")


class InfillRequest(_LlamaCppGeneration):
    input_prefix: str = Field("", description="The code before the cursor.")
    input_suffix: str = Field("", description="The code after it.")
    input_extra: list[ExtraChunk] = Field(
        default_factory=list, max_length=256,
        description="More context, each {text, filename}: other files, recent edits.")
    prompt: str = Field("", description="Text added after the prefix (the line so far).")


class LlamaCppAnswer(BaseModel):
    """What `/completion` and `/infill` answer: one object, or with `"stream": true` one SSE
    event per piece of text (`stop: false`), then the whole object (`stop: true`, empty
    `content`, the counts and timings); no `[DONE]`."""

    model_config = ConfigDict(extra="allow")

    index: int = 0
    content: str
    stop: bool
    from_draft: bool | None = Field(None, description="A streamed piece: whether the draft"
                                    " proposed it.")
    model: str | None = None
    tokens_predicted: int | None = None
    tokens_evaluated: int | None = None
    stop_type: str | None = Field(None, description="`eos`, `word` or `limit`.")
    timings: dict | None = None
