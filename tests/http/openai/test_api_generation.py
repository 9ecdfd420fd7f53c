"""Generation through HTTP (httpx against the app) compared with mlx_lm itself."""

from __future__ import annotations

import pytest
from mlx_lm import generate, stream_generate
from support.http import chat_body, read_sse
from support.servers import make_settings, served

pytestmark = pytest.mark.anyio

MAX = 24


def reference_text(loaded_pair, prompt_tokens, max_tokens=MAX):
    target, tokenizer, _ = loaded_pair
    return generate(target, tokenizer, prompt_tokens, max_tokens=max_tokens)


def chat_tokens(tokenizer, content="Write a function"):
    return tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                         add_generation_prompt=True)


async def stream_chat(client, body):
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        return await read_sse(r)


def token_chunks(chunks):
    return [c for c in chunks if isinstance(c, dict) and c["choices"]
            and c["choices"][0].get("from_draft") is not None]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
async def test_greedy_with_draft_equals_mlx_without(client, loaded_pair, k):
    expected = reference_text(loaded_pair, chat_tokens(loaded_pair[1]))
    body = chat_body(max_tokens=MAX, temperature=0, num_draft_tokens=k)
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == expected
    chunks = await stream_chat(client, {**body, "stream": True})
    assert "".join(c["choices"][0]["delta"]["content"] for c in token_chunks(chunks)) == expected
    assert r.json()["stats"]["draft_tokens_proposed"] > 0


async def test_completions_endpoint_greedy_equals_mlx(client, loaded_pair):
    tokenizer = loaded_pair[1]
    expected = reference_text(loaded_pair, tokenizer.encode("def binary_search("))
    body = {"prompt": "def binary_search(", "max_tokens": MAX, "num_draft_tokens": 3}
    r = await client.post("/v1/completions", json=body)
    assert r.json()["choices"][0]["text"] == expected
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        chunks = await read_sse(s)
    assert all(c["object"] == "text_completion" for c in chunks[:-1])
    assert "".join(c["choices"][0]["text"] for c in token_chunks(chunks)) == expected


async def test_target_as_own_draft_accepts_everything(tiny_pair):
    """Same model on both sides at temperature 0: every drafted token must be accepted."""
    async with served(tiny_pair[0], tiny_pair[0]) as (client, engine):
        body = chat_body(max_tokens=MAX, num_draft_tokens=4, stream=True, adaptive=False)
        chunks = await stream_chat(client, body)
        target, tokenizer = engine.target.model, engine.tokenizer
        ref = list(stream_generate(target, tokenizer, chat_tokens(tokenizer), max_tokens=MAX,
                                   draft_model=target, num_draft_tokens=4))
    flags = [c["choices"][0]["from_draft"] for c in token_chunks(chunks)]
    # Every draft accepted: rounds of 4 drafts and a bonus token; ours start after the first
    # token, which comes from the prefill (mlx_lm's speculative loop drafts it).
    text = "".join(c["choices"][0]["delta"]["content"] for c in token_chunks(chunks))
    assert text == "".join(r.text for r in ref)
    assert flags == ([False] + ([True] * 4 + [False]) * MAX)[:MAX]
    assert [r.from_draft for r in ref] == (([True] * 4 + [False]) * MAX)[:MAX]
    stats = chunks[-2]["stats"]
    assert stats["draft_tokens_accepted"] == stats["draft_tokens_proposed"] > 0
    assert stats["acceptance_rate"] == 1.0


async def test_stream_and_non_stream_agree(client):
    body = chat_body("Tell me a story", max_tokens=40, num_draft_tokens=4,
                     stream_options={"include_usage": True})
    full = (await client.post("/v1/chat/completions", json=body)).json()
    chunks = await stream_chat(client, {**body, "stream": True})
    assert chunks[-1] == "[DONE]"
    tokens = token_chunks(chunks)
    finishes = [c for c in chunks[:-1] if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finishes) == 1
    stats = finishes[0]["stats"]
    assert "".join(c["choices"][0]["delta"]["content"] for c in tokens) == \
        full["choices"][0]["message"]["content"]
    assert sum(c["choices"][0]["from_draft"] for c in tokens) == stats["draft_tokens_accepted"]
    assert stats["generation_tokens"] == len(tokens) == full["usage"]["completion_tokens"]
    assert stats["draft_tokens_accepted"] <= stats["draft_tokens_proposed"]
    assert stats["from_draft_fraction"] == pytest.approx(
        stats["draft_tokens_accepted"] / stats["generation_tokens"])
    usage = chunks[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(tokens)
    assert tokens[0]["choices"][0]["delta"]["role"] == "assistant"


async def test_no_draft_stats_shape(client):
    r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=5, use_draft=False))
    stats = r.json()["stats"]
    assert stats["draft_model"] is None and stats["num_draft_tokens"] == 0
    assert stats["draft_tokens_proposed"] == stats["draft_tokens_accepted"] == 0
    assert stats["acceptance_rate"] is None and stats["from_draft_fraction"] == 0


async def test_max_tokens_and_stop(client):
    r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=7))
    assert r.json()["usage"]["completion_tokens"] == 7
    assert r.json()["choices"][0]["finish_reason"] == "length"
    text = r.json()["choices"][0]["message"]["content"]
    stop = text[3:6]
    r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=7, stop=[stop]))
    assert r.json()["choices"][0]["message"]["content"] == text[: text.index(stop)]
    assert r.json()["choices"][0]["finish_reason"] == "stop"


async def test_seeded_sampling_is_reproducible(client):
    body = chat_body(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, min_p=0.01,
                     repetition_penalty=1.1, seed=7, num_draft_tokens=4)
    a = (await client.post("/v1/chat/completions", json=body)).json()
    b = (await client.post("/v1/chat/completions", json=body)).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


async def test_logprobs(client, loaded_pair):
    body = chat_body(max_tokens=4, logprobs=True, top_logprobs=3, use_draft=False)
    lp = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["logprobs"]
    assert len(lp["content"]) == 4
    for entry in lp["content"]:
        assert len(entry["top_logprobs"]) == 3
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"])


@pytest.mark.parametrize("extra", [
    {"draft": "prompt_lookup", "num_draft_tokens": 4},
    {"draft": "hybrid", "num_draft_tokens": 4},
    {"draft": "hybrid", "num_draft_tokens": 4, "hybrid_min_match": 1},
    {"draft": "hybrid", "num_draft_tokens": 4, "hybrid_min_match": 3},
    {"acceptance": "exact", "adaptive": False, "num_draft_tokens": 3},
    {"acceptance": "rejection", "adaptive": True, "draft_p_min": 0.2, "num_draft_tokens": 8},
    {"draft": "hybrid", "adaptive": False, "draft_p_min": 0.4, "num_draft_tokens": 6},
    {"draft": "suffix", "num_draft_tokens": 4},
    {"draft": "suffix"},
], ids=["prompt_lookup", "hybrid", "hybrid-match-1", "hybrid-match-3", "exact-fixed",
        "rejection-adaptive-pmin", "hybrid-fixed-pmin", "suffix", "suffix-adaptive-16"])
async def test_every_drafting_mode_is_greedy_exact_over_http(client, loaded_pair, extra):
    content = "def add(a, b): return a + b\ndef add(a, b): return a + b\n"
    expected = reference_text(loaded_pair, chat_tokens(loaded_pair[1], content))
    r = await client.post("/v1/chat/completions", json=chat_body(content, max_tokens=MAX,
                                                                  **extra))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == expected
    stats = r.json()["stats"]
    if "draft" in extra:  # hybrid: the host drafters, then the draft model
        hosts = {"hybrid": ["prompt_lookup", "suffix"]}.get(extra["draft"], [extra["draft"]])
        draft_name = stats["draft_model"].split("+")
        assert draft_name[:len(hosts)] == hosts and len(draft_name) == len(hosts) + (
            extra["draft"] == "hybrid")
    assert sum(stats["k_histogram"].values()) > 0


async def test_prompt_lookup_needs_no_draft_model(tiny_pair):
    async with served(tiny_pair[0], None) as (client, _):
        ok = await client.post("/v1/chat/completions", json=chat_body(
            max_tokens=8, draft="prompt_lookup", num_draft_tokens=4))
        hybrid = await client.post("/v1/chat/completions", json=chat_body(  # needs a draft
            max_tokens=8, draft="hybrid", num_draft_tokens=4))
        refused = await client.post("/v1/chat/completions", json=chat_body(
            max_tokens=8, num_draft_tokens=4))
    assert ok.status_code == 200 and ok.json()["stats"]["num_draft_tokens"] == 4
    assert hybrid.status_code == 400 and hybrid.json()["error"]["param"] == "draft"
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "num_draft_tokens"


async def test_each_finished_generation_is_logged_with_its_drafts(client, caplog):
    with caplog.at_level("INFO", logger="server.requests"):
        r = await client.post("/v1/chat/completions",
                              json=chat_body(max_tokens=MAX, num_draft_tokens=3))
        plain = await client.post("/v1/completions",
                                  json={"prompt": "def f(", "max_tokens": 4, "use_draft": False})
    stats = r.json()["stats"]
    drafted, undrafted = [rec.getMessage() for rec in caplog.records
                          if rec.name == "server.requests"]
    request_id = r.headers["x-request-id"]
    assert drafted.startswith(f"/v1/chat/completions length [{request_id}]: prompt "
                              f"{stats['prompt_tokens']} ({stats['cached_tokens']} cached), "
                              f"{MAX} generated in ")
    assert drafted.endswith(f"drafts: {stats['draft_tokens_accepted']}/"
                            f"{stats['draft_tokens_proposed']} accepted "
                            f"({stats['acceptance_rate']:.0%}) by {stats['draft_model']}")
    assert plain.status_code == 200 and undrafted.endswith("; no drafts")
    assert undrafted.startswith(f"/v1/completions length [{plain.headers['x-request-id']}]:"
                                " prompt ")


@pytest.mark.parametrize("k", [0, 3])
async def test_stop_token_ids_end_the_output_as_eos_does(client, loaded_pair, k):
    target, tokenizer, _ = loaded_pair
    tokens = [r.token for r in stream_generate(target, tokenizer, chat_tokens(tokenizer),
                                               max_tokens=MAX)]
    stop = tokens[5]
    cut = tokens.index(stop)
    body = chat_body(max_tokens=MAX, temperature=0, num_draft_tokens=k, stop_token_ids=[stop])
    r = (await client.post("/v1/chat/completions", json=body)).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["message"]["content"] == tokenizer.decode(tokens[:cut])
    assert r["usage"]["completion_tokens"] == cut + 1  # the stop token counts, as EOS does
    # min_tokens holds it back; ignore_eos does not (vLLM's rules).
    held = (await client.post("/v1/chat/completions",
                              json={**body, "min_tokens": cut + 1})).json()
    assert held["choices"][0]["message"]["content"] != r["choices"][0]["message"]["content"]
    kept = (await client.post("/v1/chat/completions", json={**body, "ignore_eos": True})).json()
    assert kept["choices"][0]["message"]["content"] == r["choices"][0]["message"]["content"]
    bad = await client.post("/v1/chat/completions", json={**body, "stop_token_ids": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_token_ids"


async def test_mlx_lm_servers_sampling_fields(client, engine):
    """XTC and the penalties' context sizes, as mlx_lm.server takes them: XTC never drops a
    newline or an EOS token (mlx_lm.server's special tokens)."""
    from api_schemas.openai import ChatCompletionRequest
    from server.config import GenerationDefaults
    from server.http.common.request_mapping import sampling_params

    fields = {"xtc_probability": 0.5, "xtc_threshold": 0.2, "repetition_penalty": 1.2,
              "repetition_context_size": 5, "presence_context_size": 7,
              "frequency_context_size": 9}
    body = chat_body(max_tokens=8, temperature=0.8, seed=1, **fields)
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    tokenizer = engine.tokenizer
    sampling = sampling_params(ChatCompletionRequest(**body), GenerationDefaults(), tokenizer,
                               engine.vocab_size)
    assert {k: getattr(sampling, k) for k in fields} == fields
    newline = tokenizer.encode("\n", add_special_tokens=False)
    assert sampling.xtc_special_tokens == tuple(newline + sorted(tokenizer.eos_token_ids))
    r = await client.post("/v1/chat/completions", json={**body, "xtc_threshold": 0.6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "xtc_threshold"


@pytest.mark.parametrize("defaults", [{"top_k": 1}, {"min_p": 1.0}, {"top_k": 10**9}])
async def test_server_default_top_k_and_min_p(engine, tiny_pair, defaults):
    """mlx_lm.server's --top-k and --min-p: a request that sets neither gets them. top_k 1 or
    min_p 1 keep only the likeliest token, so sampling gives the greedy text; a top_k beyond
    the vocabulary keeps every token."""
    import httpx

    from server.http.app import create_app

    settings = make_settings(*tiny_pair)
    settings.defaults = settings.defaults.model_copy(update=defaults)
    transport = httpx.ASGITransport(app=create_app(settings, engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        greedy = await client.post("/v1/chat/completions", json=chat_body(max_tokens=16))
        sampled = await client.post("/v1/chat/completions", json=chat_body(
            max_tokens=16, temperature=1.0, seed=3))
        own = await client.post("/v1/chat/completions", json=chat_body(
            max_tokens=16, temperature=1.0, seed=3, top_k=0, min_p=0.0))  # the request's win
    text = [r.json()["choices"][0]["message"]["content"] for r in (greedy, sampled, own)]
    if defaults.get("top_k") == 10**9:
        assert text[1] == text[2]  # the same as no top_k at all
    else:
        assert text[0] == text[1] != text[2]
