"""Anthropic's error shape: {"type": "error", "error": {type, message}}, for requests under
/v1/messages and any request with an `anthropic-version` header (Anthropic's clients send it).
A full queue is a 529 `overloaded_error`, as at Anthropic."""

from __future__ import annotations

from api_schemas.anthropic import AnthropicError
from server.http.common.errors import APIError, ErrorShape

# Anthropic's error types by status; its "overloaded" status is 529, not 503.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
STATUS = {503: 529}
PREFIX = "/v1/messages"


def status(code: int) -> int:
    return STATUS.get(code, code)


def error_body(error: APIError) -> dict:
    kind = ERROR_TYPES.get(status(error.status), "invalid_request_error"
                           if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.shown_message}}


SHAPE = ErrorShape("anthropic", PREFIX, error_body, AnthropicError, status,
                   header="anthropic-version")
