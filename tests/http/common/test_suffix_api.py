"""Suffix drafting through the API: a repeated request drafts the first answer (streamed, its
tokens flagged `from_draft`), one API key's answers never draft another key's requests, and a
server with suffix drafting off refuses `draft: "suffix"` and names what hybrid combines."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from support.http import chat_body, read_sse
from support.servers import served

from server.http.common.auth import tenant_of

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"
TOKENS = 48


def body(**extra):
    return chat_body("Once upon a time", max_tokens=TOKENS, ignore_eos=True, temperature=0,
                     draft="suffix", **extra)


def request_with(api_key: str | None, headers: dict) -> SimpleNamespace:
    settings = SimpleNamespace(server=SimpleNamespace(api_key=api_key))
    return SimpleNamespace(headers=headers, app=SimpleNamespace(state=SimpleNamespace(
        settings=settings)))


def test_a_tenant_is_an_opaque_id_of_the_key():
    assert tenant_of(request_with(None, {"authorization": "Bearer anything"})) == ""
    one = tenant_of(request_with("k1", {"authorization": "Bearer key-number-one"}))
    assert one == tenant_of(request_with("k1", {"x-api-key": "key-number-one"}))
    assert one != tenant_of(request_with("k1", {"authorization": "Bearer key-number-two"}))
    assert one and "key-number-one" not in one and len(one) == 16


async def test_a_repeated_request_drafts_its_first_answer(tiny_pair):
    async with served(*tiny_pair) as (client, _):
        first = (await client.post(CHAT, json=body())).json()
        async with client.stream("POST", CHAT, json=body(stream=True)) as r:
            chunks = [c for c in await read_sse(r) if c != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == first["choices"][0]["message"]["content"]
    flagged = sum(bool(c["choices"][0].get("from_draft")) for c in chunks if c["choices"])
    stats = chunks[-1]["stats"] if "stats" in chunks[-1] else next(
        c["stats"] for c in chunks if c.get("stats"))
    assert stats["draft_model"] == "suffix" and stats["generation_tokens"] == TOKENS
    assert flagged == stats["draft_tokens_accepted"] >= 0.8 * TOKENS
    assert stats["draft_tokens_accepted"] > first["stats"]["draft_tokens_accepted"]


async def test_one_keys_answers_never_draft_anothers(tiny_pair):
    """The second key's first request drafts exactly as the first key's first one did (from
    its own text only); the first key's repeat drafts its answer."""
    async with served(*tiny_pair, api_key="k1", admin_api_key="k2") as (client, _):
        def post(key):
            return client.post(CHAT, json=body(), headers={"Authorization": f"Bearer {key}"})

        first, again, other = [(await post(key)).json() for key in ("k1", "k1", "k2")]
    texts = {r["choices"][0]["message"]["content"] for r in (first, again, other)}
    assert len(texts) == 1
    accepted = [r["stats"]["draft_tokens_accepted"] for r in (first, again, other)]
    assert accepted[2] == accepted[0] and accepted[1] >= 0.8 * TOKENS > accepted[0]


async def test_suffix_drafting_off_refuses_it_and_hybrid_combines_the_rest(tiny_pair,
                                                                          monkeypatch):
    monkeypatch.setenv("MLX_SPEC_DEFAULTS__DRAFT", "hybrid")
    name = str(tiny_pair[1])
    plain = chat_body(max_tokens=4)
    async with served(*tiny_pair, engine={"suffix_max_mb": 0}) as (client, _):
        r = await client.post(CHAT, json=body())
        hybrid = (await client.post(CHAT, json=plain)).json()
    assert r.status_code == 400 and r.json()["error"]["param"] == "draft"
    assert "suffix_max_mb" in r.json()["error"]["message"]
    assert hybrid["stats"]["draft_model"] == f"prompt_lookup+{name}"
    async with served(*tiny_pair) as (client, _):
        hybrid = (await client.post(CHAT, json=plain)).json()
    assert hybrid["stats"]["draft_model"] == f"prompt_lookup+suffix+{name}"


async def test_the_index_is_measured_and_emptied_by_delete_cache(tiny_pair):
    async with served(*tiny_pair) as (client, engine):
        await client.post(CHAT, json=body())
        info = engine.suffix_info()
        assert info["texts"] == 1 and info["tokens"] > TOKENS
        assert 0 < info["bytes"] <= info["max_bytes"] == 64_000_000
        metrics = (await client.get("/metrics")).text
        assert f"mlx_spec_suffix_index_bytes {float(info['bytes'])}" in metrics
        assert f"mlx_spec_suffix_index_tokens {float(info['tokens'])}" in metrics
        r = await client.delete("/v1/cache")
        assert r.status_code == 200 and r.json()["suffix_answers"] == 1
        assert engine.suffix_info()["bytes"] == 0
        again = (await client.post(CHAT, json=body())).json()  # a first time again
        first_accepted = again["stats"]["draft_tokens_accepted"]
        repeat = (await client.post(CHAT, json=body())).json()
    assert repeat["stats"]["draft_tokens_accepted"] > first_accepted
