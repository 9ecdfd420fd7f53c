"""Bearer keys: `api_key` guards every /v1 endpoint, `admin_api_key` the model mutations."""

from __future__ import annotations

import secrets

from fastapi import Request

from server.http.errors import APIError


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _matches(given: str | None, expected: str) -> bool:
    return given is not None and secrets.compare_digest(given.encode(), expected.encode())


def require_api_key(request: Request) -> None:
    server = request.app.state.settings.server
    given = _bearer(request)
    keys = [k for k in (server.api_key, server.admin_api_key) if k]
    if server.api_key and not any(_matches(given, k) for k in keys):
        raise APIError(401, "missing or invalid API key", code="invalid_api_key")


def require_admin_key(request: Request) -> None:
    server = request.app.state.settings.server
    expected = server.admin_api_key or server.api_key
    if expected and not _matches(_bearer(request), expected):
        raise APIError(401, "missing or invalid admin API key", code="invalid_api_key")
