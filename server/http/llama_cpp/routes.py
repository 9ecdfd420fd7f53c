"""llama.cpp server's native `POST /completion`, and `POST /infill`: fill in the middle with
extra context, for the editors' code completion that speaks it (llama.vscode, llama.vim). The
infill prompt is llama.cpp's (`server/http/llama_cpp/infill.py`); both answer in
`/completion`'s shape (`content`, `stop`, `stop_type`, `tokens_predicted`, `timings`, ...)
with our `stats`, or with `stream` SSE chunks of `content`, the last with `"stop": true`.
`n_predict: 0` (llama.vim's warm-up of its extra context) prefills the prompt into the prefix
cache and writes nothing: one token is computed and dropped (`stats` counts it)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Depends, Request

from api_schemas.llama_cpp import CompletionNativeRequest, InfillRequest
from api_schemas.openai import CompletionRequest
from server.engine import supported_markers, text_tokens
from server.http.common.auth import require_api_key
from server.http.common.bodies import OffLoopJson
from server.http.common.completion import complete, each_choice
from server.http.common.errors import APIError
from server.http.common.request_mapping import check_token_ids
from server.http.llama_cpp.format import InfillFormat
from server.http.llama_cpp.infill import infill_tokens

router = APIRouter(dependencies=[Depends(require_api_key)], tags=["llama.cpp"],
                   route_class=OffLoopJson)
UNKNOWN_CONTEXT = 4096  # a model whose config gives no context length


@router.post("/infill", summary="llama.cpp's fill in the middle (llama.vscode, llama.vim)")
async def infill(body: InfillRequest, request: Request):
    def prompt(engine) -> list[int]:
        fim = engine.target.fim
        if fim is None:
            raise APIError(400, "infill needs a model trained to fill in the middle, whose"
                           " vocabulary has the markers of one of these formats: "
                           f"{supported_markers()}; this one has none", param="input_prefix")
        return infill_tokens(body, fim, engine.tokenizer,
                             engine.context_length or UNKNOWN_CONTEXT)

    return await _generate(request, body, prompt)


@router.post("/completion", summary="llama.cpp's native completion")
async def completion(body: CompletionNativeRequest, request: Request):
    def prompt(engine) -> list[int]:
        if isinstance(body.prompt, list):
            check_token_ids(engine.target.vocab_size, body.prompt, "prompt")
            tokens = list(body.prompt)
        else:
            tokens = text_tokens(engine.tokenizer, body.prompt)
        if not tokens:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return tokens

    return await _generate(request, body, prompt)


async def _generate(request: Request, body, prompt: Callable[[object], list[int]]):
    """Run `body` as the text completion it is (its fields' limits are the same) on the prompt
    `prompt(engine)` gives, tokenized for the target that serves it."""
    warm_up = body.n_predict == 0  # llama.vim's: only fill the cache with the prompt
    engine = request.app.state.engine

    def tokenize(engine):
        tokens = prompt(engine)
        return CompletionRequest.model_validate({
            "prompt": tokens, "stream": body.stream, "stop": body.stop or None,
            "max_tokens": 1 if warm_up else body.n_predict if body.n_predict > 0 else None,
            "temperature": body.temperature, "top_p": body.top_p,
            "seed": None if body.seed in (None, -1) else body.seed, **body.extensions()}), [tokens]

    return await complete(
        request, body, tokenize,
        each_choice(lambda: InfillFormat(engine.model_name, engine.tokenizer, hide=warm_up)),
        fill_context=body.n_predict < 0)
