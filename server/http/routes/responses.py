"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from api_schemas.responses import DeletedResponse, ResponseObject, ResponsesRequest
from server.http.auth import require_api_key
from server.http.chat_translation import renamed_params
from server.http.completion import complete_chat
from server.http.responses_format import ResponsesFormat
from server.http.responses_mapping import (
    RENAMES,
    chat_from_responses,
    input_messages,
    output_messages,
    response_skeleton,
)

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], tags=["responses"])


@router.post("/responses")
async def create_response(body: ResponsesRequest, request: Request):
    engine, store = request.app.state.engine, request.app.state.responses
    history = [] if body.previous_response_id is None else list(
        store.get(body.previous_response_id, param="previous_response_id").conversation)
    conversation = history + input_messages(body.input)
    chat = chat_from_responses(body, conversation)
    skeleton = response_skeleton(body, engine.model_name)

    def finished(response: ResponseObject) -> None:
        if body.store:
            store.put(response, conversation + output_messages(response))

    def make_format(tools, _prompt):
        return ResponsesFormat(engine.model_name, engine.tokenizer, skeleton, tools, finished)

    with renamed_params(RENAMES):
        return await complete_chat(request, chat, make_format)


@router.get("/responses/{response_id}", response_model=ResponseObject)
async def get_response(response_id: str, request: Request):
    return request.app.state.responses.get(response_id).response


@router.delete("/responses/{response_id}", response_model=DeletedResponse)
async def delete_response(response_id: str, request: Request):
    request.app.state.responses.delete(response_id)
    return DeletedResponse(id=response_id)
