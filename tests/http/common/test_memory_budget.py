"""The memory budget seen from the APIs: a request that could never fit is a 400 in its API's
shape naming the limit, a default max_tokens is cut to the room left, and /health and /metrics
show the budget (`engine.memory_budget_gb`)."""

from __future__ import annotations

import pytest
from support.http import chat_body
from support.servers import served

from server.engine.scheduling.memory_gate import prefill_transient

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

BUDGET_GB = 0.001
# The tiny target keeps 1 KiB per token and allocates 256 positions at a time, so a row of n
# tokens is at most (n + 255) KiB: 1 MB holds 721 tokens.
ROOM = 721


@pytest.fixture()
async def budgeted(tiny_pair):
    async with served(*tiny_pair, engine={"memory_budget_gb": BUDGET_GB}) as (client, engine):
        yield client, engine


async def test_health_and_metrics_show_the_budget(budgeted):
    client, engine = budgeted
    memory = (await client.get("/health")).json()["memory"]
    expected = prefill_transient(engine.kit.target.model,  # a CPU's, before any step
                                 engine.scheduler.config.idle_prefill_chunk)
    assert memory == {"budget_bytes": 1_000_000, "limit_bytes": None,
                      "limit_source": "configured", "reserved_bytes": 0, "margin_bytes": 0,
                      "transient_bytes": expected, "kv_bytes": 0, "max_request_tokens": ROOM,
                      "preemptions": 0, "paused": 0}
    metrics = (await client.get("/metrics")).text
    assert "mlx_spec_memory_budget_bytes 1e+06" in metrics
    assert "mlx_spec_num_preemptions_total 0.0" in metrics
    assert "mlx_spec_kv_cache_usage_perc 0.0" in metrics


async def test_a_request_that_could_never_fit_is_a_400_in_its_apis_shape(budgeted):
    client, engine = budgeted
    r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=ROOM))
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "memory_budget_exceeded"
    assert error["param"] == "max_tokens"
    assert "memory budget for KV caches is 0.001 GB (engine.memory_budget_gb)" in \
        error["message"]
    prompt = len(engine.tokenizer.apply_chat_template(
        chat_body()["messages"], add_generation_prompt=True))
    assert f"so max_tokens may be at most {ROOM - prompt}" in error["message"]
    ok = await client.post("/v1/chat/completions",
                           json=chat_body(max_tokens=ROOM - prompt, ignore_eos=True))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == ROOM - prompt

    r = await client.post("/v1/messages", json={
        "model": engine.model_name, "max_tokens": 1000,
        "messages": [{"role": "user", "content": "Write a function"}]})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "memory budget" in r.json()["error"]["message"]

    r = await client.post("/api/chat", json={
        "model": engine.model_name, "stream": False, "options": {"num_predict": 1000},
        "messages": [{"role": "user", "content": "Write a function"}]})
    assert r.status_code == 400 and "options.num_predict may be at most" in r.json()["error"]

    r = await client.post("/v1/completions", json={"prompt": "word " * ROOM, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "whose KV cache alone does not fit" in r.json()["error"]["message"]


async def test_a_default_max_tokens_is_cut_to_the_room_left(tiny_pair):
    """A Responses request without max_output_tokens may fill the context: here, the room the
    memory budget leaves after its prompt."""
    async with served(*tiny_pair, engine={"memory_budget_gb": BUDGET_GB}) as (client, _):
        r = await client.post("/v1/responses", json={"input": "Write a story",
                                                      "ignore_eos": True})
        body = r.json()
        assert r.status_code == 200, body
        usage = body["usage"]
        assert usage["input_tokens"] + usage["output_tokens"] == ROOM
        assert body["status"] == "incomplete"
