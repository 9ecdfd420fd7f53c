"""Request bodies: bounded before they are read, JSON whatever the client calls it, parsed off
the event loop when large.

- `BodyLimits` (ASGI middleware) answers 413, in the API's error shape, to a body larger than
  its bound: at once when its Content-Length says so (the client sends nothing more; curl's
  `Expect: 100-continue` never gets its 100), else as its bytes arrive, the moment they pass it.
- It also reads a POST body sent without a Content-Type, as `text/plain` or as curl's `-d`
  default (`application/x-www-form-urlencoded`) as JSON, as Ollama, llama.cpp and
  `mlx_lm.server` do: no route takes a form but the Files upload, which is multipart. A body
  that is not JSON still gets its 400.
- `OffLoopJson` (the routers' route class) parses a large JSON body in a worker thread, so one
  client's multi-MB body does not stall every other stream and `/health`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.http.common.errors import APIError

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# Content types a JSON body arrives under from clients that do not say it is JSON.
READ_AS_JSON = frozenset({"", "text/plain", "application/x-www-form-urlencoded"})
# Smaller bodies parse on the event loop: in a millisecond, less than a thread hop's cost.
OFF_LOOP_BYTES = 256 * 1024


class BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` once a body passes its bound: FastAPI lets an HTTPException out
    of its body parsing as it is, and the app's handler (`install_body_limits`) shapes it."""

    def __init__(self, limit: int, setting: str):
        super().__init__(413, too_large_message(None, limit, setting))

    def error(self) -> APIError:
        return APIError(413, self.detail, code="request_too_large", redact=False)


def too_large_message(length: int | None, limit: int, setting: str) -> str:
    size = f"({length:,} bytes) " if length is not None else ""
    return (f"the request body {size}is larger than this server takes: {limit:,} bytes"
            f" ({setting})")


class BodyLimits:
    """`limit` bytes per body; `larger`: {path: (bytes, the setting that bounds it)} for the
    POST routes that take more (uploads)."""

    def __init__(self, app, *, limit: int, setting: str,
                 larger: dict[str, tuple[int, str]] | None = None):
        self.app, self.limit, self.setting = app, limit, setting
        self.larger = larger or {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        limit, setting = self.larger.get(scope["path"], (self.limit, self.setting))
        headers = Headers(scope=scope)
        length = _content_length(headers)
        if length is not None and length > limit:
            error = APIError(413, too_large_message(length, limit, setting),
                             code="request_too_large", redact=False)
            await error.response_for(Request(scope))(scope, receive, send)
            return
        await self.app(_as_json(scope, headers), _bounded(receive, limit, setting), send)


def _content_length(headers: Headers) -> int | None:
    try:
        return int(headers["content-length"])
    except (KeyError, ValueError):
        return None


def _as_json(scope, headers: Headers):
    """`scope` with `Content-Type: application/json` when its body is JSON by another name."""
    given = headers.get("content-type", "").split(";")[0].strip().lower()
    if given not in READ_AS_JSON:
        return scope
    kept = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
    return {**scope, "headers": [*kept, (b"content-type", b"application/json")]}


def _bounded(receive, limit: int, setting: str):
    received = 0

    async def bounded():
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise BodyTooLarge(limit, setting)
        return message

    return bounded


async def _too_large(request: Request, exc: BodyTooLarge):
    return exc.error().response_for(request)


def install_body_limits(app, *, limit: int, setting: str,
                        larger: dict[str, tuple[int, str]] | None = None) -> None:
    app.add_middleware(BodyLimits, limit=limit, setting=setting, larger=larger)
    app.add_exception_handler(BodyTooLarge, _too_large)


def parse_json(body: bytes) -> Any:
    return json.loads(body)


class OffLoopJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = (await asyncio.to_thread(parse_json, body)
                          if len(body) > OFF_LOOP_BYTES else parse_json(body))
        return self._json


class OffLoopJson(APIRoute):
    """The route class of every router: its handler reads the JSON body through
    `OffLoopJsonRequest` (FastAPI's documented way to customize the request a route gets)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route_handler(request: Request):
            return await handler(OffLoopJsonRequest(request.scope, request.receive))

        return route_handler
