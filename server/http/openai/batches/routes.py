"""OpenAI's Files API (`POST`/`GET /v1/files`, `GET`/`DELETE /v1/files/{id}`,
`GET /v1/files/{id}/content`) and Batch API (`POST`/`GET /v1/batches`, `GET /v1/batches/{id}`,
`POST /v1/batches/{id}/cancel`): `client.files.create(...)` then `client.batches.create(...)`."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from fastapi import APIRouter, Depends, File, Form, Path, Query, Request, UploadFile
from fastapi.responses import Response

from api_schemas.batches import (
    BatchCreateRequest,
    BatchList,
    BatchObject,
    FileDeleted,
    FileList,
    FileObject,
)
from server.http.common import paging
from server.http.common.auth import require_api_key
from server.http.common.bodies import OffLoopJson
from server.http.common.errors import APIError

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], tags=["batches"],
                   route_class=OffLoopJson)

# What `client.files.create` may send as `purpose`; only `batch` files are a batch's input.
UploadPurpose = Literal["assistants", "batch", "fine-tune", "vision", "user_data", "evals"]
FileId = Annotated[str, Path(description="A file's id (file-...).")]
BatchId = Annotated[str, Path(description="A batch's id (batch_...).")]


@router.post("/files", response_model=FileObject)
async def upload_file(request: Request, file: Annotated[UploadFile, File()],
                      purpose: Annotated[str, Form()]):
    """Upload a file (multipart form: `file`, `purpose`), such as a batch's requests."""
    if purpose not in get_args(UploadPurpose):
        raise APIError(400, f"purpose must be one of {', '.join(get_args(UploadPurpose))}",
                       param="purpose", code="invalid_value", redact=False)
    store = request.app.state.files
    if file.size is not None:
        store.check_room(file.size)  # before reading it into memory
    data = await file.read()
    return store.add(file.filename or "upload", purpose, data)


@router.get("/files", response_model=FileList)
async def list_files(
    request: Request,
    purpose: Annotated[str | None, Query(description="Only files of this purpose.")] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    after: Annotated[str | None, Query(description="List the files after this id.")] = None,
    order: Annotated[Literal["asc", "desc"], Query(description="asc: oldest first.")] = "desc",
):
    files = request.app.state.files.listed(purpose, order)
    return FileList(**paging.page(files, limit, after=("after", after)))


@router.get("/files/{file_id}", response_model=FileObject)
async def retrieve_file(file_id: FileId, request: Request):
    return request.app.state.files.get(file_id).info


@router.get("/files/{file_id}/content", response_class=Response, responses={200: {
    "description": "The file's bytes.",
    "content": {"application/octet-stream": {"schema": {"type": "string",
                                                        "format": "binary"}}}}})
async def file_content(file_id: FileId, request: Request):
    return Response(request.app.state.files.get(file_id).data,
                    media_type="application/octet-stream")


@router.delete("/files/{file_id}", response_model=FileDeleted)
async def delete_file(file_id: FileId, request: Request):
    request.app.state.files.delete(file_id)
    return FileDeleted(id=file_id)


@router.post("/batches", response_model=BatchObject)
async def create_batch(body: BatchCreateRequest, request: Request):
    """Run an uploaded file's requests (purpose `batch`), `server.batch_concurrency` at a time."""
    return request.app.state.batches.create(body, request.app.state.engine.model_name)


@router.get("/batches", response_model=BatchList)
async def list_batches(
    request: Request,
    after: Annotated[str | None, Query(description="List the batches after this id.")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
):
    """The batches, newest first."""
    return BatchList(**paging.page(request.app.state.batches.listed(), limit,
                                   after=("after", after)))


@router.get("/batches/{batch_id}", response_model=BatchObject)
async def retrieve_batch(batch_id: BatchId, request: Request):
    return request.app.state.batches.get(batch_id)


@router.post("/batches/{batch_id}/cancel", response_model=BatchObject)
async def cancel_batch(batch_id: BatchId, request: Request):
    return request.app.state.batches.cancel(batch_id)
