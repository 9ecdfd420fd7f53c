"""Every answer validates as the official SDKs' own types, strictly (`model_validate`: every
field they require present, of their type). The SDKs build their objects without validating
them, so a missing field would only show in a typed client of another language; this catches
it here. Our extensions are extra fields, which the SDK types allow."""

from __future__ import annotations

import json

import pytest
from pydantic import TypeAdapter
from support.http import chat_body

pytestmark = pytest.mark.anyio
openai_types = pytest.importorskip("openai.types")  # dev extras; `make test` installs them
anthropic_types = pytest.importorskip("anthropic.types")

TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
FORCED = {"type": "function", "function": {"name": "get_weather"}}


async def sse(client, path: str, body: dict) -> list[dict]:
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) async for line in r.aiter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("extra", [{}, {"logprobs": True, "top_logprobs": 2},
                                   {"tools": [TOOL], "tool_choice": FORCED, "max_tokens": 64}],
                         ids=["text", "logprobs", "tool-call"])
async def test_chat_completions(client, extra):
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    body = chat_body(**{"max_tokens": 6, "stream_options": None, **extra})
    r = await client.post("/v1/chat/completions", json=body)
    ChatCompletion.model_validate(r.json())
    chunks = await sse(client, "/v1/chat/completions",
                       {**body, "stream_options": {"include_usage": True}})
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)


@pytest.mark.parametrize("extra", [{"logprobs": 2}, {"echo": True}])
async def test_text_completions(client, extra):
    """Not checked where OpenAI's own answers differ from the SDK's type: an echoed prompt's
    first token has a null logprob, and a streamed chunk a null finish_reason until the last."""
    from openai.types import Completion

    body = {"prompt": "def add(a, b):", "max_tokens": 6, **extra}
    Completion.model_validate((await client.post("/v1/completions", json=body)).json())
    chunks = await sse(client, "/v1/completions", body)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    Completion.model_validate(chunks[-1])


@pytest.mark.parametrize("extra", [
    {}, {"include": ["message.output_text.logprobs"], "top_logprobs": 1},
    {"tools": [{"type": "function", **TOOL["function"]}],
     "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 64}],
    ids=["text", "logprobs", "tool-call"])
async def test_responses(client, extra):
    from openai.types.responses import Response, ResponseStreamEvent

    body = {"input": "Write a function", "max_output_tokens": 16, **extra}
    Response.model_validate((await client.post("/v1/responses", json=body)).json())
    events = TypeAdapter(ResponseStreamEvent)
    for event in await sse(client, "/v1/responses", body):
        events.validate_python(event)


@pytest.mark.parametrize("extra", [
    {}, {"tools": [{"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}],
         "tool_choice": {"type": "tool", "name": "get_weather"}, "max_tokens": 64}],
    ids=["text", "tool-use"])
async def test_messages(client, extra):
    from anthropic.types import Message, RawMessageStreamEvent

    body = {"model": "", "max_tokens": 8, **extra,
            "messages": [{"role": "user", "content": "Write a function"}]}
    Message.model_validate((await client.post("/v1/messages", json=body)).json())
    events = TypeAdapter(RawMessageStreamEvent)
    for event in await sse(client, "/v1/messages", body):
        if event["type"] != "ping":
            events.validate_python(event)


async def test_model_lists(client):
    from anthropic.types import ModelInfo
    from openai.types import Model

    for entry in (await client.get("/v1/models")).json()["data"]:
        Model.model_validate(entry)
    listed = await client.get("/v1/models", headers={"anthropic-version": "2023-06-01"})
    for entry in listed.json()["data"]:
        ModelInfo.model_validate(entry)
