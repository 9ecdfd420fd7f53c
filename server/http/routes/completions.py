"""POST /v1/chat/completions and /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from api_schemas.openai import ChatCompletionRequest, CompletionRequest
from server.http.auth import require_api_key
from server.http.completion import complete, complete_chat
from server.http.request_mapping import check_model_name, completion_prompt
from server.http.streaming import ChatFormat, TextFormat

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], tags=["completions"])


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    engine = request.app.state.engine
    return await complete_chat(
        request, body, lambda tools, _: ChatFormat(engine.model_name, engine.tokenizer, tools))


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request):
    engine = request.app.state.engine
    check_model_name(engine, body.model)
    fmt = TextFormat(engine.model_name, engine.tokenizer)
    return await complete(request, body, completion_prompt(engine, body), fmt)
