"""Client mistakes get OpenAI-shaped 4xx errors and the server keeps serving; load limits."""

from __future__ import annotations

import json

import pytest
from support.http import chat_body

pytestmark = pytest.mark.anyio

MSG = [{"role": "user", "content": "hi"}]
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"

BAD_REQUESTS = [
    # (name, url, raw body or dict, status, param)
    ("malformed json", CHAT, b"{not json", 400, None),
    ("body not an object", CHAT, b"[1, 2]", 400, None),
    ("messages missing", CHAT, {"model": "x"}, 400, "messages"),
    ("messages empty", CHAT, {"messages": []}, 400, "messages"),
    ("messages wrong type", CHAT, {"messages": "hello"}, 400, "messages"),
    ("unknown role", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages.0.role"),
    ("max_tokens negative", CHAT, {"messages": MSG, "max_tokens": -5}, 400, "max_tokens"),
    ("max_tokens zero", CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens wrong type", CHAT, {"messages": MSG, "max_tokens": "ten"}, 400, "max_tokens"),
    ("n = 129", CHAT, {"messages": MSG, "n": 129}, 400, "n"),
    ("n = 0", CHAT, {"messages": MSG, "n": 0}, 400, "n"),
    ("temperature too high", CHAT, {"messages": MSG, "temperature": 3}, 400, "temperature"),
    ("top_p zero", CHAT, {"messages": MSG, "top_p": 0}, 400, "top_p"),
    ("negative num_draft_tokens", CHAT, {"messages": MSG, "num_draft_tokens": -1}, 400,
     "num_draft_tokens"),
    ("stream not bool", CHAT, {"messages": MSG, "stream": "yes please"}, 400, "stream"),
    ("too many stops", CHAT, {"messages": MSG, "stop": list("abcde")}, 400, "stop"),
    ("unknown model", CHAT, {"messages": MSG, "model": "gpt-9"}, 404, "model"),
    ("top_logprobs without logprobs", CHAT, {"messages": MSG, "top_logprobs": 2}, 400, None),
    ("tools", CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, None),
    ("tool message without tool_call_id", CHAT,
     {"messages": [*MSG, {"role": "tool", "content": "sunny"}]}, 400, "messages.1"),
    ("bad logit_bias key", CHAT, {"messages": MSG, "logit_bias": {"abc": 1}}, 400,
     "logit_bias"),
    ("logit_bias id out of vocab", CHAT, {"messages": MSG, "logit_bias": {"999999": 1}}, 400,
     "logit_bias"),
    ("bad acceptance", CHAT, {"messages": MSG, "acceptance": "maybe"}, 400, "acceptance"),
    ("hybrid_min_match 0", CHAT, {"messages": MSG, "hybrid_min_match": 0}, 400,
     "hybrid_min_match"),
    ("hybrid_min_match above lookup's 3", CHAT, {"messages": MSG, "hybrid_min_match": 4}, 400,
     "hybrid_min_match"),
    ("prompt missing", TEXT, {"max_tokens": 3}, 400, "prompt"),
    ("prompt empty", TEXT, {"prompt": ""}, 400, "prompt"),
    ("an empty prompt among several", TEXT, {"prompt": ["a", ""]}, 400, "prompt"),
    ("an empty token list", TEXT, {"prompt": [[1, 2], []]}, 400, "prompt"),
    ("129 prompts", TEXT, {"prompt": ["a"] * 129}, 400, "prompt"),
    ("n times the prompts over 128", TEXT, {"prompt": ["a"] * 5, "n": 26}, 400, None),
    ("more choices than the queue", TEXT, {"prompt": ["a"] * 2, "n": 40}, 400, "n"),
    ("mixed prompt types", TEXT, {"prompt": ["a", [1, 2]]}, 400, "prompt"),
    ("token id out of range in a list", TEXT, {"prompt": [[1], [10_000_000]]}, 400, "prompt"),
    ("token id out of range", TEXT, {"prompt": [1, 10_000_000]}, 400, "prompt"),
    ("max_tokens 0 without echo", TEXT, {"prompt": "a", "max_tokens": 0}, 400, None),
    ("suffix", TEXT, {"prompt": "a", "suffix": "b"}, 400, None),
]


@pytest.mark.parametrize("name, url, body, status, param", BAD_REQUESTS,
                         ids=[b[0] for b in BAD_REQUESTS])
async def test_bad_request(client, name, url, body, status, param):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    r = await client.post(url, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    ok = await client.post(CHAT, json=chat_body(max_tokens=2))
    assert ok.status_code == 200


async def test_streamed_bad_request_is_an_http_error(client):
    async with client.stream("POST", CHAT, json={"messages": MSG, "n": 300, "stream": True}) as r:
        assert r.status_code == 400
        assert json.loads(await r.aread())["error"]["param"] == "n"


@pytest.mark.parametrize("method,path", [("POST", "/v1/moderations"), ("GET", "/v1/nothing"),
                                         ("POST", "/v1/audio/speech"), ("GET", "/nothing")])
async def test_unknown_endpoint_is_an_openai_404_naming_it(client, method, path):
    r = await client.request(method, path, json={"input": "x"})
    assert r.status_code == 404
    assert r.json() == {"error": {
        "message": f"{method} {path} is not supported by this server (its endpoints are "
                   "listed at /docs)",
        "type": "invalid_request_error", "param": None, "code": "unknown_endpoint"}}


async def test_wrong_method_is_an_openai_405(client):
    r = await client.get(CHAT)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json() == {"error": {
        "message": f"GET is not allowed on {CHAT}; use POST",
        "type": "invalid_request_error", "param": None, "code": "method_not_allowed"}}


async def test_a_route_added_after_the_app_is_built_is_not_shadowed(app, client):
    app.router.add_api_route("/v1/late", lambda: {"late": True}, methods=["GET"])
    r = await client.get("/v1/late")
    assert r.status_code == 200 and r.json() == {"late": True}


