"""POST /v1/models/target: serving another target (and draft) at run time, against mlx_lm on
the models loaded directly; what happens to requests in flight; failed loads change nothing."""

from __future__ import annotations

import asyncio
import json

import pytest
from support.http import chat_body
from support.models import corrupt_copy, mlx_lm_chat
from support.servers import served

from server.engine.errors import ModelReplaced
from server.engine.params import GenerationParams

pytestmark = pytest.mark.anyio
MAX = 12


@pytest.fixture()
async def admin_env(tiny_pair, model_dir):
    async with served(*tiny_pair, model_roots=[model_dir]) as env:
        yield env


def mlx_lm_text(path, content="Write a function", draft=None):
    return mlx_lm_chat(path, content, MAX, draft=draft)


async def chat(client, **extra):
    r = await client.post("/v1/chat/completions",
                          json=chat_body(max_tokens=MAX, temperature=0, **extra))
    assert r.status_code == 200, r.text
    return r.json()


async def test_another_target_serves_and_a_draft_it_cannot_use_is_dropped(
        admin_env, tiny_pair, foreign_model):
    client, _ = admin_env
    r = await client.post("/v1/models/target", json={"model": str(foreign_model)})
    assert r.status_code == 200, r.text
    card = r.json()
    assert (card["role"], card["id"], card["draft"]) == ("target", str(foreign_model), None)
    models = (await client.get("/v1/models")).json()["data"]
    assert [(m["role"], m["path"]) for m in models] == [("target", str(foreign_model))]
    out = await chat(client)
    assert out["model"] == str(foreign_model)  # without the draft: hybrid drafts on the host
    assert out["stats"]["draft_model"] == "prompt_lookup+suffix"
    assert out["choices"][0]["message"]["content"] == mlx_lm_text(foreign_model)

    # Back, with a name and the draft: speculation again, the text the target's own.
    r = await client.post("/v1/models/target", json={
        "model": str(tiny_pair[0]), "model_name": "tiny", "draft_model": str(tiny_pair[1]),
        "num_draft_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["draft"]["path"] == str(tiny_pair[1])
    out = await chat(client, model="tiny", num_draft_tokens=2)
    assert out["choices"][0]["message"]["content"] == mlx_lm_text(tiny_pair[0])
    assert out["stats"]["draft_tokens_proposed"] > 0
    assert (await client.get("/health")).json()["target"] == "tiny"


async def test_a_compatible_draft_is_kept_unless_the_request_drops_it(admin_env, tiny_pair):
    client, _ = admin_env
    r = await client.post("/v1/models/target", json={"model": str(tiny_pair[0])})
    assert r.json()["draft"]["path"] == str(tiny_pair[1])  # same tokenizer: kept
    r = await client.post("/v1/models/target", json={"model": str(tiny_pair[0]),
                                                      "draft_model": None})
    assert r.json()["draft"] is None
    assert len((await client.get("/v1/models")).json()["data"]) == 1


async def test_requests_in_flight_end_with_a_503_and_the_server_goes_on(admin_env, tiny_pair):
    client, _ = admin_env
    body = chat_body(max_tokens=4000, ignore_eos=True, stream=True)

    async def long_stream():
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            return [line async for line in r.aiter_lines() if line.startswith("data: ")]

    running = asyncio.create_task(long_stream())
    await asyncio.sleep(0.5)
    r = await client.post("/v1/models/target", json={"model": str(tiny_pair[0])})
    assert r.status_code == 200, r.text
    lines = await asyncio.wait_for(running, 60)
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == "model_replaced" and "send the request again" in error["message"]
    assert (await chat(client))["choices"][0]["finish_reason"] == "length"


async def test_a_prompt_tokenized_for_the_previous_target_is_refused(admin_env):
    _, engine = admin_env
    stale = GenerationParams(prompt_tokens=(1, 2, 3), max_tokens=2, target="previous")
    with pytest.raises(ModelReplaced):
        engine.submit(stale)
    with pytest.raises(ModelReplaced):  # the scoring of an echoed prompt too
        await engine.prompt_logprobs([1, 2, 3], 0, target="previous")
    assert len((await engine.prompt_logprobs([1, 2, 3], 0)).logprobs) == 2


async def test_failed_loads_leave_the_previous_models_serving(admin_env, tiny_pair, model_dir,
                                                              foreign_model):
    client, _ = admin_env
    r = await client.post("/v1/models/target", json={"model": str(model_dir / "missing")})
    assert r.status_code == 404
    corrupt = corrupt_copy(tiny_pair[0], model_dir / "corrupt-target")
    r = await client.post("/v1/models/target", json={"model": str(corrupt)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_load_failed"
    r = await client.post("/v1/models/target", json={"model": str(foreign_model),
                                                      "draft_model": str(tiny_pair[1])})
    assert r.status_code == 409 and r.json()["error"]["code"] == "incompatible_draft"
    out = await chat(client, num_draft_tokens=2)
    assert out["model"] == str(tiny_pair[0]) and out["stats"]["draft_tokens_proposed"] > 0


async def test_only_admins_and_only_from_the_model_roots(tiny_pair, tmp_path):
    async with served(*tiny_pair, admin_api_key="admin") as (client, _):
        r = await client.post("/v1/models/target", json={"model": str(tiny_pair[0])})
        assert r.status_code == 401
        r = await client.post("/v1/models/target", json={"model": str(tmp_path)},
                              headers={"Authorization": "Bearer admin"})
        assert r.status_code == 403


async def test_an_ollama_stream_in_flight_ends_with_its_error_line(admin_env, tiny_pair):
    """Ollama's stream reports the replacement as its last JSON line, `{"error": ...}` (what
    Ollama's clients raise), after the lines written before it."""
    client, _ = admin_env
    body = {"model": str(tiny_pair[0]), "messages": [{"role": "user", "content": "Write"}],
            "options": {"num_predict": 4000}, "ignore_eos": True}

    async def long_stream():
        async with client.stream("POST", "/api/chat", json=body) as r:
            return [json.loads(line) async for line in r.aiter_lines() if line]

    running = asyncio.create_task(long_stream())
    await asyncio.sleep(0.5)
    r = await client.post("/v1/models/target", json={"model": str(tiny_pair[0])})
    assert r.status_code == 200, r.text
    lines = await asyncio.wait_for(running, 60)
    assert list(lines[-1]) == ["error"] and "send the request again" in lines[-1]["error"]
    assert lines[:-1] and all(line["done"] is False for line in lines[:-1])
