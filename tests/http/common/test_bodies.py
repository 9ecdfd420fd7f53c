"""Request bodies: JSON however the client labels it, a bound answered with 413 in each API's
error shape before the body is read, and large bodies parsed and tokenized off the event loop
(shown by ordering: `/health` and a running stream answer while a request is held inside its
JSON parsing, then inside its tokenization)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from fastapi.routing import APIRoute
from support.http import chat_body
from support.servers import make_settings, served_url

from server.http.common import bodies, tools
from server.http.common.bodies import OffLoopJson

# What curl sends with `-d` and no -H, what some scripts send, and nothing at all.
LABELS = [{"content-type": "application/x-www-form-urlencoded"},
          {"content-type": "text/plain; charset=utf-8"}, {}]
CHAT = {"messages": [{"role": "user", "content": "Write a function"}], "max_tokens": 6,
        "temperature": 0}
ROUTES = {  # route: (body, the generated text in its answer)
    "/v1/chat/completions": (CHAT, lambda r: r["choices"][0]["message"]["content"]),
    "/v1/messages": ({**CHAT, "model": ""}, lambda r: r["content"][0]["text"]),
    "/api/chat": ({**CHAT, "stream": False,
                   "options": {"num_predict": 6, "temperature": 0}},
                  lambda r: r["message"]["content"]),
    "/v1/completions": ({"prompt": "def f(", "max_tokens": 6, "temperature": 0},
                        lambda r: r["choices"][0]["text"]),
}


def small_app(tiny_pair, engine, **server):
    from server.http.app import create_app

    return create_app(make_settings(*tiny_pair, **server), engine)


def asgi_client(app):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                             timeout=60)


@pytest.mark.anyio
@pytest.mark.parametrize("route", ROUTES)
async def test_a_json_body_is_json_without_a_json_content_type(client, engine, route):
    body, text = ROUTES[route]
    body = {"model": engine.model_name, **body}
    want = await client.post(route, json=body)
    assert want.status_code == 200, want.text
    for label in LABELS:
        got = await client.post(route, content=json.dumps(body).encode(), headers=label)
        assert got.status_code == 200, (label, got.text)
        assert text(got.json()) == text(want.json())


@pytest.mark.anyio
@pytest.mark.parametrize("route, shape", [
    ("/v1/chat/completions", lambda b: b["error"]["code"] == "invalid_json"),
    ("/v1/messages", lambda b: b["type"] == "error"
     and b["error"]["type"] == "invalid_request_error"),
    ("/api/chat", lambda b: b["error"] == "request body is not valid JSON"),
])
async def test_a_body_that_is_not_json_keeps_its_400(client, route, shape):
    for label in LABELS:
        r = await client.post(route, content=b"model=x&messages=hi", headers=label)
        assert r.status_code == 400 and shape(r.json()), (label, r.text)


TOO_LARGE = [  # route, headers, the error's shape
    ("/v1/chat/completions", {}, lambda b: b["error"]["code"] == "request_too_large"
     and b["error"]["type"] == "invalid_request_error"),
    ("/v1/chat/completions", {"anthropic-version": "2023-06-01"},
     lambda b: b["type"] == "error" and b["error"]["type"] == "request_too_large"),
    ("/v1/messages", {}, lambda b: b["type"] == "error"
     and b["error"]["type"] == "request_too_large"),
    ("/api/chat", {}, lambda b: set(b) == {"error"} and "server.max_body_mb" in b["error"]),
    ("/v1/responses", {}, lambda b: b["error"]["code"] == "request_too_large"),
    ("/tokenize", {}, lambda b: b["error"]["code"] == "request_too_large"),
]


@pytest.mark.anyio
@pytest.mark.parametrize("route, headers, shape", TOO_LARGE)
async def test_a_body_over_the_bound_is_a_413_in_the_apis_shape(tiny_pair, engine, route,
                                                                headers, shape):
    """By its Content-Length, and, sent in chunks without one, once its bytes pass the bound;
    the server goes on serving."""
    big = json.dumps(chat_body("word " * 4_000)).encode()  # 20 kB; the bound is 10 kB

    async def chunks():
        for i in range(0, len(big), 1_000):
            yield big[i:i + 1_000]

    async with asgi_client(small_app(tiny_pair, engine, max_body_mb=0.01)) as c:
        for content in (big, chunks()):
            r = await c.post(route, content=content, headers=headers)
            assert r.status_code == 413 and shape(r.json()), r.text
            assert "10,000 bytes (server.max_body_mb)" in r.text
        assert (await c.post("/tokenize", json={"prompt": "word " * 100})).status_code == 200


def test_a_413_over_a_real_socket_leaves_the_server_serving(tiny_pair, engine):
    with served_url(*tiny_pair, engine=engine, max_body_mb=0.01) as url, \
            httpx.Client(base_url=url, timeout=60) as c:
        big = json.dumps(chat_body("word " * 40_000)).encode()
        r = c.post("/v1/chat/completions", content=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert f"({len(big):,} bytes)" in r.json()["error"]["message"]  # its Content-Length
        assert c.get("/health").status_code == 200
        r = c.post("/v1/chat/completions", json=chat_body(max_tokens=2))
        assert r.status_code == 200, r.text


@pytest.mark.anyio
async def test_a_batch_upload_is_bounded_by_the_files_budget(tiny_pair, engine):
    """A file larger than max_body_mb uploads within files_max_gb; beyond that, a 413."""
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                       "body": chat_body("word " * 3_000)}) + "\n"
    app = small_app(tiny_pair, engine, max_body_mb=0.01, files_max_gb=30e-6)
    async with asgi_client(app) as c:
        r = await c.post("/v1/files", files={"file": ("in.jsonl", line.encode())},
                         data={"purpose": "batch"})
        assert r.status_code == 200, r.text
        r = await c.post("/v1/files", files={"file": ("in.jsonl", (line * 3).encode())},
                         data={"purpose": "batch"})
        assert r.status_code == 413 and "server.files_max_gb" in r.json()["error"]["message"]


def test_every_route_parses_its_json_off_the_event_loop(app):
    routes = list(api_routes(app.router.routes))
    assert len(routes) > 50 and all(isinstance(r, OffLoopJson) for r in routes), \
        [r.path for r in routes if not isinstance(r, OffLoopJson)]


def api_routes(routes):
    """FastAPI's routes, also those of routers it keeps whole (newer FastAPI includes a router
    as one entry, older ones copy its routes)."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from api_routes(included.routes)


class Gate:
    """`real`, held for the calls `big(args)` picks until `release` is set."""

    def __init__(self, real, big):
        self.real, self.big = real, big
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, *args, **kwargs):
        if self.big(args):
            self.entered.set()
            self.release.wait(60)
        return self.real(*args, **kwargs)


def test_health_and_a_stream_answer_while_a_large_request_is_parsed_and_tokenized(
        tiny_pair, engine, monkeypatch):
    """A 1 MB request is held inside its JSON parsing, then inside its template rendering and
    tokenization: each time, /health answers and the running stream sends more tokens. Were
    either step on the event loop, neither could until the gate opened (after 60 s)."""
    parse = Gate(bodies.parse_json, lambda args: len(args[0]) > 1_000_000)
    tokenize = Gate(tools.chat_tokens, lambda args: len(args[1][-1]["content"]) > 1_000_000)
    monkeypatch.setattr(bodies, "parse_json", parse)
    monkeypatch.setattr(tools, "chat_tokens", tokenize)
    chunks, stop = [], threading.Event()
    with served_url(*tiny_pair, engine=engine) as url:
        reader = threading.Thread(target=stream, args=(url, chunks, stop), daemon=True)
        reader.start()
        big: list[httpx.Response] = []
        try:
            wait_for(lambda: len(chunks) >= 2)
            threading.Thread(target=lambda: big.append(httpx.post(
                f"{url}/v1/chat/completions", json=chat_body("word " * 220_000), timeout=120)),
                daemon=True).start()
            for gate in (parse, tokenize):
                assert gate.entered.wait(60)
                seen = len(chunks)
                assert httpx.get(f"{url}/health", timeout=30).status_code == 200
                wait_for(lambda: len(chunks) > seen)  # noqa: B023 - evaluated right here
                assert not big  # still held
                gate.release.set()
            wait_for(lambda: big)
            assert big[0].status_code == 400, big[0].text  # processed: longer than the context
            assert big[0].json()["error"]["code"] == "context_length_exceeded"
        finally:
            parse.release.set()
            tokenize.release.set()
            stop.set()
    reader.join(30)


def stream(url: str, chunks: list, stop: threading.Event) -> None:
    body = chat_body(max_tokens=3_900, ignore_eos=True, stream=True)
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if stop.is_set():
                    return
                if line.startswith("data: "):
                    chunks.append(line)
    except httpx.HTTPError:  # the server stopped under the stream: the test is over
        pass


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
