"""Request bodies and SSE reading for the HTTP tests."""

from __future__ import annotations


def chat_body(content="Write a function", **extra):
    return {"messages": [{"role": "user", "content": content}], **extra}


async def read_sse(response) -> list[dict | str]:
    """The `data:` payloads of an SSE response, JSON-decoded except `[DONE]`."""
    import json

    out = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
