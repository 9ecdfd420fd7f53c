"""Ollama's error shape, for every request under /api: {"error": message}."""

from __future__ import annotations

from api_schemas.ollama import OllamaError
from server.http.common.errors import APIError, ErrorShape

PREFIX = "/api/"


def error_body(error: APIError) -> dict:
    return {"error": error.shown_message}


SHAPE = ErrorShape("ollama", PREFIX, error_body, OllamaError)
