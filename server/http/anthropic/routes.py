"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens. Errors under
/v1/messages leave in Anthropic's shape (server.http.common.errors)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request

from api_schemas.anthropic import CountTokensRequest, MessagesRequest, TokenCount
from server.http.anthropic.format import MessagesFormat
from server.http.anthropic.mapping import RENAMES, chat_from_messages
from server.http.common.auth import require_api_key
from server.http.common.bodies import OffLoopJson
from server.http.common.chat_translation import renamed_params
from server.http.common.completion import complete_chat
from server.http.common.request_mapping import chat_prompt, serving

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], tags=["messages"],
                   route_class=OffLoopJson)


@router.post("/messages")
async def create_message(body: MessagesRequest, request: Request):
    engine = request.app.state.engine

    def make_format(tools, start):
        return MessagesFormat(engine.model_name, engine.tokenizer, tools, start)

    with renamed_params(RENAMES):
        return await complete_chat(request, chat_from_messages(body), make_format)


@router.post("/messages/count_tokens", response_model=TokenCount)
async def count_tokens(body: CountTokensRequest, request: Request):
    engine = request.app.state.engine
    async with serving(engine, body.model):
        prompt = await asyncio.to_thread(chat_prompt, engine, chat_from_messages(body))
        return TokenCount(input_tokens=len(prompt))
