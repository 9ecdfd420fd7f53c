"""Every error leaves the server in OpenAI's shape: {"error": {message, type, param, code}},
unless the request spoke an API whose errors have a shape of their own (an `ErrorShape` its
folder defines, installed with the app: Anthropic's, Ollama's)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from api_schemas.openai import ErrorBody, ErrorResponse
from server.engine import (
    EngineFailed,
    IncompatibleDraft,
    InvalidRequest,
    MemoryBudgetExceeded,
    ModelLoadError,
    ModelNotFound,
    ModelReplaced,
    QueueFull,
    ShuttingDown,
    TargetUnavailable,
)

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "overloaded_error",
}


@dataclass(frozen=True)
class ErrorShape:
    """An API whose errors have a shape of their own: the requests that speak it (under
    `prefix`, or sending `header`), its body and status for an `APIError`, and the body's
    schema (OpenAPI)."""

    name: str
    prefix: str
    body: Callable[[APIError], dict]
    schema: type
    status: Callable[[int], int] = lambda status: status
    header: str | None = None

    def spoken_by(self, request: Request) -> bool:
        return (request.url.path.startswith(self.prefix)
                or self.header is not None and self.header in request.headers)


def shape_of(request: Request) -> ErrorShape | None:
    """The error shape of the API `request` speaks; None for OpenAI's."""
    shapes = getattr(request.app.state, "error_shapes", ())
    return next((shape for shape in shapes if shape.spoken_by(request)), None)


# A dead engine's requests are told to come back after this: the process exits within a few
# seconds and its supervisor starts it again (the models load meanwhile).
ENGINE_RESTART_S = 10

# An absolute path that starts a word (not the `//host/x` of a URL): what `redact_paths` shortens.
_ABSOLUTE_PATH = re.compile(r"(?<![\w:/.~-])/(?:[^\s'\"/:,;()\[\]]+/)+([^\s'\"/:,;()\[\]]*)")


def redact_paths(message: str) -> str:
    """`cannot load /srv/models/x/model.safetensors` -> `cannot load .../model.safetensors`:
    clients learn which file, never where the server keeps its files."""
    return _ABSOLUTE_PATH.sub(lambda m: ".../" + m.group(1), message)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict | None = None,
                 error_type: str | None = None, redact: bool = True):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers
        self.error_type = error_type or ERROR_TYPES.get(status, "error")
        self.redact = redact  # False for messages that quote only the client's own input

    @property
    def shown_message(self) -> str:
        return redact_paths(self.message) if self.redact else self.message

    def body(self) -> dict:
        err = ErrorBody(message=self.shown_message, type=self.error_type, param=self.param,
                        code=self.code)
        return ErrorResponse(error=err).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def response_for(self, request: Request) -> JSONResponse:
        """This error in the shape of the API the request spoke."""
        shape = shape_of(request)
        if shape is None:
            return self.response()
        return JSONResponse(shape.body(self), status_code=shape.status(self.status),
                            headers=self.headers)


def as_api_error(exc: BaseException) -> APIError:
    """Map engine exceptions to HTTP; anything unknown is a 500 (and logged)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, MemoryBudgetExceeded):
        return APIError(400, str(exc), param=exc.param, code="memory_budget_exceeded")
    if isinstance(exc, InvalidRequest):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, EngineFailed):  # the process exits; its supervisor starts it again
        return APIError(503, str(exc), code="engine_failed",
                        headers={"Retry-After": str(ENGINE_RESTART_S)})
    if isinstance(exc, ShuttingDown):
        return APIError(503, str(exc), code="shutting_down", headers={"Retry-After": "5"})
    if isinstance(exc, QueueFull):
        return APIError(503, f"server busy: {exc}; retry shortly", code="queue_full",
                        headers={"Retry-After": "1"})
    if isinstance(exc, ModelReplaced):
        return APIError(503, str(exc), code="model_replaced", headers={"Retry-After": "1"})
    if isinstance(exc, TargetUnavailable):
        return APIError(503, str(exc), param="model", code="model_unavailable")
    if isinstance(exc, IncompatibleDraft):
        return APIError(409, f"incompatible draft model: {exc}", param="model",
                        code="incompatible_draft")
    if isinstance(exc, ModelNotFound):
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, ModelLoadError):
        return APIError(400, str(exc), param="model", code="model_load_failed")
    log.error("internal error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


# Pydantic names the member of a union a value failed as in its location ("prompt.str",
# "content.list[...]"): not a field the client sent.
_UNION_MEMBERS = re.compile(r"^(str|int|float|bool|none|.*\[.*\])$")


def _loc_param(loc) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")
             and not (isinstance(p, str) and _UNION_MEMBERS.match(p))]
    return ".".join(parts) or None


async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        return APIError(400, "request body is not valid JSON",
                        code="invalid_json").response_for(request)
    param = _loc_param(first.get("loc", ()))
    msg = first.get("msg", "invalid request").removeprefix("Value error, ")
    message = f"{param}: {msg}" if param else msg
    return APIError(400, message, param=param, code="invalid_value").response_for(request)


async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    method, path = request.method, request.url.path
    if exc.status_code == 404 and not _any_route_matches(request):
        # No catch-all route: routes registered later (or by other routers) still win.
        return APIError(404, f"{method} {path} is not supported by this server (its endpoints "
                        "are listed at /docs)",
                        code="unknown_endpoint", error_type="invalid_request_error",
                        redact=False).response_for(request)
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        return APIError(405, f"{method} is not allowed on {path}; use {allowed or 'another'}",
                        code="method_not_allowed", headers=exc.headers,
                        redact=False).response_for(request)
    return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response_for(request)


def _any_route_matches(request: Request) -> bool:
    """Whether some route serves this path (with any method): else the endpoint is unknown."""
    scope = {**request.scope, "method": "GET"}
    return any(route.matches(scope)[0] != Match.NONE for route in request.app.router.routes)


async def _api(request: Request, exc: Exception) -> JSONResponse:
    return as_api_error(exc).response_for(request)


def install_error_handlers(app: FastAPI, shapes: list[ErrorShape]) -> None:
    """`shapes`: the APIs whose errors are not in OpenAI's shape, the first that a request
    speaks wins."""
    app.state.error_shapes = tuple(shapes)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    for exc_type in (APIError, InvalidRequest, QueueFull, ShuttingDown, ModelReplaced,
                     TargetUnavailable, IncompatibleDraft, ModelLoadError, EngineFailed):
        app.add_exception_handler(exc_type, _api)
    app.add_exception_handler(Exception, _api)
