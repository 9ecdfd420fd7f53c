"""RFC 3339 times, as Anthropic's and Ollama's APIs write them (`2026-12-06T17:20:37Z`)."""

from __future__ import annotations

from datetime import datetime, timezone


def rfc3339(unix: float) -> str:
    return datetime.fromtimestamp(unix, timezone.utc).isoformat().replace("+00:00", "Z")
