"""Admin endpoints: load, check and unload drafts at runtime; keys; model roots."""

from __future__ import annotations

import json
import shutil

import httpx
import mlx.core as mx
import pytest
from support.http import chat_body
from support.models import corrupt_copy
from support.servers import make_settings, served

from server.http.app import create_app

pytestmark = pytest.mark.anyio


@pytest.fixture()
async def admin_env(tiny_pair, model_dir):
    """A fresh engine per test: these tests change which draft is loaded."""
    async with served(*tiny_pair, model_roots=[model_dir]) as env:
        yield env


async def test_list_models_and_health(admin_env, tiny_pair):
    client, _ = admin_env
    data = (await client.get("/v1/models")).json()["data"]
    assert [(m["role"], m["path"]) for m in data] == [
        ("target", str(tiny_pair[0])), ("draft", str(tiny_pair[1]))]
    context = json.loads((tiny_pair[0] / "config.json").read_text())["max_position_embeddings"]
    assert [m["max_model_len"] for m in data] == [context, context]
    health = (await client.get("/health")).json()
    memory = health.pop("memory")  # this machine's: physical memory or a cgroup's limit
    assert memory["budget_bytes"] == memory["limit_bytes"] - memory["reserved_bytes"] - \
        memory["margin_bytes"] > 0
    assert memory["margin_bytes"] == int(memory["limit_bytes"] * 0.1)
    assert (memory["kv_bytes"], memory["preemptions"], memory["paused"]) == (0, 0, 0)
    assert health == {"status": "ok", "target": str(tiny_pair[0]), "draft": str(tiny_pair[1]),
                      "queue_depth": 0, "batch_size": 0, "cache_entries": 0, "cache_bytes": 0,
                      "disk_cache_entries": 0, "disk_cache_bytes": 0}


async def test_unload_frees_memory_then_load_again(admin_env, tiny_pair):
    client, engine = admin_env
    before = (await engine.memory())["active_gb"]
    r = await client.delete("/v1/models/draft")
    assert r.status_code == 200 and r.json()["deleted"] is True
    after = (await engine.memory())["active_gb"]
    draft_bytes = sum(v.nbytes for v in _params(tiny_pair[1]))
    assert before - after >= 0.9 * draft_bytes / 1e9
    assert (await client.delete("/v1/models/draft")).status_code == 404
    r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=3, draft="model"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "draft"
    r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=3,
                                                                   num_draft_tokens=2))
    assert r.status_code == 400 and r.json()["error"]["param"] == "num_draft_tokens"
    # A request that does not ask: the default drafter (hybrid) goes on with the host drafters.
    r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=3))
    assert r.status_code == 200 and r.json()["stats"]["draft_model"] == "prompt_lookup+suffix"
    r = await client.post("/v1/models/draft", json={"model": str(tiny_pair[1]),
                                                     "num_draft_tokens": 3})
    assert r.status_code == 200, r.text
    card = r.json()
    assert card["role"] == "draft" and card["num_draft_tokens"] == 3 and card["parameters"] > 0
    stats = (await client.post("/v1/chat/completions", json=chat_body(max_tokens=8))).json()
    assert stats["stats"]["num_draft_tokens"] == 3
    assert stats["stats"]["draft_model"].endswith(str(tiny_pair[1]))  # hybrid: "lookup+...+path"


def _params(path):
    return mx.load(str(path / "model.safetensors")).values()


async def test_compatibility(admin_env, tiny_pair, padded_draft, foreign_model):
    client, _ = admin_env
    url = "/v1/models/draft/compatibility"
    assert (await client.post(url, json={"model": str(padded_draft)})).json() == \
        {"compatible": True, "reason": None}
    r = (await client.post(url, json={"model": str(foreign_model)})).json()
    assert r["compatible"] is False and "tokenizers differ" in r["reason"]


async def test_padded_embedding_draft_loads_and_stays_greedy_exact(admin_env, padded_draft):
    client, _ = admin_env
    body = chat_body(max_tokens=20, use_draft=False)
    expected = (await client.post("/v1/chat/completions", json=body)).json()
    r = await client.post("/v1/models/draft", json={"model": str(padded_draft)})
    assert r.status_code == 200, r.text
    body = chat_body(max_tokens=20, num_draft_tokens=4)
    got = (await client.post("/v1/chat/completions", json=body)).json()
    assert got["choices"][0]["message"] == expected["choices"][0]["message"]


async def test_incompatible_draft_is_409_and_previous_keeps_serving(
    admin_env, tiny_pair, foreign_model
):
    client, _ = admin_env
    r = await client.post("/v1/models/draft", json={"model": str(foreign_model)})
    assert r.status_code == 409
    assert "tokenizers differ" in r.json()["error"]["message"]
    await _assert_draft_serving(client, tiny_pair[1])


async def _assert_draft_serving(client, draft):
    health = (await client.get("/health")).json()
    assert health["draft"] == str(draft)
    r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=6))
    assert r.status_code == 200 and r.json()["stats"]["draft_tokens_proposed"] > 0


async def test_failed_loads_keep_previous_draft(admin_env, tiny_pair, model_dir):
    client, _ = admin_env
    r = await client.post("/v1/models/draft", json={"model": str(model_dir / "missing")})
    assert r.status_code == 404
    corrupt = corrupt_copy(tiny_pair[1], model_dir / "corrupt")
    r = await client.post("/v1/models/draft", json={"model": str(corrupt)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_load_failed"
    await _assert_draft_serving(client, tiny_pair[1])


async def test_paths_outside_roots_are_forbidden(admin_env, tmp_path):
    client, _ = admin_env
    for url in ("/v1/models/draft", "/v1/models/draft/compatibility"):
        r = await client.post(url, json={"model": str(tmp_path)})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"


async def test_api_keys(tiny_pair, engine):
    settings = make_settings(*tiny_pair, api_key="user-key", admin_api_key="admin-key")
    app = create_app(settings, engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as client:
        assert (await client.get("/v1/models")).status_code == 401
        user = {"Authorization": "Bearer user-key"}
        assert (await client.get("/v1/models", headers=user)).status_code == 200
        r = await client.delete("/v1/models/draft", headers=user)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = await client.post("/v1/models/draft/compatibility", headers=user,
                              json={"model": str(tiny_pair[1])})
        assert r.status_code == 200
        assert (await client.get("/health")).status_code == 200


async def test_metrics_count_tokens_and_drafts(admin_env):
    client, _ = admin_env
    r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=9))
    stats = r.json()["stats"]
    text = (await client.get("/metrics")).text

    def value(name):
        line = next(x for x in text.splitlines() if x.startswith(name + " "))
        return float(line.split()[1])

    assert value("mlx_spec_generated_tokens_total") == 9
    assert value("mlx_spec_spec_decode_num_draft_tokens_total") == stats["draft_tokens_proposed"]
    assert value("mlx_spec_spec_decode_num_accepted_tokens_total") == \
        stats["draft_tokens_accepted"]
    assert value("mlx_spec_spec_decode_num_drafts_total") == sum(stats["k_histogram"].values())
    per_position = [
        float(x.split()[1]) for x in text.splitlines()
        if x.startswith("mlx_spec_spec_decode_num_accepted_tokens_per_pos_total{")
    ]
    assert sum(per_position) == stats["draft_tokens_accepted"]
    # By drafter: this request drafted with the draft model only.
    assert value('mlx_spec_drafter_draft_tokens_total{drafter="model"}') == \
        stats["draft_tokens_proposed"]
    assert value('mlx_spec_drafter_accepted_tokens_total{drafter="model"}') == \
        stats["draft_tokens_accepted"]
    # The same request with its answer as the prediction: drafted by the prediction alone.
    guess = {"type": "content", "content": r.json()["choices"][0]["message"]["content"]}
    r = await client.post("/v1/chat/completions", json=chat_body(
        max_tokens=9, prediction=guess, draft="prompt_lookup"))
    assert r.json()["stats"]["draft_tokens_proposed"] > 0
    text = (await client.get("/metrics")).text
    assert value('mlx_spec_drafter_accepted_tokens_total{drafter="prediction"}') == \
        r.json()["stats"]["draft_tokens_accepted"] > 0
    assert value("mlx_spec_queue_depth") == 0
    assert value("mlx_spec_running_requests") == 0
    assert value("mlx_spec_batch_size_count") >= 1
    assert 'mlx_spec_completions_total{endpoint="/v1/chat/completions",finish_reason="length"}' \
        in text


async def test_draft_candidates_are_the_smaller_models_with_the_targets_tokenizer(
        tiny_pair, padded_draft, foreign_model, tmp_path):
    roots = tmp_path / "roots"
    shutil.copytree(tiny_pair[1], roots / "a" / "copy-of-draft")
    shutil.copytree(padded_draft, roots / "padded")
    shutil.copytree(foreign_model, roots / "foreign")  # another tokenizer
    shutil.copytree(tiny_pair[0], roots / "target-copy")  # not smaller than the target
    shutil.copytree(tiny_pair[1], roots / "1" / "2" / "3" / "4" / "deep")  # below MAX_DEPTH
    no_tokenizer = shutil.copytree(tiny_pair[1], roots / "no-tokenizer")
    (no_tokenizer / "tokenizer.json").unlink()
    async with served(*tiny_pair, model_roots=[roots, tiny_pair[0].parent]) as (client, _):
        r = await client.get("/v1/models/draft/candidates")
        assert r.status_code == 200, r.text
        found = {c["path"]: c for c in r.json()["data"]}
        assert set(found) == {str(roots / "a" / "copy-of-draft"), str(roots / "padded"),
                              str(tiny_pair[1])}
        assert [c["path"] for c in found.values() if c["loaded"]] == [str(tiny_pair[1])]
        sizes = [c["size_gb"] for c in r.json()["data"]]
        assert sizes == sorted(sizes) and all(s > 0 for s in sizes)
        # Each loads as a draft.
        r = await client.post("/v1/models/draft", json={"model": str(roots / "padded")})
        assert r.status_code == 200, r.text
    async with served(*tiny_pair, admin_api_key="admin") as (client, _):
        assert (await client.get("/v1/models/draft/candidates")).status_code == 401


async def test_draft_model_auto_takes_the_smallest_candidate_small_enough(
        tiny_pair, padded_draft, foreign_model, tmp_path, monkeypatch):
    from server.http.admin import draft_candidates
    roots = tmp_path / "roots"
    shutil.copytree(padded_draft, roots / "padded")  # larger than the tiny draft
    shutil.copytree(foreign_model, roots / "foreign")  # smaller, another tokenizer
    models = {"draft_model": "auto", "model_roots": [str(roots), str(tiny_pair[1].parent)]}
    # The tiny draft has 65% of its target's weights: too big for the default rule.
    async with served(tiny_pair[0], None, models=models) as (client, engine):
        assert engine.draft is None
        assert [m["role"] for m in (await client.get("/v1/models")).json()["data"]] == [
            "target"]
    monkeypatch.setattr(draft_candidates, "AUTO_MAX_SHARE", 0.9)
    async with served(tiny_pair[0], None, models=models) as (client, engine):
        assert engine.draft.path == str(tiny_pair[1])
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Write a function"}], "max_tokens": 8,
            "num_draft_tokens": 2})
        assert r.json()["stats"]["draft_model"].endswith(str(tiny_pair[1]))  # hybrid's name
