"""`X-Request-Id`: every HTTP request gets an id, the client's own (as vLLM and most proxies
pass it) when it is a short token, else a new `req_...` one. It is answered in the response's
`X-Request-Id` header and written on the request's log line (`request_log.py`), so a client's,
a proxy's and this server's logs can be joined."""

from __future__ import annotations

import re
import uuid

HEADER = b"x-request-id"
VALID = re.compile(rb"[A-Za-z0-9._:/=+-]{1,128}")


class RequestIds:
    """ASGI middleware: `scope["state"]["request_id"]` (`request.state.request_id`)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or ()).get(HEADER, b"")
        request_id = given if VALID.fullmatch(given) else f"req_{uuid.uuid4().hex}".encode()
        scope.setdefault("state", {})["request_id"] = request_id.decode()

        async def with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id)]}
            await send(message)

        await self.app(scope, receive, with_id)


def request_id(request) -> str | None:
    return getattr(request.state, "request_id", None)
