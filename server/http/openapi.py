"""The OpenAPI document, made true: the statuses each route really answers, in OpenAI's error
shape (Anthropic's under /v1/messages, Ollama's under /api), and `text/event-stream` (Ollama's:
JSON lines) beside JSON for the generation routes. FastAPI's 422 never happens here
(a body that fails validation is a 400), so it is not listed.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from api_schemas.anthropic import AnthropicError, Message, MessageStreamEvent
from api_schemas.ollama import OllamaAnswer, OllamaError
from api_schemas.openai import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
)
from api_schemas.responses import ResponseObject, ResponseStreamEvent
from server.http.common.errors import ErrorShape

REF = "#/components/schemas/{model}"
ERROR_DESCRIPTIONS = {
    400: "Invalid request: a field out of range, a prompt longer than the context, bad JSON.",
    401: "Missing or wrong bearer key.",
    403: "Not allowed: a path outside the model roots, hub ids disabled, or model changes"
         " disabled on a server bound beyond loopback without an admin key.",
    404: "No such model, path, loaded draft, stored response, conversation, file or batch.",
    409: "The draft's tokenizer does not match the target's; a batch that is not running"
         " cannot be cancelled.",
    413: "The body is larger than `server.max_body_mb`, or a batch's requests do not fit in"
         " the file budget (`server.files_max_gb`).",
    503: "The request queue is full; retry after `Retry-After` seconds.",
    529: "Overloaded (Anthropic's status): the request queue is full; retry after"
         " `Retry-After` seconds.",
}
# What each operation can answer besides 200, and 413 when it takes a body. An operation
# missing here (a newer route) gets 400 when it takes a body and 401 under /v1.
ROUTE_ERRORS = {
    ("/v1/chat/completions", "post"): (400, 401, 404, 503),
    ("/v1/completions", "post"): (400, 401, 404, 503),
    ("/infill", "post"): (400, 401, 404, 503),
    ("/completion", "post"): (400, 401, 404, 503),
    ("/v1/models", "get"): (400, 401),
    ("/v1/models/{model_id}", "get"): (401, 404),
    ("/v1/models/draft", "post"): (400, 401, 403, 404, 409),
    ("/v1/models/draft", "delete"): (401, 403, 404),
    ("/v1/models/target", "post"): (400, 401, 403, 404, 409),
    ("/v1/models/draft/compatibility", "post"): (400, 401, 403, 404),
    ("/v1/models/draft/candidates", "get"): (401, 403),
    ("/v1/responses", "post"): (400, 401, 404, 503),
    ("/v1/responses/{response_id}", "get"): (400, 401, 404),
    ("/v1/responses/{response_id}", "delete"): (401, 404),
    ("/v1/responses/{response_id}/cancel", "post"): (400, 401, 404),
    ("/v1/conversations", "post"): (400, 401),
    ("/v1/conversations/{conversation_id}", "get"): (401, 404),
    ("/v1/conversations/{conversation_id}", "post"): (400, 401, 404),
    ("/v1/conversations/{conversation_id}", "delete"): (401, 404),
    ("/v1/conversations/{conversation_id}/items", "post"): (400, 401, 404),
    ("/v1/conversations/{conversation_id}/items", "get"): (400, 401, 404),
    ("/v1/conversations/{conversation_id}/items/{item_id}", "get"): (401, 404),
    ("/v1/conversations/{conversation_id}/items/{item_id}", "delete"): (401, 404),
    ("/v1/responses/{response_id}/input_items", "get"): (400, 401, 404),
    ("/v1/responses/input_tokens", "post"): (400, 401, 404),
    ("/v1/messages", "post"): (400, 401, 404, 529),
    ("/v1/messages/count_tokens", "post"): (400, 401, 404),
    ("/v1/embeddings", "post"): (400, 401, 404),
    ("/v1/cache", "delete"): (401, 403),
    ("/v1/messages/batches", "post"): (400, 401),
    ("/v1/messages/batches", "get"): (400, 401),
    ("/v1/messages/batches/{batch_id}", "get"): (401, 404),
    ("/v1/messages/batches/{batch_id}", "delete"): (400, 401, 404),
    ("/v1/messages/batches/{batch_id}/cancel", "post"): (400, 401, 404),
    ("/v1/messages/batches/{batch_id}/results", "get"): (400, 401, 404),
    ("/v1/files", "post"): (400, 401),
    ("/v1/files", "get"): (400, 401),
    ("/v1/files/{file_id}", "get"): (401, 404),
    ("/v1/files/{file_id}", "delete"): (401, 404),
    ("/v1/files/{file_id}/content", "get"): (401, 404),
    ("/v1/batches", "post"): (400, 401, 404),
    ("/v1/batches", "get"): (400, 401),
    ("/v1/batches/{batch_id}", "get"): (401, 404),
    ("/v1/batches/{batch_id}/cancel", "post"): (401, 404, 409),
    ("/api/chat", "post"): (400, 401, 404, 503),
    ("/api/generate", "post"): (400, 401, 404, 503),
    ("/api/embed", "post"): (400, 401, 404),
    ("/api/show", "post"): (400, 401, 404),
    ("/api/tags", "get"): (401,),
    ("/api/ps", "get"): (401,),
    ("/api/version", "get"): (401,),
    ("/tokenize", "post"): (400, 401, 404),
    ("/detokenize", "post"): (400, 401, 404),
    ("/tokenizer_info", "get"): (401,),
    ("/health", "get"): (),
    ("/metrics", "get"): (),
}
# Streamed (`"stream": true`) operations: the JSON body otherwise, and the chunk each event holds.
STREAMED = {
    "/v1/chat/completions": (ChatCompletionResponse, ChatCompletionChunk),
    "/v1/completions": (CompletionResponse, CompletionResponse),
    "/v1/responses": (ResponseObject, ResponseStreamEvent),
    "/v1/messages": (Message, MessageStreamEvent),
}
# Read operations that stream with `?stream=true` (as the operation named streams).
STREAMED_READS = {"/v1/responses/{response_id}": "/v1/responses"}
OLLAMA_STREAMED = ("/api/chat", "/api/generate")
STREAM_ENDS = {
    "/v1/responses": "named events (`event:` = the data's `type`), the last response.completed"
                     " or response.incomplete (response.failed: a background response)",
    "/v1/messages": "named events (`event:` = the data's `type`), the last message_stop",
}


def install_openapi(app: FastAPI, shapes: list[ErrorShape]) -> None:
    """`shapes`: the APIs whose errors are not in OpenAI's shape."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description=app.description)
            describe(schema, shapes)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def describe(schema: dict, shapes: list[ErrorShape]) -> None:
    """Rewrite FastAPI's responses in place: real statuses, error schema, event streams."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    extra = [(m, "serialization") for m in
             (ErrorResponse, AnthropicError, ChatCompletionResponse, ChatCompletionChunk,
              CompletionResponse, ResponseObject, ResponseStreamEvent, Message,
              MessageStreamEvent, OllamaError, OllamaAnswer)]
    refs, defs = models_json_schema(extra, ref_template=REF)
    for name, definition in defs.get("$defs", {}).items():
        components.setdefault(name, definition)
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            if operation.get("security"):  # keys are optional in the configuration
                operation["security"] = [{}, *operation["security"]]
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            error_ref = refs[(_error_model(path, shapes), "serialization")]
            for code in _errors_of(path, method, operation):
                responses[str(code)] = _error_response(code, error_ref)
            if path in OLLAMA_STREAMED:
                responses["200"] = _json_lines_ok(refs[(OllamaAnswer, "serialization")])
            streams = (path if method == "post" else
                       STREAMED_READS.get(path) if method == "get" else None)
            if streams in STREAMED:
                body, chunk = STREAMED[streams]
                responses["200"] = _streamed_ok(refs[(body, "serialization")],
                                                refs[(chunk, "serialization")], error_ref,
                                                STREAM_ENDS.get(streams, "then `data: [DONE]`"))
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)


def _error_model(path: str, shapes: list[ErrorShape]):
    return next((s.schema for s in shapes if path.startswith(s.prefix)), ErrorResponse)


def _json_lines_ok(answer_ref: dict) -> dict:
    return {"description": "The answer: one JSON object, or with `\"stream\": true` (Ollama's"
                           " default) one per line, the last with `done: true` (an error after"
                           " the stream started comes as a line `{\"error\": ...}`).",
            "content": {"application/json": {"schema": answer_ref},
                        "application/x-ndjson": {"schema": answer_ref}}}


def _errors_of(path: str, method: str, operation: dict) -> list[int]:
    body = "requestBody" in operation
    codes = set(ROUTE_ERRORS.get((path, method), ()))
    if (path, method) not in ROUTE_ERRORS:
        codes |= {400} if body else set()
        codes |= {401} if path.startswith("/v1") else set()
    return sorted(codes | {413} if body else codes)  # server.max_body_mb


def _error_response(code: int, error_ref: dict) -> dict:
    response = {"description": ERROR_DESCRIPTIONS[code],
                "content": {"application/json": {"schema": error_ref}}}
    if code in (503, 529):
        response["headers"] = {"Retry-After": {"description": "Seconds to wait.",
                                               "schema": {"type": "integer"}}}
    return response


def _streamed_ok(body_ref: dict, chunk_ref: dict, error_ref: dict, end: str) -> dict:
    name = chunk_ref["$ref"].rsplit("/", 1)[-1]
    error = error_ref["$ref"].rsplit("/", 1)[-1]
    return {
        "description": "The completion: one JSON body, or with `\"stream\": true` Server-Sent"
                       f" Events, each `data:` a JSON chunk ({name}; an error that happens after"
                       f" the stream started comes as an {error}), {end}.",
        "content": {
            "application/json": {"schema": body_ref},
            "text/event-stream": {"schema": _sse_event(chunk_ref, error_ref)},
        },
    }


def _sse_event(chunk_ref: dict, error_ref: dict) -> dict:
    """One event of the stream (OpenAPI 3.1 style: the schema applies to each event)."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"type": "string"},
            "id": {"type": "string"},
            "data": {
                "type": "string",
                "if": {"const": "[DONE]"},
                "else": {"contentMediaType": "application/json",
                         "contentSchema": {"anyOf": [chunk_ref, error_ref]}},
            },
        },
    }
