"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id},
GET /v1/responses/{id}/input_items and POST /v1/responses/input_tokens."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from sse_starlette import EventSourceResponse

from api_schemas.responses import (
    DeletedResponse,
    InputTokenCount,
    InputTokensRequest,
    ResponseItem,
    ResponseItemList,
    ResponseObject,
    ResponsesRequest,
)
from server.http.common import paging
from server.http.common.auth import require_api_key
from server.http.common.bodies import OffLoopJson
from server.http.common.chat_translation import renamed_params
from server.http.common.completion import complete_chat
from server.http.common.errors import APIError
from server.http.common.request_mapping import serving
from server.http.common.truncation import fit_to_context
from server.http.openai.responses.background import ACTIVE
from server.http.openai.responses.conversations import Conversation
from server.http.openai.responses.format import ResponsesFormat
from server.http.openai.responses.mapping import (
    RENAMES,
    chat_from_responses,
    input_messages,
    item_messages,
    request_items,
    response_skeleton,
)
from server.http.openai.responses.store import ResponseStore, StoredResponse
from server.http.openai.responses.tools import ToolTable

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], tags=["responses"],
                   route_class=OffLoopJson)


@router.post("/responses")
async def create_response(body: ResponsesRequest, request: Request):
    engine, store = request.app.state.engine, request.app.state.responses
    if body.background:
        _previous(store, body)  # one still running is refused now
        background = request.app.state.background
        queued = background.start(body, await request.json(), engine.model_name)
        return _events(background.follow(queued.id, None)) if body.stream else queued
    earlier, thread = _earlier(request, body)
    new_items = request_items(body.input)
    tools = ToolTable(body.tools)
    chat = chat_from_responses(body, _history(earlier, body), tools)

    def finished(response: ResponseObject) -> None:
        if body.store:
            store.put(response, earlier + new_items)
        if thread is not None:
            request.app.state.conversations.extend(thread, new_items + response.output)

    def make_format(tool_calls, start):
        skeleton = response_skeleton(body, engine.model_name)  # the target now serving
        return ResponsesFormat(engine.model_name, engine.tokenizer, skeleton, tool_calls, tools,
                               finished, start)

    with renamed_params(RENAMES):
        return await complete_chat(request, chat, make_format, fill_context=True,
                                   truncate=body.truncation == "auto")


@router.post("/responses/input_tokens", response_model=InputTokenCount)
async def count_input_tokens(body: InputTokensRequest, request: Request):
    """The prompt tokens the same request to POST /v1/responses would have."""
    engine = request.app.state.engine
    earlier, _ = _earlier(request, body)
    async with serving(engine, body.model):
        with renamed_params(RENAMES):
            chat = chat_from_responses(body, _history(earlier, body), ToolTable(body.tools))
            _, prompt = await asyncio.to_thread(fit_to_context, engine, chat,
                                                truncate=body.truncation == "auto")
    return InputTokenCount(input_tokens=len(prompt))


def _previous(store: ResponseStore, body: ResponsesRequest) -> StoredResponse | None:
    if body.previous_response_id is None:
        return None
    previous = store.get(body.previous_response_id, param="previous_response_id")
    if previous.response.status in ACTIVE:
        raise APIError(400, f"previous response {body.previous_response_id!r} is still"
                       f" {previous.response.status} (a background response): wait until it"
                       " has ended", param="previous_response_id", code="response_in_progress",
                       redact=False)
    return previous


def _earlier(request: Request, body: ResponsesRequest
             ) -> tuple[list[ResponseItem], Conversation | None]:
    """The items before the input (the previous response's chain, or the conversation's), and
    the conversation the request names, if any."""
    previous = _previous(request.app.state.responses, body)
    if previous is not None:
        return previous.context(), None
    if body.conversation is None:
        return [], None
    thread = request.app.state.conversations.get(body.conversation_id(), param="conversation")
    return thread.items, thread


def _history(earlier: list, body: ResponsesRequest) -> list[dict]:
    """The chat messages before the instructions: the earlier items (the previous response's
    chain, or the conversation's), then the input."""
    return item_messages(earlier) + input_messages(body.input)


@router.get("/responses/{response_id}", response_model=ResponseObject)
async def get_response(
    response_id: str, request: Request,
    stream: Annotated[bool, Query(description="Stream the events of a background response"
                                  " created with stream: true (those kept), as they come.")]
    = False,
    starting_after: Annotated[int | None, Query(ge=-1, description="With stream: the"
                                                " sequence number to resume after.")] = None,
    include: Annotated[list[str] | None, Query(description="Accepted and ignored.")] = None,
):
    if stream:
        return _events(request.app.state.background.follow(response_id, starting_after))
    return request.app.state.responses.get(response_id).response


def _events(events) -> EventSourceResponse:
    async def messages():
        async for event in events:
            yield {"event": event["type"], "data": json.dumps(event, ensure_ascii=False)}
    return EventSourceResponse(messages(), ping=15)


@router.delete("/responses/{response_id}", response_model=DeletedResponse)
async def delete_response(response_id: str, request: Request):
    request.app.state.responses.delete(response_id)
    request.app.state.background.drop(response_id)
    return DeletedResponse(id=response_id)


@router.post("/responses/{response_id}/cancel", response_model=ResponseObject)
async def cancel_response(response_id: str, request: Request):
    """Stop a background response (`cancelled`); a finished one comes back as it is."""
    return request.app.state.background.cancel(response_id)


@router.get("/responses/{response_id}/input_items", response_model=ResponseItemList)
async def list_input_items(
    response_id: str, request: Request,
    after: Annotated[str | None, Query(description="List the items after this item id.")]
    = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Annotated[Literal["asc", "desc"], Query(description="asc: oldest first.")] = "desc",
    include: Annotated[list[str] | None, Query(description="Accepted and ignored.")] = None,
):
    """The items the response was made from: its input, after the history its
    `previous_response_id` chain brought."""
    items = request.app.state.responses.get(response_id).items
    ordered = list(items) if order == "asc" else list(reversed(items))
    return ResponseItemList(**paging.page(ordered, limit, after=("after", after)))
