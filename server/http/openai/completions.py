"""POST /v1/chat/completions and /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from api_schemas.openai import ChatCompletionRequest, CompletionRequest
from server.http.common.auth import require_api_key
from server.http.common.bodies import OffLoopJson
from server.http.common.completion import complete, complete_chat
from server.http.common.request_mapping import completion_prompt
from server.http.openai.format import ChatFormat, Echo, TextFormat

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], tags=["completions"],
                   route_class=OffLoopJson)


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    engine = request.app.state.engine
    return await complete_chat(
        request, body,
        lambda tools, start: ChatFormat(engine.model_name, engine.tokenizer, tools, start))


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request):
    given = body.prompts()

    def tokenize(engine):
        return body, [completion_prompt(engine, prompt, body.suffix) for prompt in given]

    async def formats(engine, body, prompts, target):
        out = []
        for text, tokens in zip(given, prompts, strict=True):
            echo = await _echo(engine, body, text, tokens, target) if body.echo else None
            out += [TextFormat(engine.model_name, engine.tokenizer, echo) for _ in range(body.n)]
        return out

    return await complete(request, body, tokenize, formats)


async def _echo(engine, body: CompletionRequest, given: str | list[int],
                tokens: list[int], target: str) -> Echo:
    """The prompt as it was sent (ids decoded), scored when `logprobs` is asked."""
    text = given if isinstance(given, str) else engine.tokenizer.decode(tokens)
    scores = None
    if body.logprobs is not None:
        scores = await engine.prompt_logprobs(tokens, body.logprobs, target=target,
                                              cache_prompt=body.cache_prompt is not False)
    return Echo(text, tokens, scores)
