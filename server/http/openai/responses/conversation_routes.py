"""OpenAI's Conversations API: `POST /v1/conversations`, `GET`/`POST`/`DELETE
/v1/conversations/{id}`, `POST`/`GET /v1/conversations/{id}/items` and `GET`/`DELETE
/v1/conversations/{id}/items/{item_id}` (`client.conversations`)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path, Query, Request

from api_schemas.responses import (
    ConversationCreate,
    ConversationDeleted,
    ConversationItemsCreate,
    ConversationObject,
    ConversationUpdate,
    ResponseItem,
    ResponseItemList,
)
from server.http.common import paging
from server.http.common.auth import require_api_key
from server.http.common.bodies import OffLoopJson
from server.http.openai.responses.mapping import request_items

router = APIRouter(prefix="/v1/conversations", dependencies=[Depends(require_api_key)],
                   tags=["responses"], route_class=OffLoopJson)
ConversationId = Annotated[str, Path(description="A conversation's id (conv_...).")]
ItemId = Annotated[str, Path(description="An item's id.")]


@router.post("", response_model=ConversationObject)
async def create_conversation(body: ConversationCreate, request: Request):
    items = request_items(body.items) if body.items else []
    return request.app.state.conversations.create(body.metadata, items).info


@router.get("/{conversation_id}", response_model=ConversationObject)
async def retrieve_conversation(conversation_id: ConversationId, request: Request):
    return request.app.state.conversations.get(conversation_id).info


@router.post("/{conversation_id}", response_model=ConversationObject)
async def update_conversation(conversation_id: ConversationId, body: ConversationUpdate,
                              request: Request):
    """Replace its metadata."""
    store = request.app.state.conversations
    conversation = store.get(conversation_id)
    store.set_metadata(conversation, body.metadata)
    return conversation.info


@router.delete("/{conversation_id}", response_model=ConversationDeleted)
async def delete_conversation(conversation_id: ConversationId, request: Request):
    request.app.state.conversations.delete(conversation_id)
    return ConversationDeleted(id=conversation_id)


@router.post("/{conversation_id}/items", response_model=ResponseItemList)
async def add_items(conversation_id: ConversationId, body: ConversationItemsCreate,
                    request: Request):
    """Add items at its end: the added items."""
    store = request.app.state.conversations
    conversation = store.get(conversation_id)
    added = request_items(body.items)
    store.extend(conversation, added)
    return ResponseItemList(**paging.page(added, len(added)))


@router.get("/{conversation_id}/items", response_model=ResponseItemList)
async def list_items(
    conversation_id: ConversationId, request: Request,
    after: Annotated[str | None, Query(description="List the items after this id.")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Annotated[Literal["asc", "desc"], Query(description="asc: oldest first.")] = "desc",
    include: Annotated[list[str] | None, Query(description="Accepted and ignored.")] = None,
):
    items = request.app.state.conversations.get(conversation_id).items
    ordered = list(items) if order == "asc" else list(reversed(items))
    return ResponseItemList(**paging.page(ordered, limit, after=("after", after)))


@router.get("/{conversation_id}/items/{item_id}", response_model=ResponseItem)
async def retrieve_item(conversation_id: ConversationId, item_id: ItemId, request: Request,
                        include: Annotated[list[str] | None, Query(
                            description="Accepted and ignored.")] = None):
    return request.app.state.conversations.get(conversation_id).item(item_id)


@router.delete("/{conversation_id}/items/{item_id}", response_model=ConversationObject)
async def delete_item(conversation_id: ConversationId, item_id: ItemId, request: Request):
    """Remove one item: the conversation."""
    store = request.app.state.conversations
    conversation = store.get(conversation_id)
    store.remove_item(conversation, item_id)
    return conversation.info
