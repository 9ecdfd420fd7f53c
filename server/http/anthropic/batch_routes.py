"""Anthropic's Message Batches API (`client.messages.batches`): `POST`/`GET
/v1/messages/batches`, `GET`/`DELETE /v1/messages/batches/{id}`,
`POST /v1/messages/batches/{id}/cancel` and `GET /v1/messages/batches/{id}/results`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import Response

from api_schemas.anthropic import (
    DeletedMessageBatch,
    MessageBatch,
    MessageBatchCreate,
    MessageBatchList,
)
from server.http.common import paging
from server.http.common.auth import require_api_key
from server.http.common.bodies import OffLoopJson

router = APIRouter(prefix="/v1/messages/batches", dependencies=[Depends(require_api_key)],
                   tags=["messages"], route_class=OffLoopJson)
BatchId = Annotated[str, Path(description="A message batch's id (msgbatch_...).")]


@router.post("", response_model=MessageBatch)
async def create_message_batch(body: MessageBatchCreate, request: Request):
    """Run up to 100,000 Messages requests, `server.batch_concurrency` at a time."""
    return request.app.state.message_batches.create(body).view(str(request.base_url))


@router.get("", response_model=MessageBatchList)
async def list_message_batches(
    request: Request,
    after_id: Annotated[str | None, Query(description="The page after this id.")] = None,
    before_id: Annotated[str | None, Query(description="The page before this id.")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
):
    """The batches, newest first."""
    base = str(request.base_url)
    batches = [job.view(base) for job in request.app.state.message_batches.listed()]
    return MessageBatchList(**paging.page(batches, limit, after=("after_id", after_id),
                                          before=("before_id", before_id)))


@router.get("/{batch_id}", response_model=MessageBatch)
async def retrieve_message_batch(batch_id: BatchId, request: Request):
    return request.app.state.message_batches.get(batch_id).view(str(request.base_url))


@router.post("/{batch_id}/cancel", response_model=MessageBatch)
async def cancel_message_batch(batch_id: BatchId, request: Request):
    return request.app.state.message_batches.cancel(batch_id).view(str(request.base_url))


@router.get("/{batch_id}/results", response_class=Response, responses={200: {
    "description": "One JSON line per request: its custom_id and result.",
    "content": {"application/x-jsonl": {"schema": {"type": "string"}}}}})
async def message_batch_results(batch_id: BatchId, request: Request):
    return Response(request.app.state.message_batches.results(batch_id),
                    media_type="application/x-jsonl")


@router.delete("/{batch_id}", response_model=DeletedMessageBatch)
async def delete_message_batch(batch_id: BatchId, request: Request):
    request.app.state.message_batches.delete(batch_id)
    return DeletedMessageBatch(id=batch_id)
