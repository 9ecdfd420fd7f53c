"""One line of an OpenAI Batch API file: `{"custom_id", "method": "POST", "url", "body"}`, sent
to the server's own app (in process, through `httpx.ASGITransport`), and its result line:

    {"id": "batch_req_...", "custom_id": ..., "response": {"status_code", "request_id", "body"},
     "error": null}

Shared by `python -m server.batch` (a file offline) and `POST /v1/batches` (a file uploaded to a
running server)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable

import httpx

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
        "/v1/embeddings")
# A full queue (503 with Retry-After) is waited out this many times before its 503 is the result.
QUEUE_RETRIES = 20


def request_problem(request: dict) -> str | None:
    """Why a parsed line is not a request the batch can send (None: it is one)."""
    if request.get("method", "POST") != "POST":
        return "method must be POST"
    if request.get("url") not in URLS:
        return f"url must be one of {', '.join(URLS)}"
    body = request.get("body")
    if not isinstance(body, dict):
        return "body must be a JSON object"
    if body.get("stream"):
        return "stream is not supported in a batch"
    return None


def parse_line(line: str) -> tuple[dict | None, str | None, str | None]:
    """(the request, None, None); or, for a line that is not a request, (the parsed line, or
    None when it is no JSON object, an error code, its message)."""
    try:
        request = json.loads(line)
    except ValueError as e:
        return None, "invalid_json", f"not JSON: {e}"
    if not isinstance(request, dict):
        return None, "invalid_request", "not a JSON object"
    problem = request_problem(request)
    if problem is not None:
        return request, "invalid_request", problem
    return request, None, None


def result_line(custom_id, response: dict | None = None, error: dict | None = None) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": response, "error": error}


async def run_line(client: httpx.AsyncClient, line: str) -> dict:
    """One input line's result line; a line that is not a request gets an `error`."""
    request, code, message = parse_line(line)
    custom_id = request.get("custom_id") if request is not None else None
    if code is not None:
        return result_line(custom_id, error={"code": code, "message": message})
    return await send(client, request)


async def send(client: httpx.AsyncClient, request: dict,
               given_up: Callable[[], bool] = lambda: False) -> dict:
    """The result line of a valid request; a full queue's 503 is retried after its
    Retry-After (a batch waits its turn rather than failing), up to `QUEUE_RETRIES` times,
    unless `given_up()` (the engine died: nothing will get better here)."""
    for _ in range(QUEUE_RETRIES):
        response = await client.post(request["url"], json=request["body"])
        wait = response.headers.get("retry-after", "")
        if response.status_code not in (503, 529) or not wait.isdigit() or given_up():
            break  # 529: Anthropic's 503
        await asyncio.sleep(int(wait))
    body = response.json() if response.content else None
    return result_line(request.get("custom_id"), {  # the id the server's log names it by
        "status_code": response.status_code, "request_id": response.headers["x-request-id"],
        "body": body})
