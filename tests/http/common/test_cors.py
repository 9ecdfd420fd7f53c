"""CORS (`server.cors_origins`): which browser pages may call the API, by the headers a
browser acts on. The default lets pages served from this machine in and no other; a list
names the origins; ["*"] lets any in; [] none. A browser enforcing it: test_playground.py."""

from __future__ import annotations

import httpx
import pytest
from support.http import chat_body
from support.servers import make_settings

from server.config import Settings
from server.http.app import create_app

pytestmark = pytest.mark.anyio
LOCAL = ["http://localhost:5173", "http://127.0.0.1:3000", "https://localhost", "http://[::1]:80"]
ELSEWHERE = ["https://evil.example", "http://localhost.evil.example", "null",
             "http://127.0.0.1.evil.example:80", "http://localhost:80/x"]


def preflight(origin: str, method: str = "POST") -> dict:
    return {"Origin": origin, "Access-Control-Request-Method": method,
            "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os"}


async def client_for(engine, tiny_pair, origins) -> httpx.AsyncClient:
    app = create_app(make_settings(*tiny_pair, cors_origins=origins), engine)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def test_by_default_pages_of_this_machine_only(engine, tiny_pair):
    async with await client_for(engine, tiny_pair, None) as c:
        for origin in LOCAL:
            r = await c.options("/v1/chat/completions", headers=preflight(origin))
            assert r.status_code == 200, origin
            assert r.headers["access-control-allow-origin"] == origin
            assert "POST" in r.headers["access-control-allow-methods"]
            assert r.headers["access-control-allow-headers"] == \
                "authorization,content-type,x-stainless-os"
            r = await c.get("/v1/models", headers={"Origin": origin})
            assert r.headers["access-control-allow-origin"] == origin
            assert r.headers["access-control-expose-headers"] == "Retry-After, X-Request-Id"
        for origin in ELSEWHERE:
            r = await c.options("/v1/chat/completions", headers=preflight(origin))
            assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
            r = await c.get("/v1/models", headers={"Origin": origin})
            assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


async def test_a_streamed_answer_and_an_error_carry_the_header(engine, tiny_pair):
    origin = {"Origin": "http://localhost:8080"}
    async with await client_for(engine, tiny_pair, None) as c:
        r = await c.post("/v1/chat/completions", json=chat_body(max_tokens=2, stream=True),
                         headers=origin)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        assert r.headers["access-control-allow-origin"] == origin["Origin"]
        r = await c.post("/v1/chat/completions", json={"messages": []}, headers=origin)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert r.headers["access-control-allow-origin"] == origin["Origin"]


async def test_admin_endpoints_never_answer_another_origin(engine, tiny_pair):
    for origins in (None, ["*"]):
        async with await client_for(engine, tiny_pair, origins) as c:
            for path, method in [("/v1/models/draft", "POST"), ("/v1/models/draft", "DELETE"),
                                 ("/v1/models/draft/compatibility", "POST"),
                                 ("/v1/cache", "DELETE")]:
                r = await c.options(path, headers=preflight("http://localhost:5173", method))
                assert "access-control-allow-origin" not in r.headers, (origins, path)
            r = await c.delete("/v1/cache", headers={"Origin": "http://localhost:5173"})
            assert "access-control-allow-origin" not in r.headers
            r = await c.get("/v1/models", headers={"Origin": "http://localhost:5173"})
            assert "access-control-allow-origin" in r.headers


async def test_named_origins_any_or_none(engine, tiny_pair):
    async with await client_for(engine, tiny_pair, ["https://chat.example.org"]) as c:
        r = await c.options("/v1/messages", headers=preflight("https://chat.example.org"))
        assert r.headers["access-control-allow-origin"] == "https://chat.example.org"
        for origin in ["http://localhost:5173", "https://evil.example"]:
            r = await c.options("/v1/messages", headers=preflight(origin))
            assert r.status_code == 400
    async with await client_for(engine, tiny_pair, ["*"]) as c:
        r = await c.get("/v1/models", headers={"Origin": "https://evil.example"})
        assert r.headers["access-control-allow-origin"] == "*"
        private = {**preflight("https://any.example"),
                   "Access-Control-Request-Private-Network": "true"}
        r = await c.options("/v1/chat/completions", headers=private)
        assert r.status_code == 200
        assert r.headers["access-control-allow-private-network"] == "true"
    async with await client_for(engine, tiny_pair, []) as c:
        r = await c.get("/v1/models", headers={"Origin": "http://localhost:5173"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r = await c.options("/v1/chat/completions", headers=preflight("http://localhost:5173"))
        assert r.status_code == 405  # no CORS: OPTIONS is just a method no route takes


def test_the_setting_comes_from_the_file_and_the_environment(tmp_path, monkeypatch):
    assert Settings.load(None).server.cors_origins is None
    config = tmp_path / "c.yaml"
    config.write_text("server:\n  cors_origins: ['https://a.example']\n")
    assert Settings.load(config).server.cors_origins == ["https://a.example"]
    monkeypatch.setenv("MLX_SPEC_SERVER__CORS_ORIGINS", '["*"]')
    assert Settings.load(config).server.cors_origins == ["*"]
