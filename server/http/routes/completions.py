"""POST /v1/chat/completions and /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from api_schemas.openai import ChatCompletionRequest, CompletionRequest
from server.http.auth import require_api_key
from server.http.request_mapping import (
    chat_prompt,
    check_model_name,
    completion_prompt,
    generation_params,
)
from server.http.streaming import ChatFormat, TextFormat, collect, stream_response
from server.http.tools import parser_factory

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], tags=["completions"])


async def _complete(request: Request, body, prompt: list[int], fmt):
    state = request.app.state
    params = generation_params(body, prompt, state.engine, state.settings.defaults)
    job = state.engine.submit(params)
    endpoint = request.url.path

    def observe(done):
        state.metrics.observe(endpoint, done.finish_reason, done.stats)

    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return await stream_response(job, fmt, usage, observe)
    return await collect(job, fmt, observe, request.is_disconnected)


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    engine = request.app.state.engine
    check_model_name(engine, body.model)
    tools = parser_factory(engine.tokenizer, body.active_tools(),
                           forced=body.forced_functions() is not None)
    fmt = ChatFormat(engine.model_name, engine.tokenizer, tools)
    return await _complete(request, body, chat_prompt(engine, body), fmt)


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request):
    engine = request.app.state.engine
    check_model_name(engine, body.model)
    fmt = TextFormat(engine.model_name, engine.tokenizer)
    return await _complete(request, body, completion_prompt(engine, body), fmt)
