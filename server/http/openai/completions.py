"""POST /v1/chat/completions and /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from api_schemas.openai import ChatCompletionRequest, CompletionRequest
from server.http.common.auth import require_api_key
from server.http.common.completion import complete_chat, plan, run
from server.http.common.request_mapping import completion_prompt, serving
from server.http.common.streaming import ChatFormat, Echo, TextFormat

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], tags=["completions"])


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    engine = request.app.state.engine
    return await complete_chat(
        request, body,
        lambda tools, start: ChatFormat(engine.model_name, engine.tokenizer, tools, start))


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request):
    engine = request.app.state.engine
    async with serving(engine, body.model):
        target = engine.target.fingerprint  # what the prompts are tokenized for
        given = body.prompts()
        prompts = [completion_prompt(engine, prompt, body.suffix) for prompt in given]
        params = plan(request, body, prompts, target)
        formats = []
        for text, tokens in zip(given, prompts, strict=True):
            echo = await _echo(engine, body, text, tokens, target) if body.echo else None
            formats += [TextFormat(engine.model_name, engine.tokenizer, echo)
                        for _ in range(body.n)]
        return await run(request, body, params, formats)


async def _echo(engine, body: CompletionRequest, given: str | list[int],
                tokens: list[int], target: str) -> Echo:
    """The prompt as it was sent (ids decoded), scored when `logprobs` is asked."""
    text = given if isinstance(given, str) else engine.tokenizer.decode(tokens)
    scores = None
    if body.logprobs is not None:
        scores = await engine.prompt_logprobs(tokens, body.logprobs, target=target,
                                              cache_prompt=body.cache_prompt is not False)
    return Echo(text, tokens, scores)
