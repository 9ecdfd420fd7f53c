"""Hybrid and sliding-window models through every API, as llama is: the same text as
`mlx_lm` with the draft on, structured output and tools, log-probabilities, the draft's unload
and load, `n` choices, the prefix cache across a chat's turns.

The models are tiny random ones of `mlx_lm`'s own architectures (the `zoo` fixture):
Qwen3.5's Gated DeltaNet + attention, and Gemma 3's sliding window + global attention.
"""

from __future__ import annotations

import json

import jsonschema
import mlx.core as mx
import pytest
from mlx_lm import load
from support.http import chat_body, read_sse
from support.models import mlx_lm_chat
from support.servers import served

pytestmark = pytest.mark.anyio
FAMILIES = ["qwen3_5", "gemma3_text"]
MAX = 16
PROMPT = "Write a function that adds two numbers"
SCHEMA = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"],
          "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}}, "required": ["city"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, zoo):
    return request.param, zoo[request.param]


@pytest.fixture(scope="module")
def expected(family) -> str:
    return mlx_lm_chat(family[1][0], PROMPT, MAX)


async def test_every_api_gives_mlx_lms_text_with_the_draft_drafting(family, expected):
    _, (target, draft) = family
    async with served(target, draft, models={"model_name": "m"}) as (client, _):
        body = chat_body(PROMPT, max_tokens=MAX, num_draft_tokens=3)
        chat = (await client.post("/v1/chat/completions", json=body)).json()
        assert chat["choices"][0]["message"]["content"] == expected
        assert chat["stats"]["draft_tokens_proposed"] > 0
        async with client.stream("POST", "/v1/chat/completions",
                                 json={**body, "stream": True}) as r:
            chunks = [c for c in await read_sse(r) if isinstance(c, dict) and c["choices"]]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == expected
        responses = (await client.post("/v1/responses", json={
            "input": PROMPT, "max_output_tokens": MAX, "num_draft_tokens": 3})).json()
        assert responses["output"][0]["content"][0]["text"] == expected
        messages = (await client.post("/v1/messages", json={
            "model": "m", "max_tokens": MAX, "num_draft_tokens": 3,
            "messages": [{"role": "user", "content": PROMPT}]})).json()
        assert messages["content"][0]["text"] == expected
        ollama = (await client.post("/api/chat", json={
            "model": "m", "stream": False, "options": {"num_predict": MAX},
            "messages": [{"role": "user", "content": PROMPT}]})).json()
        assert ollama["message"]["content"] == expected


async def test_structured_output_tools_and_logprobs(family):
    _, (target, draft) = family
    async with served(target, draft) as (client, _):
        r = await client.post("/v1/chat/completions", json=chat_body(
            PROMPT, max_tokens=60, num_draft_tokens=3,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}))
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), SCHEMA)
        r = await client.post("/v1/chat/completions", json=chat_body(
            "Weather?", max_tokens=300, num_draft_tokens=3, tools=[WEATHER],
            tool_choice="required"))
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls", r.text
        call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
        assert call["name"] == "get_weather" and "city" in json.loads(call["arguments"])
        r = await client.post("/v1/chat/completions", json=chat_body(
            PROMPT, max_tokens=4, logprobs=True, top_logprobs=2, num_draft_tokens=3))
        first = r.json()["choices"][0]["logprobs"]["content"][0]
        model, tokenizer = load(str(target))
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                               add_generation_prompt=True)
        logits = model(mx.array(prompt)[None])[0, -1].astype(mx.float32)
        assert first["logprob"] == pytest.approx(
            (logits - mx.logsumexp(logits)).max().item(), abs=1e-3)


async def test_the_draft_unloads_and_loads_while_serving(family, expected):
    _, (target, draft) = family
    async with served(target, draft, model_roots=[target.parent]) as (client, _):
        body = chat_body(PROMPT, max_tokens=MAX)
        assert (await client.delete("/v1/models/draft")).status_code == 200
        plain = (await client.post("/v1/chat/completions", json=body)).json()
        assert plain["choices"][0]["message"]["content"] == expected
        assert plain["stats"]["draft_model"] == "prompt_lookup+suffix"  # hybrid goes on
        r = await client.post("/v1/models/draft", json={"model": str(draft)})
        assert r.status_code == 200, r.text
        drafted = (await client.post("/v1/chat/completions",
                                     json={**body, "num_draft_tokens": 3})).json()
        assert drafted["choices"][0]["message"]["content"] == expected
        assert drafted["stats"]["draft_tokens_proposed"] > 0


async def test_n_choices_and_the_second_turn_from_the_prefix_cache(family, expected):
    _, (target, draft) = family
    async with served(target, draft) as (client, _):
        r = (await client.post("/v1/chat/completions", json=chat_body(
            PROMPT, max_tokens=MAX, n=2, num_draft_tokens=3))).json()
        assert [c["message"]["content"] for c in r["choices"]] == [expected, expected]
        turns = [{"role": "user", "content": PROMPT},
                 {"role": "assistant", "content": expected},
                 {"role": "user", "content": "And subtract them"}]
        second = (await client.post("/v1/chat/completions", json={
            "messages": turns, "max_tokens": MAX, "num_draft_tokens": 3})).json()
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert second["choices"][0]["message"]["content"] == mlx_lm_chat(target, turns, MAX)
