"""The tokenizer endpoints (vLLM's shape) against the served tokenizer and the prompts the
generation routes prefill."""

from __future__ import annotations

import pytest
from support.http import chat_body

pytestmark = pytest.mark.anyio

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


async def test_tokenize_prompt_is_what_completions_prefill(client, loaded_pair):
    tokenizer = loaded_pair[1]
    r = await client.post("/tokenize", json={"prompt": "def binary_search(",
                                             "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode("def binary_search(")
    assert body["count"] == len(body["tokens"])
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    done = (await client.post("/v1/completions", json={"prompt": "def binary_search(",
                                                        "max_tokens": 1})).json()
    assert done["usage"]["prompt_tokens"] == body["count"]
    assert body["max_model_len"] == client._transport.app.state.engine.context_length
    bare = (await client.post("/tokenize", json={"prompt": "x y",
                                                 "add_special_tokens": False})).json()
    assert bare["tokens"] == tokenizer.encode("x y", add_special_tokens=False)
    assert bare["token_strs"] is None


@pytest.mark.parametrize("tools", [None, TOOLS])
async def test_tokenize_messages_counts_the_chat_prompt(client, tools):
    chat = chat_body("What is the weather in Paris?", max_tokens=1, temperature=0)
    if tools:
        chat["tools"] = tools
    r = await client.post("/tokenize", json={"messages": chat["messages"], "tools": tools})
    assert r.status_code == 200, r.text
    done = (await client.post("/v1/chat/completions", json=chat)).json()
    assert r.json()["count"] == done["usage"]["prompt_tokens"]


async def test_detokenize_round_trip(client, loaded_pair):
    tokenizer = loaded_pair[1]
    ids = tokenizer.encode("hello world, again")
    r = await client.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200
    assert r.json() == {"prompt": tokenizer.decode(ids)}


async def test_tokenizer_info(client, loaded_pair):
    hf = loaded_pair[1]._tokenizer
    r = await client.get("/tokenizer_info")
    assert r.status_code == 200
    info = r.json()
    assert info["eos_token"] == hf.eos_token
    assert info["bos_token"] == hf.bos_token
    assert info["chat_template"] == hf.chat_template
    assert info["tokenizer_class"] == type(hf).__name__


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, None),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
    ("/tokenize", {"prompt": "a", "tools": TOOLS}, None),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [0, -1]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
async def test_bad_bodies_are_400(client, path, body, param):
    r = await client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param:
        assert error["param"] == param


async def test_unknown_model_is_404(client):
    r = await client.post("/tokenize", json={"prompt": "a", "model": "nope"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
